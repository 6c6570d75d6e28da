"""Heads: per-head focus statistics, a layers × heads map per metric, role labels, the table."""

from __future__ import annotations

import math

import numpy as np

from probe.analysis.focus import ROLE_RULES
from probe.report.matrix import NO_HEAD, mark_missing

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
# what each column of the table means, shown as the header's tooltip and in the legend above it
# (the full definitions, with sources: probe.analysis.focus)
COLUMN_HELP = {
    "layer": "layer index, counted from 0",
    "head": "head index, counted from 0",
    "kv_head": "the key/value head this query head shares (grouped-query attention)",
    "role": "the first role whose rule holds (see the roles legend); · = no rule holds",
    "entropy": "how spread out a query's weights are: −Σ a·log a over the keys it can see, in nats",
    "norm_entropy": "entropy ÷ log(keys visible): 0 = all weight on one key, 1 = uniform",
    "confidence": "the largest weight of a query (mean over queries; an end token as query excluded)",
    "first": "weight on the first token (the 'attention sink')",
    "special": "weight on special tokens ([CLS], [SEP], BOS, EOS)",
    "prev": "weight on the previous token (key i−1 for query i)",
    "self": "weight on the query's own token (key i)",
    "next": "weight on the next token (key i+1)",
    "distance": "mean |i − j|: how far, in tokens, a query looks on average",
    "span": "the fewest keys that hold 90% of a query's weight",
    "pos_frac": "share of queries whose strongest key sits at the same offset (positional heads)",
    "dup_prefix": "weight on earlier copies of the query's own token (duplicate-token pattern)",
    "induction_prefix": "weight on the token after an earlier copy of the query's token (induction)",
}
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


def _heatmap(ctx, values, title: str, missing=None) -> str:
    """A layers × heads map of ``values`` (NaN blank: undefined); ``missing`` cells (heads a layer
    does not have) hatched."""
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
    if missing is not None:
        mark_missing(ax, missing)
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
        return "—" if math.isnan(v) else f"{v:.3g}"
    return "" if v is None else str(v)


def _nan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


def why_missing(column: str, row: dict) -> str:
    """Why ``column`` has no value for a head (``row``), in words a reader can check."""
    if row["kind"] == "cross" and column in (
        "prev",
        "self",
        "next",
        "distance",
        "span",
        "pos_frac",
        *TEMPLATE,
    ):
        return "cross-attention: queries and keys are different texts, so token offsets do not apply"
    if column == "next" and row.get("causal"):
        return "a causal layer hides the next token from every query, so there is nothing to measure"
    if column in TEMPLATE:
        return "no query has an earlier copy of its own token in this text, so the template never applies"
    return "undefined here: no query of this head had at least two keys to choose from"


TEMPLATE = ("dup_prefix", "induction_prefix")


def _nearest(r: dict) -> tuple | None:
    """The role rule head ``r`` comes closest to: ``(value / threshold, role, metric, value,
    threshold)``; None when no rule's metric is defined. Template roles are left out (they also
    need enough matching queries)."""
    best = None
    for role, metric, threshold in ROLE_RULES:
        v = r.get(metric)
        if v is None or _nan(v) or metric in TEMPLATE:
            continue
        if best is None or v / threshold > best[0]:
            best = (v / threshold, role, metric, v, threshold)
    return best


def _nearest_role(r: dict) -> str:
    """For a head with no role, e.g. "closest to previous-token: prev 0.26 of the 0.5 it needs"."""
    best = _nearest(r)
    if best is None:
        return "no role rule applies"
    _, role, metric, v, threshold = best
    return f"closest to {role}: {metric} {v:.3g} of the {threshold:g} it needs"


def _closest(nameless: list[dict]) -> str | None:
    """The role-less head nearest to any role rule, in words (None when every head has a role)."""
    scored = [(b, r) for r in nameless if (b := _nearest(r)) is not None]
    if not scored:
        return None
    (_, role, metric, v, threshold), r = max(scored, key=lambda x: x[0][0])
    return (
        f"layer {r['layer']}, head {r['head']} comes closest, to {role}: {metric} {v:.3g} "
        f"where a {role} head needs {threshold:g}"
    )


def _grid(rows: list[dict]) -> tuple[list[int], list[dict]]:
    """The role grid: ``(heads, [{"layer", "cells"}])``, each cell its role's short name and a
    tooltip (for a head with no role: the rule it comes closest to)."""
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
            what = r["roles"] or f"no role ({_nearest_role(r)})"
            tip = f"layer {layer}, head {h}: {what}; " + ", ".join(
                f"{m} {_fmt(r[m])}" for m in ("prev", "self", "first", "norm_entropy", "induction_prefix")
            )
            cells.append({"role": r["role"], "short": ROLE_SHORT.get(r["role"], r["role"]), "tip": tip})
        grid.append({"layer": layer, "cells": cells})
    return heads, grid


def _why(c: str, row: dict, not_computed: dict[str, str]) -> str:
    """:func:`why_missing`, or why a rows cache's statistics leave ``c`` out."""
    if c in not_computed:
        return f"not computed: the cache kept only some query rows, and this metric {not_computed[c]}"
    return why_missing(c, row)


def _table(rows: list[dict], several: bool, not_computed: dict[str, str]) -> dict:
    """The sortable table: columns with their help, the columns left out (no head defines them)
    and why, and per row its cells (text, sort value, why a value is missing)."""
    cols = ["layer", "head", "kv_head", "role"] + list(TABLE_METRICS)
    if not any(r["kv_head"] is not None for r in rows):
        cols.remove("kv_head")
    dropped = [c for c in TABLE_METRICS if all(_nan(r[c]) for r in rows)]
    cols = [c for c in cols if c not in dropped]
    table = []
    for r in rows:
        cells = []
        for c in cols:
            v = r[c]
            text = _fmt(v)
            if several and c in TABLE_METRICS and not _nan(r.get(f"{c}_std", float("nan"))):
                text += f" ± {_fmt(r[f'{c}_std'])}"
            num = v if isinstance(v, (int, float)) and not _nan(v) else None
            cells.append({"text": text, "num": num, "tip": _why(c, r, not_computed) if _nan(v) else None})
        table.append(cells)
    return {
        "columns": cols,
        "help": {c: COLUMN_HELP.get(c, "") for c in cols},
        "dropped": [{"name": c, "why": _why(c, rows[0], not_computed)} for c in dropped],
        "table": table,
        "n_rows": len(rows),
    }


def _group(ctx, stats, stack: str, kind: str, rate: float) -> dict:
    rows = [r for r in stats.table if r["stack"] == stack and r["kind"] == kind]
    present = {(r["layer"], r["head"]) for r in rows}
    maps, missing = [], None
    for metric, label in MAP_METRICS:
        vals = stats.map(metric, stack, kind)  # [layer, head] by the model's numbers, NaN where none
        if bool(vals.isnan().all()):
            continue
        if missing is None:  # layers with fewer heads (or heads the cache left out): no values there
            L, H = vals.shape
            missing = np.array([[(i, h) not in present for h in range(H)] for i in range(L)])
        ctx.progress(f"head map: {stack} {kind} {metric}")
        img = _heatmap(ctx, vals, f"{stack} {kind}: {label}", missing)
        maps.append({"metric": metric, "label": label, "img": img})
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["role"]] = counts.get(r["role"], 0) + 1
    nameless = [r for r in rows if r["role"] == "none"]
    heads, grid = _grid(rows)
    return {
        "id": f"focus-{stack}-{kind}",
        "stack": stack,
        "kind": kind,
        "sink_rate": None if math.isnan(rate) else rate,
        "roles": sorted(counts.items(), key=lambda x: -x[1]),
        "maps": maps,
        "maps_note": NO_HEAD if missing is not None and missing.any() else None,
        "heads": heads,
        "grid": grid,
        **_table(rows, stats.n_texts > 1, getattr(stats, "not_computed", {})),
        "all_none": len(nameless) == len(rows),
        "closest": _closest(nameless),
        "kv_groups": stats.kv_groups,
    }


def build(ctx) -> dict | None:
    """Statistics over every cache of the report: maps, role grids and the sortable table."""
    from probe.analysis.focus import SINK_EPSILON, head_stats

    caches = [
        c for c in ctx.caches if any(k.endswith(("attn.pattern", "attn.stat.entropy")) for k in c.keys())
    ]
    if not caches:  # caches that kept query rows: the per-row statistics over those rows
        caches = [c for c in ctx.caches if any(k.endswith("attn.rows") for k in c.keys())]
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
    order = {"encoder/self": 0, "decoder/self": 1, "decoder/cross": 2}  # as the model reads
    items = sorted(stats.sink_rate.items(), key=lambda kv: (order.get(kv[0], 9), kv[0]))
    groups = [_group(ctx, stats, *key.split("/"), rate) for key, rate in items]
    rules = [
        {
            "role": role,
            "short": ROLE_SHORT.get(role, role),
            "rule": f"{metric} {'>' if role == 'sink' else '≥'} {t:g}",
        }
        for role, metric, t in ROLE_RULES
    ]
    kept = getattr(stats, "kept", None)
    note = None
    if any(c.kept == "stats" for c in caches):
        note = (
            "These statistics were computed while the model ran, a block of query rows at a time (the "
            "cache kept statistics only, no attention weight); not computed: "
            f"{', '.join(stats.not_computed) or 'nothing'}."
        )
    if kept:
        note = (
            f"These statistics are over the kept query rows {kept['rows']} of each text, not every query "
            f"(the cache kept only those rows); not computed, as they need every query row: "
            f"{', '.join(stats.not_computed)}."
        )
    return {
        "groups": groups,
        "n_texts": stats.n_texts,
        "epsilon": SINK_EPSILON,
        "rules": rules,
        "kept_note": note,
    }
