r"""Two captures side by side: per-head pattern differences and focus-statistic differences.

``probe.compare(a, b) -> Comparison`` reads two caches (of the same model on two prompts, or of
two models, e.g. before and after fine-tuning) and compares what matches: the same stack, kind
(self/cross), layer index and model head index in both. Nothing is guessed: what does not match
(a stack, layers or heads only one cache has, a different number of texts, texts of different
lengths) is listed in ``Comparison.skipped``, and a :class:`~probe.errors.ProbeError` is raised
when no head at all can be compared.

Pattern differences
-------------------
Compared when both caches hold the same number of texts; text *t* of A is compared with text
*t* of B when both have the same number of real (unpadded) queries and keys (the tokens may
differ: a clean and a corrupted prompt). With ``P`` and ``Q`` one head's weights of text *t*
between real tokens (``[n_query, n_key]``, float64), ``D = |P − Q|``:

==========  =====================================================================================
column      definition
==========  =====================================================================================
max_abs     max D over every real cell, then the max over texts
mean_abs    mean D over every real cell (n_query × n_key), then the mean over texts
tv          total variation of each query's row, ½ Σ_k D_qk, averaged over the real queries,
            then over texts (0 = same pattern, 1 = disjoint)
js          Jensen–Shannon divergence of each row, ½ Σ_k P log(2P/(P+Q)) + ½ Σ_k Q log(2Q/(P+Q))
            in nats (0 log 0 = 0; at most log 2), averaged over real queries, then over texts
n_texts     the texts compared for this head (0: no pattern difference, see ``skipped``)
==========  =====================================================================================

Statistic differences
---------------------
:func:`probe.head_stats` of each cache (means over its texts, see :mod:`probe.analysis.focus`);
``Comparison.stats`` holds every metric of every matched head as ``a``, ``b`` and
``delta = b − a``; the heads table carries the roles (``role_a``, ``role_b``) and ``d_<metric>``
for :data:`DELTA_COLUMNS`. Statistics are compared even where patterns cannot be (two prompts of
different lengths).
"""

from probe.analysis.compare.core import compare, pattern_difference
from probe.analysis.compare.result import DELTA_COLUMNS, PATTERN_METRICS, Comparison

__all__ = ["compare", "Comparison", "pattern_difference", "PATTERN_METRICS", "DELTA_COLUMNS"]
