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
from probe.report.sections._patterns import FULL_BUDGET, FULL_BYTES, colour_lut, pack, pattern_sets

TITLE = "Weights and contributions"
ORDER = 21  # right after the attention views
KINDS = ("self", "cross")
SHOWN = ("stack", "layer", "head", "kind", "first", "first_contrib", "distance", "distance_contrib")


def holds(cache) -> bool:
    """Whether ``cache`` holds contributions (whole patterns, or statistics by contribution)."""
    return any(k.endswith(("attn.contribution", "attn.stat.contrib_first")) for k in cache.keys())


def _view(ctx, cache, by: str, key: str) -> dict | None:
    """One head explorer of ``cache``'s patterns ``by`` weight or contribution, on half the budget."""
    sets = pattern_sets([cache], KINDS, by=by)
    if not sets:
        return None
    packed, enc = pack(sets, progress=ctx.progress, cells=FULL_BUDGET // 2, nbytes=FULL_BYTES // 2)
    return {
        "id": key,
        "data": {"sets": packed, "scale": enc["scale"], "bytes": enc["bytes"], "lut": colour_lut()},
        "scale": enc["scale"],
    }


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
        "view_w": _view(ctx, cache, "weight", "contrib-w"),
        "view_c": _view(ctx, cache, "contribution", "contrib-c"),
    }
