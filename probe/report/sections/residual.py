"""Residual stream and anatomy: |ΔE| per sublayer, the logit lens, direct logit attribution, the budget.

Always shown (from the cache): mean |resid_post| per layer with each sublayer's mean |ΔE| stacked.
With the model (``probe report --model/--hf``): the logit-lens grid (layers × positions, each cell
the layer's top token, coloured by the probability of the model's final prediction), direct
logit attribution bars per position, and the parameter budget as a chart and a table.
"""

from __future__ import annotations

import math
import re
from typing import Any

from probe.errors import ProbeError
from probe.report.labels import display
from probe.report.matrix import layer_ticks

TITLE = "Residual stream and anatomy"
ORDER = 50

TOP_K = 20  # direct-logit-attribution rows shown open per position; all of them folded below

_COLORS = {"self_attn": "#4c72b0", "cross_attn": "#55a868", "mlp": "#dd8452", "layer": "#8172b3"}


def _norms_figure(ctx, stats) -> str:
    from matplotlib.figure import Figure

    rows = list(stats.layers)
    stacks = sorted({r["stack"] for r in rows}, key=lambda s: s != "encoder")
    fig = Figure(figsize=(5.5 * len(stacks), 3.4))
    axes = fig.subplots(1, len(stacks), squeeze=False)
    for ax, stack in zip(axes[0], stacks, strict=True):
        mine = [r for r in rows if r["stack"] == stack]
        layers = sorted({r["layer"] for r in mine})
        bottom = [0.0] * len(layers)
        for sub in ("self_attn", "cross_attn", "mlp", "layer"):
            vals = [
                next((r["mean_norm_dE"] for r in mine if r["layer"] == i and r["sublayer"] == sub), 0.0)
                for i in layers
            ]
            if any(vals):
                ax.bar(range(len(layers)), vals, bottom=bottom, color=_COLORS[sub], label=f"|ΔE| {sub}")
                bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        post = [next(r["mean_norm_post"] for r in mine if r["layer"] == i) for i in layers]
        ax.plot(range(len(layers)), post, "k.-", label="|resid_post|")
        layer_ticks(ax, layers, range(len(layers)))
        ax.set_xlabel(f"{stack} layer")
        ax.set_ylabel("mean L2 norm over tokens")
        finite = [v for v in (*bottom, *post) if math.isfinite(v)]  # a NaN norm draws no bar, sets no limit
        ax.set_ylim(0, 1.4 * max(finite + [1e-9]))  # room above for the legend
        ax.legend(fontsize=8, loc="upper right", ncol=2)
    fig.tight_layout()
    return ctx.figure(fig, "residual norms per layer")


def _budget_figure(ctx, b) -> str:
    from matplotlib.figure import Figure

    rows = [r for r in b.by_role if r["parameters"] > 0]
    fig = Figure(figsize=(6.5, 0.32 * len(rows) + 0.8))
    ax = fig.subplots()
    ax.barh([r["role"] for r in rows][::-1], [100 * r["share"] for r in rows][::-1], color="#4c72b0")
    for i, r in enumerate(rows[::-1]):
        ax.text(100 * r["share"], i, f" {r['parameters']:,}", va="center", fontsize=8)
    ax.set_xlabel("share of all parameters (%)")
    ax.set_xlim(0, 118)
    fig.tight_layout()
    return ctx.figure(fig, "parameter budget")


def _lens(ctx, lens) -> dict[str, Any]:
    labels, toks, p, tops = lens.grid(0)
    toks = [display(t, None) for t in toks]
    tops = [[display(t, None) for t in row] for row in tops]
    grid = [
        {
            "label": lab,
            "cells": [{"top": tops[i][j], "p": round(float(p[i, j]), 3)} for j in range(len(toks))],
        }
        for i, lab in enumerate(labels)
    ]
    real = [t for t in range(lens.mask.shape[1]) if lens.mask[0, t]]  # positions of text 0's tokens
    pred = [display(lens.token(int(lens.predicted[0, t])), None) for t in real]
    out = {
        "tokens": toks,
        "grid": grid,
        "predicted": pred,
        "attribution": None,
        "readout": lens.readout,
        "error": lens.final_error,
    }
    att = lens.attribution
    if att is not None:
        out["attribution"] = _attribution(att, real, toks, pred)
    return out


def _absent_parts(att) -> tuple[set[str], bool]:
    """``(bias components, constant)`` that are exactly 0 at every position of every text: an
    output projection without a bias (``module(0)`` is exactly 0 only then) and a read-out with
    neither a norm bias nor an unembedding bias. A real bias's part is never exactly 0 at every
    position, so no small value is hidden."""
    nonzero: dict[str, bool] = {}
    for r in att.table:
        if r["head"] == "bias":
            nonzero[r["component"]] = nonzero.get(r["component"], False) or r["contribution"] != 0.0
    absent = {c for c, nz in nonzero.items() if not nz}
    return absent, not bool((att.constant != 0).any())


def _attribution(att, real: list[int], toks: list[str], pred: list[str]) -> dict[str, Any]:
    """Per position: the :data:`TOP_K` parts of largest |contribution| (open), and all parts in
    layer order (folded away) when there are more; parts that do not exist in the model left out."""
    absent, no_constant = _absent_parts(att)
    positions = []
    for j in range(len(toks)):
        bars = [b for b in att.bars(0, real[j]) + att.bars(0, real[j], heads=True) if b[0] not in absent]
        scale = max([abs(v) for _, v in bars] + [1e-12])
        rows = [{"name": n, "v": v, "w": round(50 * abs(v) / scale, 1)} for n, v in bars]
        top = sorted(rows, key=lambda r: -abs(r["v"]))[:TOP_K] if len(rows) > TOP_K else rows
        positions.append(
            {
                "pos": j,
                "token": toks[j],
                "predicted": pred[j],
                "logit": float(att.logit[0, real[j]]),
                "constant": None if no_constant else float(att.constant[0, real[j]]),
                "top": top,
                "bars": rows if len(rows) > TOP_K else None,
            }
        )
    notes = group_notes(att.notes)
    if absent:
        notes.append(
            f"no bias rows for {len(absent)} attention sublayer{'s' if len(absent) > 1 else ''}: the output "
            "projection has no bias (or one of zeros), its part is exactly 0 at every position"
        )
    if no_constant:
        notes.append("the read-out has no norm bias and no unembedding bias: the constant is exactly 0")
    return {"positions": positions, "error": att.max_error, "notes": notes, "top_k": TOP_K}


def group_notes(notes: list[str]) -> list[str]:
    """Notes that differ only in their ``L<i>.<sublayer>:`` prefix, merged into one note that
    names them all (a 12-layer encoder-decoder gave the same sentence 12 times); others as given."""
    out: list[str] = []
    merged: dict[str, list[str]] = {}
    for n in notes:
        m = re.match(r"^(L\d+\.\w+): (.*)$", n, re.S)
        if m is None:
            out.append(n)
        elif m[2] in merged:
            merged[m[2]].append(m[1])
        else:
            merged[m[2]] = [m[1]]
            out.append(m[2])  # placeholder, filled below in first-seen order
    return [f"{', '.join(merged[n])}: {n}" if n in merged else n for n in out]


def build(ctx) -> dict | None:
    """Residual statistics (always), and with ``ctx.model`` the logit lens, attribution and budget."""
    from probe.analysis import residual as rs

    cache = ctx.cache
    if not any(k.endswith("resid_pre") for k in cache.keys()):
        return None
    ctx.progress("residual stream")
    stats = ctx.results.get("residual") or rs.residual(cache)
    ctx.results["residual"] = stats
    s: dict[str, Any] = {
        "norms_fig": _norms_figure(ctx, stats),
        "layers": stats.layers,
        "notes": list(stats.notes),
        "lens": None,
        "budget": None,
    }
    if len(ctx.caches) > 1:
        s["notes"].append("residual statistics shown for the first cache only")
    b = None
    if ctx.model is not None:
        ctx.progress("logit lens")
        try:
            lens = ctx.results.get("logit_lens") or rs.logit_lens(ctx.model, cache, tokenizer=ctx.tokenizer)
            ctx.results["logit_lens"] = lens
            s["lens"] = _lens(ctx, lens)
            s["notes"] += group_notes(lens.notes)
        except ProbeError as e:
            s["notes"].append(f"no logit lens: {e}")
        b = rs.budget(ctx.model)
    else:
        cfg = (cache.metadata.get("model") or {}).get("config") or {}
        if cfg.get("model_type"):  # a Hugging Face model: its config alone gives the budget (meta device)
            try:
                b = rs.budget(cfg)
            except ProbeError as e:
                s["notes"].append(f"no parameter budget: {e}")
    if b is not None:
        ctx.results["budget"] = b
        s["budget"] = {
            "fig": _budget_figure(ctx, b),
            "table": b.by_role,
            "total": b.total,
            "matrices": b.matrices,
            "journey": b.journey_text(),
            "notes": b.notes,
        }
    return s
