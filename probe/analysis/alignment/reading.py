"""What word timestamps read from one cache: per input, the cross-attention rows that predict its
text tokens, its words as groups of tokens, the frames that hold its audio; and the raw recipe's
spans (:mod:`.dtw`) and each head's shape, read from them.

The rows of input ``b`` are the decoder positions that predict its text tokens (the position
before each) and the one after the last, so token ``k`` spans from row ``k``'s first frame on the
path to row ``k + 1``'s (:mod:`.dtw`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from probe.analysis.alignment.dtw import path_starts
from probe.analysis.alignment.metrics import kendall_tau_b
from probe.analysis.alignment.timing import GoldWord, given_words, per_input, text_positions, token_words
from probe.errors import ProbeError


@dataclass
class Item:
    """One input: the cross-attention rows that predict its text tokens (and the one after), the
    tokens' decoder positions, its words as token indices, and the frames holding its audio."""

    rows: list[int]
    positions: list[int]
    words: list[str]
    word_tokens: list[list[int]]
    frames: int


def mean(xs: list[float]) -> float:
    """The mean of ``xs`` leaving NaN out (NaN when nothing is left)."""
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def read_items(
    meta: dict[str, Any],
    frames: dict[str, Any],
    words: Any,
    gold: list[list[GoldWord] | None],
    B: int,
    S: int,
) -> list[Item]:
    """Every input's :class:`Item` (the words as ``words`` spells them, else as the gold does, else
    the tokenizer's), checked against the gold's word count."""
    out = []
    given = per_input(words, B, "words=")
    for b in range(B):
        pos = text_positions(meta, b)
        if not pos:
            raise ProbeError(f"input {b} has no text tokens in the decoder; give the transcript as target=")
        if pos[0] == 0:
            raise ProbeError(
                f"input {b}'s first text token is at decoder position 0, so no row predicts it; the "
                "decoder inputs should start with the start token"
            )
        spelled = given[b]
        if spelled is None and gold[b] is not None and all(g.word for g in gold[b]):
            spelled = [g.word for g in gold[b]]
        wd = (
            given_words(meta["target_tokens"][b], pos, spelled, b)
            if spelled is not None
            else token_words(meta, b)
        )
        index = {p: k for k, p in enumerate(pos)}
        n_audio = int((frames.get("audio") or [S] * B)[b])
        out.append(
            Item(
                rows=[p - 1 for p in pos] + [pos[-1]],
                positions=pos,
                words=wd.words,
                word_tokens=[[index[p] for p in ps] for ps in wd.pieces],
                frames=max(1, min(n_audio, S)),
            )
        )
        if gold[b] is not None and len(gold[b]) != len(wd.words):
            raise ProbeError(
                f"gold input {b} has {len(gold[b])} words but the transcript has {len(wd.words)} "
                f"({' '.join(wd.words)}); give words= to group the tokens like the gold"
            )
    return out


def starts_of(Z: list[torch.Tensor], idx: list[int]) -> list[list[int]]:
    """Per input, the frame each row starts at on the raw recipe's path, for the heads ``idx`` of
    ``Z[b]``: each head's ``[row, frame]`` weights z-scored and filtered (:func:`.dtw.filtered`)."""
    return [path_starts(z[idx].mean(0)) for z in Z]


def word_spans(item: Item, starts: list[int], t) -> list[tuple[float, float]]:
    """The raw recipe's ``(start, end)`` of each word of ``item`` from its rows' ``starts``
    (``t``: frame to seconds): its first token's start to the start of the token after its last."""
    return [(t(starts[ks[0]]), t(starts[ks[-1] + 1])) for ks in item.word_tokens]


def shape_scores(w: torch.Tensor) -> tuple[float, float]:
    """``(monotonicity, diagonality)`` of one head's ``[row, frame]`` weights: the Kendall tau-b of
    each row's most attended frame against the row, and 1 minus the mean distance of (frame, row)
    from the diagonal, both as shares."""
    n, F = w.shape
    peak = w.argmax(-1).tolist()
    mono = kendall_tau_b(list(range(n)), peak) if n > 1 else math.nan
    diag = mean([1 - abs((f + 0.5) / F - (k + 0.5) / n) for k, f in enumerate(peak)])
    return mono, diag


__all__ = ["Item", "mean", "read_items", "shape_scores", "starts_of", "word_spans"]
