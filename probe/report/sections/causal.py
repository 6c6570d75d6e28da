"""Causal-mask audit section: the verdict, future and pad mass per layer x head, a leaking head's pattern."""

from __future__ import annotations

from typing import Any

import numpy as np

from probe.report.matrix import NO_HEAD, head_grid, mark_missing

TITLE = "Causal-mask audit"
ORDER = 30

MAX_CELLS = 64
PAD_KINDS = (
    "pad_attention",
    "mask_over_queries",
)  # outline offending cells one by one up to this many positions


def _audit(ctx) -> Any:
    from probe.analysis.causal import check_causal
    from probe.analysis.causal.audit import ids_missing

    if "causal" in ctx.results:
        return ctx.results["causal"]
    cache = ctx.cache
    meta = cache.metadata
    why = ids_missing(meta)
    if ctx.model is None:
        report = check_causal(cache)
    elif why is None:  # the model is at hand and the cache holds its token ids: run the functional checks
        ctx.progress("causal audit: functional checks")
        if not meta.get("target_ids"):  # texts or ids: re-captured by the audit, as given
            inputs = meta.get("texts") or _ids(meta)
            report = check_causal(ctx.model, inputs, tokenizer=ctx.tokenizer)
        else:  # an encoder-decoder's source and target: the capture audited as it is
            report = check_causal(ctx.model, cache, tokenizer=ctx.tokenizer)
    else:  # sound, pictures, a float tensor: static checks; the model cannot take perturbed ids
        report = check_causal(cache)
        causal = [e for e in report.expected.values() if e != "bidirectional"]
        report.functional_skipped = why if causal else "no stack is expected causal"
        report.notes = [n for n in report.notes if not n.startswith("cache only:")]
    ctx.results["causal"] = report
    return report


def _ids(meta: dict) -> Any:
    import torch

    return torch.tensor(meta["ids"])


def verdict(ctx) -> dict | None:
    """The audit's one-line verdict for the report's summary: ``{"ok", "verdict"}``, or None when
    the audit cannot run on this cache (its own section then says why)."""
    from probe.errors import ProbeError

    try:
        report = _audit(ctx)
    except ProbeError:
        return None
    return {"ok": report.ok, "verdict": report.verdict()}


def _heatmaps(ctx, report) -> list[dict]:
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    out = []
    for label, g in report.grids.items():
        if not g["layers"]:
            continue
        mine = [
            f for f in report.findings if f.stack == label and f.head is not None and g.get("kind") == "self"
        ]
        boxed = {
            "future": {(f.layer, f.head) for f in mine if f.kind not in PAD_KINDS},
            "pad": {(f.layer, f.head) for f in mine if f.kind in PAD_KINDS},
        }
        panels = (
            [("future", "mass on later keys")]
            if report.expected.get(label) not in (None, "bidirectional")
            else []
        )
        panels.append(("pad", "mass on padding keys"))
        # a panel that is exactly 0 in every cell and has no finding says nothing a sentence cannot
        zero = [n for n, _ in panels if not boxed[n] and max(max(r) for r in g[n]) == 0]
        if zero:
            out.append({"label": label, "fig": None, "zero": [t for n, t in panels if n in zero]})
        panels = [p for p in panels if p[0] not in zero]
        if not panels:
            continue
        fig = Figure(figsize=(3.2 * len(panels) + 1, 0.45 * len(g["layers"]) + 1.4))
        axes = fig.subplots(1, len(panels))
        axes = axes if len(panels) > 1 else [axes]
        missing = False
        for ax, (name, title) in zip(axes, panels, strict=True):
            # layers may have different heads (each row its own): columns are the model's head numbers
            heads, data, absent = head_grid(g[name], _row_heads(g, g[name]))
            top = float(np.nanmax(data))
            im = ax.imshow(data, cmap="Reds", vmin=0, vmax=max(1e-6, top), aspect="auto")
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("head")
            ax.set_ylabel("layer")
            ax.set_xticks(range(len(heads)), [str(h) for h in heads])
            ax.set_yticks(range(len(g["layers"])), [str(layer) for layer in g["layers"]])
            missing = mark_missing(ax, absent) or missing
            for row, layer in enumerate(g["layers"]):
                for h in range(len(heads)):
                    if (layer, heads[h]) in boxed[name]:
                        ax.add_patch(Rectangle((h - 0.5, row - 0.5), 1, 1, fill=False, ec="black", lw=2))
            _mass_colorbar(fig, im, ax, top)
        note = f"; {NO_HEAD}" if missing else ""
        fig.suptitle(f"{label}: max over rows (boxed: a finding{note})", fontsize=9)
        fig.tight_layout()
        alt = f"{label} future and pad mass per layer and head"
        out.append({"label": label, "fig": ctx.figure(fig, alt), "alt": alt, "zero": []})
    return out


def _row_heads(g: dict, rows: list[list[float]]) -> list[list[int]]:
    """The model's head number of each value of each layer's row: the grid's ``heads`` (the cache's
    head selection) where a row has that many values, else 0, 1, ... (a layer of its own count)."""
    ids = list(g.get("heads") or [])
    return [ids if len(ids) == len(r) else list(range(len(r))) for r in rows]


def _mass_colorbar(fig, im, ax, top: float) -> None:
    """A colour bar whose ticks carry their own exponent (no offset text above the bar, which
    overlapped the frame) and a label that says when every cell is exactly 0."""
    from matplotlib.ticker import FuncFormatter

    cbar = fig.colorbar(im, ax=ax, shrink=0.8)
    cbar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: "0" if v == 0 else f"{v:.2g}"))
    cbar.ax.tick_params(labelsize=7)
    cbar.set_label("all exactly 0" if top == 0 else "attention mass", fontsize=7)


def _leaking_head(ctx, report) -> dict | None:
    import torch
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    from probe.analysis.causal import TOLERANCES
    from probe.report.matrix import label_axis

    cache = ctx.cache
    grid_of = {label: g for label, g in report.grids.items() if g.get("kind") == "self"}
    for f in report.findings:
        if f.layer is None or f.head is None or f.check != "static" or f.stack not in grid_of:
            continue
        stack = grid_of[f.stack]["cache_stack"]
        b = f.text or 0
        ids = cache.head_ids(stack, f.layer) if f.layer in cache.pattern_layers(stack) else []
        if f.head not in ids:
            continue  # the audit re-captured the model; the report's cache holds other layers/heads
        column = ids.index(f.head)  # f.head is the model's head index, ids those the cache holds
        p = cache.pattern(stack, f.layer, head=column, batch=b).float()
        Q, K = p.shape
        fut = torch.arange(K)[None, :] > (torch.arange(Q)[:, None] + K - Q)
        mask = cache.metadata.get("attention_mask")
        pad = torch.zeros(K, dtype=torch.bool)
        if mask and len(mask[b]) == K:
            pad = torch.tensor(mask[b]) == 0
        tol = TOLERANCES.get(report.dtype, TOLERANCES["float32"])["mass"]
        bad = ((fut | pad[None, :]) & (p.nan_to_num(0) > tol)) | ~torch.isfinite(p)
        fig = Figure(figsize=(5.2, 4.6))
        ax = fig.subplots()
        shown = p.nan_to_num(0)
        ax.imshow(shown.numpy(), cmap="Blues", vmin=0, vmax=max(float(shown.max()), 1e-6))
        toks = (cache.tokens or [[]])[b] if cache.tokens else []
        if len(toks) == K:  # tokens as in every figure (␣, CJK upright), thinned when long
            label_axis(ax, "x", toks)
            label_axis(ax, "y", toks[K - Q :])
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        if K <= MAX_CELLS:
            for q, k in bad.nonzero().tolist():
                ax.add_patch(Rectangle((k - 0.5, q - 0.5), 1, 1, fill=False, ec="#cf222e", lw=1.2))
        else:
            ax.contour(bad.float().numpy(), levels=[0.5], colors="#cf222e", linewidths=0.8)
        ax.set_title(f"{f.stack} layer {f.layer} head {f.head}: {f.kind}", fontsize=9)
        fig.tight_layout()
        alt = f"attention pattern of {f.stack} layer {f.layer} head {f.head} with offending cells outlined"
        return {"fig": ctx.figure(fig, alt), "alt": alt, "finding": f, "n_bad": int(bad.sum())}
    return None


def build(ctx) -> dict | None:
    """The verdict, the findings table, the checks, heatmaps and one leaking head's pattern."""
    report = _audit(ctx)
    ctx.progress("causal audit: figures")
    return {
        "ok": report.ok,
        "verdict": report.verdict(),
        "expected": report.expected,
        "findings": report.table._repr_html_() if report.findings else None,
        "checks": report.check_table._repr_html_() if report.checks else None,
        "notes": report.notes,
        "cost": report.cost(),
        "heatmaps": _heatmaps(ctx, report),
        "head": _leaking_head(ctx, report),
    }
