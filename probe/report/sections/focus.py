"""Heads: per-head focus statistics, a layers × heads map per metric, role labels, the table."""

from __future__ import annotations

import math

TITLE = "Heads: focus statistics and roles"
ORDER = 40

# the metrics offered in the map selector, with a one-line reading of each
MAP_METRICS = (
    ("norm_entropy", "normalised entropy (1 = uniform over visible keys)"),
    ("entropy", "entropy (nats)"),
    ("confidence", "confidence: mean max weight (end token excluded)"),
    ("first", "first-token / sink mass"),
    ("special", "special-token mass"),
    ("content", "content mass (not first, not special)"),
    ("prev", "previous-token mass"),
    ("self", "self mass"),
    ("next", "next-token mass"),
    ("distance", "mean attention distance |i − j|"),
    ("span", "effective span: keys covering 90%"),
    ("pos_frac", "positional: share of queries at the modal offset"),
    ("dup_prefix", "duplicate-token score (prefix form)"),
    ("induction_prefix", "induction score (prefix form)"),
    ("word_self", "word-level self mass"),
)
TABLE_METRICS = (
    "entropy",
    "norm_entropy",
    "confidence",
    "first",
    "special",
    "prev",
    "self",
    "next",
    "distance",
    "span",
    "pos_frac",
    "dup_prefix",
    "induction_prefix",
)
ROLE_SHORT = {
    "previous-token": "prev",
    "self": "self",
    "next-token": "next",
    "sink": "sink",
    "broad/uniform": "broad",
    "induction": "ind",
    "duplicate-token": "dup",
    "local": "local",
    "positional": "pos",
    "none": "·",
}


def _heatmap(ctx, values, title: str) -> str:
    from matplotlib.figure import Figure

    L, H = values.shape
    fig = Figure(figsize=(max(3.0, 0.45 * H + 1.6), max(2.0, 0.4 * L + 1.0)))
    ax = fig.subplots()
    im = ax.imshow(values.numpy(), cmap="viridis", aspect="auto")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(H))
    ax.set_yticks(range(L))
    ax.set_title(title, fontsize=9)
    if L * H <= 256:
        finite = values[~values.isnan()]
        mid = float(finite.mean()) if finite.numel() else 0.0
        for i in range(L):
            for j in range(H):
                v = float(values[i, j])
                if not math.isnan(v):
                    ax.text(
                        j,
                        i,
                        f"{v:.2g}",
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="black" if v > mid else "white",
                    )
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return ctx.figure(fig, alt=title)


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.3g}"
    return "" if v is None else str(v)


def build(ctx) -> dict | None:
    """Statistics over every cache of the report: maps, role grids and the sortable table."""
    from probe.analysis.focus import SINK_EPSILON, head_stats

    caches = [c for c in ctx.caches if any(k.endswith("attn.pattern") for k in c.keys())]
    if not caches:
        return None
    ctx.progress("head statistics")
    stats = ctx.results.get("head_stats")
    if stats is None:
        stats = head_stats(caches, rollout=False, progress=False)
        ctx.results["head_stats"] = stats
    ctx.results["head_roles"] = {
        f"{r['stack']}/{r['kind']}/{r['layer']}/{r['head']}": r["role"] for r in stats.table
    }
    several = stats.n_texts > 1
    groups = []
    for key, rate in stats.sink_rate.items():
        stack, kind = key.split("/")
        rows = [r for r in stats.table if r["stack"] == stack and r["kind"] == kind]
        maps = []
        for metric, label in MAP_METRICS:
            vals = stats.map(metric, stack, kind)
            if bool(vals.isnan().all()):
                continue
            ctx.progress(f"head map: {stack} {kind} {metric}")
            maps.append(
                {"metric": metric, "label": label, "img": _heatmap(ctx, vals, f"{stack} {kind}: {label}")}
            )
        layers = sorted({r["layer"] for r in rows})
        heads = sorted({r["head"] for r in rows})
        by = {(r["layer"], r["head"]): r for r in rows}
        grid = []
        for layer in layers:
            cells = []
            for h in heads:
                r = by.get((layer, h))
                if r is None:
                    cells.append(None)
                    continue
                tip = f"L{layer} H{h}: {r['roles'] or 'none'}; " + ", ".join(
                    f"{m} {_fmt(r[m])}" for m in ("prev", "self", "first", "norm_entropy", "induction_prefix")
                )
                cells.append({"role": r["role"], "short": ROLE_SHORT.get(r["role"], r["role"]), "tip": tip})
            grid.append({"layer": layer, "cells": cells})
        cols = ["layer", "head", "kv_head", "role"] + list(TABLE_METRICS)
        if not any(r["kv_head"] is not None for r in rows):
            cols.remove("kv_head")
        table = []
        for r in rows:
            cells = []
            for c in cols:
                v = r[c]
                text = _fmt(v)
                if several and c in TABLE_METRICS and not math.isnan(r.get(f"{c}_std", float("nan"))):
                    text += f" ± {_fmt(r[f'{c}_std'])}"
                num = (
                    v
                    if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))
                    else None
                )
                cells.append({"text": text, "num": num})
            table.append(cells)
        counts: dict[str, int] = {}
        for r in rows:
            counts[r["role"]] = counts.get(r["role"], 0) + 1
        groups.append(
            {
                "id": f"focus-{stack}-{kind}",
                "stack": stack,
                "kind": kind,
                "sink_rate": None if math.isnan(rate) else rate,
                "roles": sorted(counts.items(), key=lambda x: -x[1]),
                "maps": maps,
                "heads": heads,
                "grid": grid,
                "columns": cols,
                "table": table,
                "kv_groups": stats.kv_groups,
            }
        )
    return {"groups": groups, "n_texts": stats.n_texts, "epsilon": SINK_EPSILON}
