"""What a stats, rows or top-k cache kept: the sink profile and distance curves, the kept rows over
every key, the mass the top-k keys hold, and, plainly, what was not kept (whole patterns: the
views that need them are left out).

A ``keep="stats"`` cache shows, per text, the sink profile (the mean weight each key position
receives, ``<attn>.received``) of every layer's heads over every real key (zoomable as the rows
are), and per stack the distance curves: the mass beyond 16, 128 and 1024 tokens and the 90%
reach of each layer (mean over heads and texts); its per-head maps are the focus section's.

A cache captured with ``keep={"rows": [...]}`` shows, per text and kept row, one heatmap of every
layer's heads (rows of the figure) over every real key (columns); click it to see it at full
resolution (one column per key up to :data:`MAX_COLUMNS`, then each column the largest weight of
a run of keys, as the caption says). A ``keep={"topk": k}`` cache shows the mean share of each
row the k keys keep, per layer and head.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure

from probe.cache import axes as _axes
from probe.cache.format import parse_key, parse_name
from probe.cache.kept import describe
from probe.report.matrix import DPI, NO_HEAD, head_grid, label_axis, mark_missing

TITLE = "What this cache kept"
ORDER = 15
MAX_TEXTS = 4  # texts drawn per cache
MAX_ROWS = 4  # kept rows drawn per text
MAX_COLUMNS = 8192  # figure columns; more keys are max-pooled into runs
NOT_SHOWN = {
    True: "the attention overview and head explorer, the causal-mask audit and the focus metrics "
    "that need every query row (offsets, words, templates, rollout), which read every row of a pattern,",
    False: "the attention overview and head explorer, the focus statistics and roles, and the "
    "causal-mask audit, which read every weight of a pattern,",
}


def _attentions(cache, field: str) -> list[tuple[str, str, int, str]]:
    """``(stack, kind, layer, key)`` of every ``field`` in ``cache``, in stack and layer order."""
    found = []
    for k in cache.keys():
        try:
            stack, layer, name = parse_key(k)
        except ValueError:
            continue
        n = parse_name(name)
        if n.field == field and n.index is None:
            found.append((stack, n.role, layer, k))
    return found


def _pool(m: np.ndarray, cols: int) -> tuple[np.ndarray, int]:
    """Columns of ``m`` max-pooled in runs so that at most ``cols`` remain; returns the run length."""
    run = max(1, math.ceil(m.shape[1] / cols))
    if run == 1:
        return m, 1
    pad = (-m.shape[1]) % run
    m = np.pad(m, ((0, 0), (0, pad)))
    return m.reshape(m.shape[0], -1, run).max(-1), run


def _row_figure(mat: np.ndarray, ylabels: list[str], keys: list[str], title: str) -> tuple[Figure, int]:
    """One kept row of every layer's heads over every key: ``[layers·heads, keys]``."""
    shown, run = _pool(mat, MAX_COLUMNS)
    width = min(MAX_COLUMNS, max(700, 6 * shown.shape[1])) / DPI
    height = max(2.5, min(14.0, 0.14 * len(ylabels) + 1.6))
    fig = Figure(figsize=(width + 1.6, height), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    vmax = float(shown.max()) or 1.0
    im = ax.imshow(
        shown, aspect="auto", interpolation="nearest", cmap="viridis", norm=PowerNorm(0.5, 0, vmax)
    )
    label_axis(ax, "y", ylabels)
    if run == 1:
        label_axis(ax, "x", keys)
    else:
        ax.set_xlabel(f"key position / {run}")
    ax.set_title(title, fontsize=10, loc="left")
    fig.colorbar(im, ax=ax, fraction=0.02, pad=0.01, label="weight (√ scale)")
    return fig, run


def _rows_items(ctx, ci: int, cache) -> list[dict]:
    items = []
    meta = cache.metadata
    groups: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for stack, kind, layer, k in _attentions(cache, "rows"):
        groups.setdefault((stack, kind), []).append((layer, k))
    for (stack, kind), layers in groups.items():
        tensors = [(layer, cache[k].float(), cache[k.replace(".rows", ".row_index")]) for layer, k in layers]
        B, _, R, K = tensors[0][1].shape  # layers may have different head counts (dim 1)
        asked = (meta.get("keep") or {}).get("rows") or list(range(R))
        q_side, k_side = _axes.sides(meta, cache.stacks, stack, kind)
        for b in range(min(B, MAX_TEXTS)):
            keys = _axes.axis(meta, k_side, b, K)
            for r in range(min(R, MAX_ROWS)):
                ctx.progress(f"kept rows, text {b + 1}")
                ylabels = [
                    f"L{layer} H{h}" for layer, t, _ in tensors for h in cache_heads(cache, t.shape[1])
                ]
                mat = torch.cat([t[b, :, r][:, keys.positions] for _, t, _ in tensors]).numpy()
                pos = int(tensors[0][2][b, r])
                tok = _token_at(meta, q_side, b, pos)
                what = f"{stack} {kind}-attention" if kind == "cross" else stack
                label = (f"cache {ci + 1}, " if len(ctx.caches) > 1 else "") + (
                    f"text {b + 1}, {what}, query {pos} ({tok!r}), kept row {asked[r]}"
                )
                fig, run = _row_figure(mat, ylabels, keys.tokens, label)
                items.append(
                    {
                        "label": label,
                        "fig": ctx.figure(fig, label),
                        "name": f"kept_rows_{ci}_{stack}_{kind}_{b}_{r}",
                        "run": run,
                        "n_keys": len(keys.positions),
                    }
                )
    return items


def _token_at(meta: dict, side: str, b: int, pos: int) -> str:
    """The display token at query position ``pos`` of text ``b`` on ``side`` (the position if unknown)."""
    prefix = "target_" if side == _axes.TARGET else ""
    tokens = (meta.get(f"{prefix}tokens") or [[]] * (b + 1))[b]
    mask = (meta.get(f"{prefix}attention_mask") or [None] * (b + 1))[b]
    real = [i for i, m in enumerate(mask) if m] if mask else list(range(len(tokens)))
    return str(tokens[real.index(pos)]) if pos in real and len(real) == len(tokens) else str(pos)


def cache_heads(cache, n: int) -> list[int]:
    captured = cache.metadata.get("heads_captured")
    return list(captured) if captured and len(captured) == n else list(range(n))


def _topk_items(ctx, ci: int, cache) -> list[dict]:
    items = []
    meta = cache.metadata
    groups: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for stack, kind, layer, k in _attentions(cache, "topk_mass"):
        groups.setdefault((stack, kind), []).append((layer, k))
    for (stack, kind), layers in groups.items():
        q_side, _ = _axes.sides(meta, cache.stacks, stack, kind)
        grid, heads, worst = [], [], []
        for _layer, k in layers:
            mass = cache[k].float()  # [B, H, Q]: H is the layer's own head count
            B, H, Q = mass.shape
            real = torch.zeros(B, Q, dtype=torch.bool)
            for b in range(B):
                real[b, _axes.axis(meta, q_side, b, Q).positions] = True
            sel = mass.permute(1, 0, 2)[:, real]  # [H, real queries of every text]
            grid.append(sel.mean(-1).tolist())
            heads.append(cache_heads(cache, H))
            worst.append(float(sel.min()))
        columns, m, missing = head_grid(grid, heads)
        fig = Figure(
            figsize=(min(12.0, 1.6 + 0.45 * m.shape[1]), min(10.0, 1.4 + 0.4 * m.shape[0])),
            dpi=DPI,
            layout="constrained",
        )
        ax = fig.add_subplot()
        im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=1)
        ax.set_yticks(range(len(layers)), [f"L{layer}" for layer, _ in layers])
        ax.set_xticks(range(m.shape[1]), [f"H{h}" for h in columns])
        mark_missing(ax, missing)
        for (i, j), v in np.ndenumerate(m):
            if m.size <= 400 and not missing[i, j]:
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w" if v < 0.6 else "k")
        what = f"{stack} {kind}-attention" if kind == "cross" else stack
        label = (f"cache {ci + 1}, " if len(ctx.caches) > 1 else "") + f"{what}: mean share of each row kept"
        ax.set_title(label + (f" ({NO_HEAD})" if missing.any() else ""), fontsize=10, loc="left")
        fig.colorbar(im, ax=ax, fraction=0.04, pad=0.01)
        items.append(
            {
                "label": label,
                "fig": ctx.figure(fig, label),
                "name": f"kept_topk_{ci}_{stack}_{kind}",
                "mean": float(np.nanmean(m)),  # over the heads there are
                "worst": min(worst),
            }
        )
    return items


NOT_SHOWN_STATS = (
    "the attention weights themselves (every pattern) and the residual tensors (only each "
    "position's L2 norm was kept); without them the attention overview and head explorer, the "
    "causal-mask audit, attention rollout and the residual stream anatomy are not in this report"
)
DISTANCES = (16, 128, 1024)


def _stats_items(ctx, ci: int, cache) -> list[dict]:
    """The sink profile figure of each text (up to :data:`MAX_TEXTS`) and the distance curves."""
    items = []
    meta = cache.metadata
    groups: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for stack, kind, layer, k in _attentions(cache, "received"):
        groups.setdefault((stack, kind), []).append((layer, k))
    prefix = f"cache {ci + 1}, " if len(ctx.caches) > 1 else ""
    for (stack, kind), layers in groups.items():
        what = f"{stack} {kind}-attention" if kind == "cross" else stack
        tensors = [(layer, cache[k].float()) for layer, k in layers]
        B, _, K = tensors[0][1].shape  # layers may have different head counts (dim 1)
        _, k_side = _axes.sides(meta, cache.stacks, stack, kind)
        ylabels = [f"L{layer} H{h}" for layer, t in tensors for h in cache_heads(cache, t.shape[1])]
        for b in range(min(B, MAX_TEXTS)):
            ctx.progress(f"sink profile, text {b + 1}")
            keys = _axes.axis(meta, k_side, b, K)
            mat = torch.cat([t[b][:, keys.positions] for _, t in tensors]).nan_to_num(0).numpy()
            label = f"{prefix}text {b + 1}, {what}: attention each key receives (sink profile)"
            fig, run = _row_figure(mat, ylabels, keys.tokens, label)
            items.append(
                {
                    "label": label,
                    "fig": ctx.figure(fig, label),
                    "name": f"kept_sink_{ci}_{stack}_{kind}_{b}",
                    "run": run,
                    "n_keys": len(keys.positions),
                }
            )
        if kind == "self":
            items.append(_distance_item(ctx, ci, cache, stack, [layer for layer, _ in layers], prefix + what))
    return items


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_DASHES = ("-", "--", ":", "-.")


def _distance_item(ctx, ci: int, cache, stack: str, layers: list[int], what: str) -> dict:
    """Per layer, the mean mass beyond each distance of :data:`DISTANCES` and the 90% reach."""
    base = [f"{stack}.blocks.{layer}.self_attn.stat." for layer in layers]
    beyond = np.array([[float(cache[b + f"beyond_{d}"].nanmean()) for d in DISTANCES] for b in base])
    reach = [float(cache[b + "reach90"].nanmean()) for b in base]
    fig = Figure(figsize=(7.5, 3.2), dpi=DPI, layout="constrained")
    ax, ax2 = fig.subplots(1, 2)
    for i, layer in enumerate(layers):
        # layers often lie on one another (a short text: every mass 0): each its own hollow marker
        # and dash, the markers shrinking with depth, so the first layers stay visible beneath
        ax.plot(
            DISTANCES,
            beyond[i],
            marker=_MARKERS[i % len(_MARKERS)],
            linestyle=_DASHES[i % len(_DASHES)],
            fillstyle="none",
            markersize=max(3.0, 9.0 - 0.5 * i),
            label=f"L{layer}",
        )
    ax.set_xscale("log")
    ax.set_xlabel("distance d (tokens)")
    ax.set_ylabel("mass beyond d")
    ax.set_ylim(0, 1)
    if len(layers) <= 12:
        ax.legend(fontsize=7)
    ax2.bar(range(len(layers)), reach)
    ax2.set_xticks(range(len(layers)), [f"L{layer}" for layer in layers])
    ax2.set_ylabel("90% reach (tokens)")
    label = f"{what}: distance curves (mean over heads and texts)"
    fig.suptitle(label, fontsize=10, x=0.01, ha="left")
    return {
        "label": label,
        "fig": ctx.figure(fig, label),
        "name": f"kept_distance_{ci}_{stack}",
        "run": 0,
        "n_keys": 0,
    }


def build(ctx) -> dict | None:
    """Per partial cache: what it kept, what it did not, and its figures; None when every cache
    holds whole patterns."""
    runs = []
    for ci, cache in enumerate(ctx.caches):
        if not cache.partial:
            continue
        kept = cache.kept
        rows = isinstance(kept, dict) and "rows" in kept
        stats = kept == "stats"
        if stats:
            items = _stats_items(ctx, ci, cache)
        else:
            items = _rows_items(ctx, ci, cache) if rows else _topk_items(ctx, ci, cache)
        runs.append(
            {
                "index": ci,
                "kept": describe(kept),
                "rows": rows,
                "stats": stats,
                "not_shown": NOT_SHOWN_STATS if stats else None,
                "figs": items,
                "k": kept.get("topk") if isinstance(kept, dict) else None,
            }
        )
    if not runs:
        return None
    return {
        "runs": runs,
        "not_shown": NOT_SHOWN[all(r["rows"] for r in runs if not r["stats"])],
        "multi": len(ctx.caches) > 1,
        "max_texts": MAX_TEXTS,
        "max_rows": MAX_ROWS,
    }
