"""Which heads matter: each head's importance (the metric's change when it is removed, and the
gradient estimate) next to its role and focus statistics; patching maps when given.

The numbers come from a :class:`probe.HeadImportance` / :class:`probe.Patching` handed to
``probe.report(..., importance=, patching=)`` (``ctx.results["importance"]`` and
``ctx.results["patching"]``); this section never runs the model. Roles and statistics are the
focus section's (:func:`probe.head_stats` on the report's caches).
"""

from __future__ import annotations

import math

import numpy as np

from probe.errors import ProbeError
from probe.report.matrix import NO_HEAD, mark_missing

TITLE = "Which heads matter"
ORDER = 45  # after the focus statistics (40), whose head_stats it reuses
TOP = 10
STATS = ("entropy", "confidence", "first", "prev")
HOW = {"zero": "its output replaced by zeros", "mean": "its output replaced by its mean output"}


def signed(v: float) -> str:
    """A change or gradient as the table shows it: ``+0.1363`` (4 significant digits, sign)."""
    return "—" if math.isnan(v) else f"{v:+.4g}"


def plain(v) -> str:
    """A focus statistic as the table shows it (3 significant digits)."""
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3g}"


def _absent(imp) -> np.ndarray | None:
    """Where the importance grid ``[layer, head]`` has a cell for a head its layer does not have
    (layers may differ in heads; no row of the table measured it); None when every cell is a head."""
    present = {(r["layer"], r["head"]) for r in imp.table}
    layers = sorted({layer for layer, _ in present})
    L, H = imp.grid.shape
    if len(layers) != L:
        return None
    missing = np.array([[(layer, h) not in present for h in range(H)] for layer in layers])
    return missing if missing.any() else None


def _figure(
    ctx, values, rows: list[str], cols: list[str], title: str, xlabel: str, missing: np.ndarray | None = None
) -> str:
    """A signed layers × columns heatmap (red up, blue down, 0 white), cells annotated when few;
    ``missing`` cells (heads a layer does not have) hatched."""
    from matplotlib.figure import Figure

    L, C = values.shape
    fig = Figure(figsize=(max(3.2, 0.5 * C + 1.8), max(2.0, 0.4 * L + 1.0)))
    ax = fig.subplots()
    finite = values[~values.isnan()]
    top = float(finite.abs().max()) if finite.numel() else 1.0
    top = top or 1.0
    im = ax.imshow(values.float().numpy(), aspect="auto", cmap="RdBu_r", vmin=-top, vmax=top)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("layer")
    ax.set_xticks(range(C), cols, rotation=90 if C > 8 else 0, fontsize=7)
    ax.set_yticks(range(L), rows, fontsize=7)
    if missing is not None:
        mark_missing(ax, missing)
        title += f"\n({NO_HEAD})"
    ax.set_title(title, fontsize=9)
    if L * C <= 256:
        for i in range(L):
            for j in range(C):
                v = float(values[i, j])
                if not math.isnan(v):
                    white = abs(v) > 0.6 * top
                    ax.text(
                        j,
                        i,
                        f"{v:.2g}",
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white" if white else "black",
                    )
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return ctx.figure(fig, alt=title)


def _stats(ctx):
    """The focus statistics of the report's caches (shared with the focus section), or None."""
    stats = ctx.results.get("head_stats")
    if stats is None:
        caches = [c for c in ctx.caches if any(k.endswith("attn.pattern") for k in c.keys())]
        if not caches:
            return None
        from probe.analysis.focus import head_stats

        stats = head_stats(caches, rollout=False, progress=False)
        ctx.results["head_stats"] = stats
    return stats


def _matched(imp, stats) -> dict:
    """Each measured head's focus row, keyed ``(layer, head)``; a :class:`ProbeError` when the
    cache's heads of that stack are not the ones measured (another model)."""
    rows = list(imp.table)
    stack, kind = rows[0]["stack"], rows[0]["role"]
    have = {(r["layer"], r["head"]): r for r in stats.table if (r["stack"], r["kind"]) == (stack, kind)}
    want = {(r["layer"], r["head"]) for r in rows}
    if have and set(have) != want:
        raise ProbeError(
            f"the importance result measured {len(want)} {stack} {kind}-attention heads, the cache holds "
            f"{len(have)} (layers × heads differ): give a result measured on the cached model"
        )
    return have


def _importance(ctx, imp) -> dict:
    rows = [r for r in imp.table if not math.isnan(r["change"])]
    if not rows:
        raise ProbeError("the importance result holds no measured head")
    stats = _stats(ctx)
    focus = _matched(imp, stats) if stats is not None else {}
    top = sorted(rows, key=lambda r: -abs(r["change"]))[:TOP]
    table = []
    for rank, r in enumerate(top, 1):
        f = focus.get((r["layer"], r["head"]))
        table.append(
            {
                "rank": rank,
                "head": f"L{r['layer']}.H{r['head']}",
                "change": signed(r["change"]),
                "gradient": signed(r["gradient"]),
                "role": "—" if f is None else ("no role" if f["role"] == "none" else f["role"]),
                "stats": [plain(None if f is None else f.get(m)) for m in STATS],
            }
        )
    H = imp.grid.shape[1]
    cols = [f"H{h}" for h in range(H)]
    stack = rows[0]["stack"]
    texts = list(imp.texts)
    missing = _absent(imp)
    return {
        "metric": imp.metric_name,
        "how": HOW.get(imp.how, imp.how),
        "base": f"{rows[0]['metric']:.4g}",
        "stack": stack,
        "texts": texts[:5],
        "more_texts": max(0, len(texts) - 5),
        "n_heads": len(rows),
        "maps": [
            _figure(
                ctx,
                imp.grid,
                imp.rows,
                cols,
                f"{stack}: change of {imp.metric_name} when removed",
                "head",
                missing,
            ),
            _figure(
                ctx,
                imp.gradients,
                imp.rows,
                cols,
                f"{stack}: gradient ∂{imp.metric_name}/∂ξ",
                "head",
                missing,
            ),
        ],
        "top": table,
        "stat_names": STATS,
        "roles": stats is not None,
        "notes": list(imp.notes),
    }


def _patching(ctx, p) -> dict:
    xlabel = "head" if p.what == "heads" else "position:token"
    return {
        "what": p.what,
        "metric": p.metric_name,
        "clean": f"{p.clean:.4g}",
        "corrupted": f"{p.corrupted:.4g}",
        "map": _figure(ctx, p.grid, p.rows, p.cols, f"patching {p.what}: normalised {p.metric_name}", xlabel),
        "notes": list(p.notes),
    }


def build(ctx) -> dict | None:
    """Data for the section; None unless the report was given an importance or patching result."""
    imp, patches = ctx.results.get("importance"), ctx.results.get("patching") or []
    if imp is None and not patches:
        return None
    ctx.progress("which heads matter")
    return {
        "importance": None if imp is None else _importance(ctx, imp),
        "patching": [_patching(ctx, p) for p in patches],
    }
