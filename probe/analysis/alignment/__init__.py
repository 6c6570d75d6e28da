"""Cross-attention word alignment: soft and hard links, gold files, AER and gold-free metrics.

    >>> al = probe.align(cache)                       # a cache of an encoder-decoder
    >>> print(al.pharaoh())                           # 0-0 1-1 2-2 3-3
    >>> al = probe.align(cache, gold="links.talp")    # AER per layer/head, best selection
    >>> al.scores.top("aer", 5, descending=False)

Modules: :mod:`.words` (tokens -> words, special tokens), :mod:`.gold` (Pharaoh/talp IO),
:mod:`.metrics` (AER, precision, recall, diagonality, monotonicity, coverage, entropy, jumps,
symmetrization), :mod:`.core` (soft matrices, :class:`Alignment`, :func:`align`),
:mod:`.diagonal` (without gold: the most diagonal single heads, to compare with the heuristic
default), :mod:`.timestamps` (speech: word start and end times from the cross-attention over an
audio encoder's frames, :mod:`.dtw` and :mod:`.timing` its steps).
"""

from probe.analysis.alignment.core import Alignment, align, cross_layers, hard_links, soft_matrices
from probe.analysis.alignment.diagonal import candidates
from probe.analysis.alignment.gold import Gold, parse_gold, pharaoh, read_gold
from probe.analysis.alignment.metrics import kendall_tau_b, scores, shape_stats, symmetrize
from probe.analysis.alignment.timestamps import WordTimestamps, word_timestamps
from probe.analysis.alignment.words import Words, group_words, special_positions

__all__ = [
    "Alignment",
    "align",
    "candidates",
    "cross_layers",
    "hard_links",
    "soft_matrices",
    "Gold",
    "parse_gold",
    "read_gold",
    "pharaoh",
    "scores",
    "shape_stats",
    "symmetrize",
    "kendall_tau_b",
    "Words",
    "group_words",
    "special_positions",
    "WordTimestamps",
    "word_timestamps",
]
