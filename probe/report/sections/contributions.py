"""Weights and contributions side by side (shown when a cache holds contributions).

A cache of ``probe.contributions`` (or ``probe report --contributions``) holds, beside each
head's weights, its contributions ``||a_ij v_j W_O^h||`` (Kobayashi et al. 2020): how much of what
the head writes comes from each key. This section shows the two head explorers in step (report.js
pairs the views of a ``.probe-pair``: choosing a layer, head or cell in one shows it in the
other), the contributions with each row renormalised to sum 1 so the two read on one scale, and
the heads whose first-token share drops most from weight to contribution (``first`` and
``first_contrib`` of ``probe.head_stats``).
"""

from __future__ import annotations

import math

from probe.analysis.table import Table
from probe.report.sections._patterns import half_view

TITLE = "Weights and contributions"
ORDER = 21  # right after the attention views
KINDS = ("self", "cross")
SHOWN = ("stack", "layer", "head", "kind", "first", "first_contrib", "distance", "distance_contrib")


def holds(cache) -> bool:
    """Whether ``cache`` holds contributions (whole patterns, or statistics by contribution)."""
    return any(k.endswith(("attn.contribution", "attn.stat.contrib_first")) for k in cache.keys())


def _stats(ctx, cache):
    """``head_stats`` of ``cache`` (shared with the focus section when it reads this cache alone)."""
    from probe.analysis.focus import head_stats

    ends = ("attn.pattern", "attn.stat.entropy")  # the caches the focus section reads
    alone = [c for c in ctx.caches if any(k.endswith(ends) for k in c.keys())]
    stats = ctx.results.get("head_stats") if alone == [cache] else None
    if stats is None:
        ctx.progress("head statistics by weight and by contribution")
        stats = head_stats(cache, rollout=False, progress=False)
        if alone == [cache]:
            ctx.results["head_stats"] = stats
    return stats


def _mean(rows, column: str) -> float:
    vals = [r[column] for r in rows if not math.isnan(r[column])]
    return sum(vals) / len(vals) if vals else float("nan")


def build(ctx) -> dict | None:
    """The first cache that holds contributions, its weights and contributions in step."""
    cache = next((c for c in ctx.caches if holds(c)), None)
    if cache is None:
        return None
    stats = _stats(ctx, cache)
    rows = list(stats.table)
    top = None
    if stats.by_contribution is not None:
        drop = [r for r in rows if not math.isnan(r["first"] - r["first_contrib"])]
        drop.sort(key=lambda r: r["first_contrib"] - r["first"])
        top = Table(drop[:10], list(SHOWN), "")
    info = cache.metadata.get("contribution") or {}
    return {
        "first_weight": _mean(rows, "first"),
        "first_contrib": _mean(rows, "first_contrib") if stats.by_contribution is not None else None,
        "sink": stats.sink_rate,
        "sink_contrib": stats.by_contribution.sink_rate if stats.by_contribution is not None else {},
        "top": top,
        "refused": sorted((info.get("refused") or {}).items()),
        "view_w": half_view(ctx, cache, "contrib-w", KINDS, "weight"),
        "view_c": half_view(ctx, cache, "contrib-c", KINDS, "contribution"),
    }
