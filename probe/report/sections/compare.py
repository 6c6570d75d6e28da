"""Side by side: two captures compared head by head (shown when the report is given two caches).

The per-head pattern difference maps (total variation, layers × heads), the heads that changed
most, the focus-statistic differences, and the two captures' head explorers in step: choosing a
layer, head or cell in one shows the same in the other (report.js pairs the views of a
``.probe-pair``). Numbers come from :func:`probe.compare`.
"""

from __future__ import annotations

import math

import numpy as np

from probe.report.matrix import NO_HEAD, mark_missing
from probe.report.sections._patterns import half_view

TITLE = "Side by side"
ORDER = 22  # after the attention views of each capture on its own
KINDS = ("self", "cross")
SHOWN = ("stack", "layer", "head", "kind", "n_texts", "max_abs", "mean_abs", "tv", "js", "role_a", "role_b")
STAT_MAPS = ("d_entropy", "d_first", "d_prev", "d_distance")


def _map_figure(ctx, values, title: str, signed: bool, present: set | None = None) -> str:
    """A layers × heads heatmap of ``values`` (NaN blank), each cell annotated when few; cells of
    heads not in ``present`` (``(layer, head)``: layers may differ in heads) hatched."""
    from matplotlib.figure import Figure

    L, H = values.shape
    fig = Figure(figsize=(max(3.2, 0.45 * H + 1.8), max(2.0, 0.4 * L + 1.0)))
    ax = fig.subplots()
    finite = values[~values.isnan()]
    top = float(finite.abs().max()) if finite.numel() else 1.0
    top = top or 1.0
    kw = {"cmap": "RdBu_r", "vmin": -top} if signed else {"cmap": "magma", "vmin": 0.0}
    im = ax.imshow(values.float().numpy(), aspect="auto", vmax=top, **kw)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(H))
    ax.set_yticks(range(L))
    if present is not None:
        missing = np.array([[(i, j) not in present for j in range(H)] for i in range(L)])
        if mark_missing(ax, missing):
            title += f"\n({NO_HEAD})"
    ax.set_title(title, fontsize=9)
    if L * H <= 256:
        for i in range(L):
            for j in range(H):
                v = float(values[i, j])
                if not math.isnan(v):
                    dark = abs(v) < 0.6 * top if not signed else abs(v) > 0.6 * top
                    ax.text(
                        j,
                        i,
                        f"{v:.2g}",
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white" if dark else "black",
                    )
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return ctx.figure(fig, alt=title)


def build(ctx) -> dict | None:
    """The comparison of ``ctx.caches[0]`` (A) and ``ctx.caches[1]`` (B); None unless there are two."""
    if len(ctx.caches) != 2:
        return None
    from probe.analysis.compare import compare

    ctx.progress("comparing the two caches")
    c = ctx.results.get("comparison") or compare(*ctx.caches)
    ctx.results["comparison"] = c
    groups = []
    for stack, kind in dict.fromkeys((r["stack"], r["kind"]) for r in c.heads):
        where = f"{stack} {kind}-attention"
        present = {(r["layer"], r["head"]) for r in c.heads if (r["stack"], r["kind"]) == (stack, kind)}
        maps = []
        if any(r["n_texts"] for r in c.heads if (r["stack"], r["kind"]) == (stack, kind)):
            tv = c.map("tv", stack, kind)
            maps.append(_map_figure(ctx, tv, f"{where}: total variation A vs B (0 = same)", False, present))
        for m in STAT_MAPS:
            maps.append(_map_figure(ctx, c.map(m, stack, kind), f"{where}: {m[2:]} B − A", True, present))
        groups.append({"title": where, "maps": maps})
    by = "tv" if c.compared_patterns else "d_entropy"
    top = c.top(20, by=by)
    top.title = ""  # the template's heading says it
    roles = [r for r in c.heads if r["role_changed"]]
    return {
        "labels": c.labels,
        "summary": c.summary().splitlines(),
        "skipped": c.skipped,
        "groups": groups,
        "by": by,
        "top": top.select(list(SHOWN) + ([by] if by not in SHOWN else [])),
        "roles": roles,
        "n_heads": len(c.heads),
        "view_a": half_view(ctx, ctx.caches[0], "compare-a", KINDS),
        "view_b": half_view(ctx, ctx.caches[1], "compare-b", KINDS),
    }
