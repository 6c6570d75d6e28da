"""Figures as an API (``probe.plot``): every function returns a :class:`matplotlib.figure.Figure`.

Figures are built with matplotlib's object-oriented API on a bare ``Figure`` (never pyplot), so
nothing touches global pyplot state or the user's backend, nothing is shown, and a script can
compose them (``ax=``) and save them as PNG, SVG or PDF (:func:`save`). In Jupyter a returned
Figure displays inline.

Index convention, the same in everything probe draws (figures, the report, its explorer): layers
and heads count from 0, as in cache keys and ``cache.pattern`` ("Layer 0, Head 0" is
``heatmap(cache, 0, 0)``, the first layer's first head). Only the tutorials' own figures
(:mod:`probe.report.seeds`) keep their 1-based titles, and say so in the title. Keys are on x,
queries on y, row 0 at the top; every cell is drawn with its value, the masked upper triangle
included (a causal leak shows up as colour there). Padding positions (``attention_mask`` 0) of
the chosen batch row are cropped. Tick labels are the tokens (whitespace made visible: ``␣``);
past what fits (about 90 labels per axis) every k-th is shown and the axis label says so.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import seaborn as sns
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from probe.cache.axes import Axis
from probe.cache.format import key
from probe.errors import ProbeError
from probe.report import fonts
from probe.report import labels as lab
from probe.report.matrix import DPI, axis_title, label_axis, layer_ticks, matrix, side_inches

_MAX_LINES = 8  # over_time: default number of query rows drawn


# -- reading heads out of a cache (the queries are the cache's own) -----------------------------
def head_ids(cache, stack: str, layer: int, kind: str = "self") -> list[int]:
    """The model's head indices of the cached pattern's head axis (all, or those captured)."""
    return cache.head_ids(stack, layer, kind)


def head_matrix(
    cache, layer: int, head: int = 0, *, stack: str | None = None, kind: str = "self", batch: int = 0
):
    """One head's weights with padding cropped: ``(weights [n_query, n_key], query Axis, key Axis)``
    (:meth:`probe.Cache.head_pattern` as a numpy array). ``stack`` defaults to the decoder (or the
    only stack); ``head`` is the model's head index."""
    w, q, k = cache.head_pattern(layer, head, stack=stack, kind=kind, batch=batch)
    return w.numpy(), q, k


def _title(cache, stack: str, layer: int, head: int, kind: str) -> str:
    base = f"Layer {layer}, Head {head}"
    if len(cache.stacks) > 1 or kind == "cross":
        return f"{stack.capitalize()} {kind}-attention, {base}"
    return base


def _tick_names(side: Axis, ticks: str) -> list[str]:
    if ticks == "tokens":
        return side.tokens
    if ticks == "positions":
        return [str(i) for i in range(len(side.tokens))]
    raise ProbeError(f"ticks must be 'tokens' or 'positions', not {ticks!r}")


# -- the figures -----------------------------------------------------------------------------
def heatmap(
    cache,
    layer: int,
    head: int = 0,
    *,
    stack: str | None = None,
    kind: str = "self",
    batch: int = 0,
    ax: Axes | None = None,
    title: str | None = None,
    xlabel: str = "Key",
    ylabel: str = "Query",
    cmap: str = "Blues",
    vmin: float | None = 0.0,
    vmax: float | None = None,
    ticks: str = "tokens",
) -> Figure:
    """One head's attention pattern: keys on x, queries on y, token labels, colour bar.

    Title "Layer L, Head H" (0-based, as the arguments; prefixed with the stack for
    encoder-decoders) unless ``title`` is given. The colour scale runs from ``vmin`` (0) to
    ``vmax`` (the head's largest weight). ``ticks="positions"`` labels positions 0.. instead of
    tokens. Returns the Figure.
    """
    w, q_side, k_side = head_matrix(cache, layer, head, stack=stack, kind=kind, batch=batch)
    stack = cache.pattern_stack(stack, kind)
    return matrix(
        w,
        _tick_names(k_side, ticks),
        _tick_names(q_side, ticks),
        title=_title(cache, stack, layer, head, kind) if title is None else title,
        xlabel=xlabel,
        ylabel=ylabel,
        cmap=cmap,
        ax=ax,
        vmin=vmin,
        vmax=vmax,
    )


def cross(
    cache, layer: int, head: int = 0, batch: int = 0, *, ax: Axes | None = None, title: str | None = None
) -> Figure:
    """Rectangular cross-attention of a decoder layer: target tokens (queries, y) over source
    tokens (keys, x). Returns the Figure."""
    return heatmap(
        cache,
        layer,
        head,
        stack="decoder",
        kind="cross",
        batch=batch,
        ax=ax,
        title=title,
        xlabel="Source (keys)",
        ylabel="Target (queries)",
    )


def _max_pool(m: np.ndarray, b: int) -> np.ndarray:
    """Max over b×b blocks (the last block may be partial): a single strong cell stays visible."""
    if b == 1:
        return m
    q, k = m.shape
    m = np.pad(m, ((0, -q % b), (0, -k % b)), constant_values=np.nan)
    return np.nanmax(m.reshape(m.shape[0] // b, b, m.shape[1] // b, b), axis=(1, 3))


def _hatch_cells(ax: Axes, cells: list[tuple[int, int]], h: int, w: int, gap: int) -> None:
    """Draw the (row, column) cells of an overview grid (``h`` x ``w`` pixels each, ``gap`` apart)
    empty and hatched: heads a layer does not have, never drawn as weights."""
    for r, c in cells:
        corner = (c * (w + gap) - 0.5, r * (h + gap) - 0.5)
        ax.add_patch(Rectangle(corner, w, h, facecolor="#f2f2f2", edgecolor="#b0b0b0", hatch="///", lw=0))


def overview(
    cache,
    *,
    stack: str | None = None,
    kind: str = "self",
    batch: int = 0,
    cmap: str = "Blues",
    scale: str = "head",
    max_pixels: int = 1600,
) -> Figure:
    """A layers × heads grid of every head's pattern (rows = layers from the top, columns = heads;
    in each cell queries run down and keys right).

    ``scale="head"`` divides each head by its own largest weight (so faint heads show their
    structure; the colour bar reads "fraction of the head's maximum"); ``scale="shared"`` keeps
    raw weights on one scale from 0. The grid is one image: when a head has more positions than
    its cell has room for (``max_pixels`` across the grid), each pixel shows the maximum over a
    block of b×b weights (the title says b), so a single strong weight is never lost. Layers may
    have different heads (the zoo's induction model: 4, then 1): the columns are every head number
    some layer has, and a head a layer does not have is an empty, hatched cell. Returns the Figure.
    """
    if scale not in ("head", "shared"):
        raise ProbeError(f"scale must be 'head' or 'shared', not {scale!r}")
    stack = cache.pattern_stack(stack, kind)
    layers = cache.pattern_layers(stack, kind)
    first = cache.head_ids(stack, layers[0] if layers else 0, kind)  # a one-line error if none
    own = {layer: cache.head_ids(stack, layer, kind) for layer in layers}  # layers may differ in heads
    heads = sorted({x for ids in own.values() for x in ids})  # the columns: every head some layer has
    n_q, n_k = head_matrix(cache, layers[0], first[0], stack=stack, kind=kind, batch=batch)[0].shape
    cell = max(8, max_pixels // max(len(layers), len(heads)))
    b = -(-max(n_q, n_k) // cell)
    h, w = -(-n_q // b), -(-n_k // b)
    gap = max(1, round(max(h, w) / 12))
    grid = np.full((len(layers) * (h + gap) - gap, len(heads) * (w + gap) - gap), np.nan, dtype=np.float32)
    for r, layer in enumerate(layers):
        for head in own[layer]:
            c = heads.index(head)
            m = head_matrix(cache, layer, head, stack=stack, kind=kind, batch=batch)[0]
            if scale == "head":
                m = m / max(float(np.nanmax(m)), np.finfo(np.float32).tiny)
            grid[r * (h + gap) : r * (h + gap) + h, c * (w + gap) : c * (w + gap) + w] = _max_pool(m, b)
    width = float(np.clip(0.9 * len(heads) * max(1.0, w / h), 4.0, 13.0))
    height = float(np.clip(width * grid.shape[0] / grid.shape[1], 2.5, 13.0))
    fig = Figure(figsize=(width + 1.3, height + 0.9), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    pixels = width * DPI
    image = ax.imshow(
        grid,
        cmap=cmap,
        vmin=0.0,
        vmax=1.0 if scale == "head" else float(np.nanmax(grid)),
        aspect="auto",
        interpolation="nearest" if max(grid.shape) <= pixels else "antialiased",
    )
    missing = [(r, c) for r, layer in enumerate(layers) for c, x in enumerate(heads) if x not in own[layer]]
    _hatch_cells(ax, missing, h, w, gap)
    ax.xaxis.tick_top()
    ax.set_xticks([c * (w + gap) + (w - 1) / 2 for c in range(len(heads))], [f"H{x}" for x in heads])
    ax.set_yticks([r * (h + gap) + (h - 1) / 2 for r in range(len(layers))], [f"L{x}" for x in layers])
    ax.tick_params(length=0, labelsize=8 if max(len(heads), len(layers)) <= 16 else 6)
    for spine in ax.spines.values():
        spine.set_visible(False)
    pooled = f"; each pixel the max of {b}×{b} weights" if b > 1 else ""
    ax.set_title(
        f"{stack.capitalize()} {kind}-attention, layers × heads (queries ↓, keys →{pooled})"
        + ("\nhatched: a head that layer does not have" if missing else ""),
        fontsize=10,
    )
    label = "fraction of the head's largest weight" if scale == "head" else "attention weight"
    fig.colorbar(image, ax=ax, fraction=0.03, pad=0.02, label=label)
    return fig


def over_time(
    cache,
    layer: int,
    head: int,
    queries: Sequence[int] | None = None,
    batch: int = 0,
    *,
    stack: str | None = None,
    kind: str = "self",
    ax: Axes | None = None,
    title: str | None = None,
    xlabel: str = "Key position",
    ylabel: str = "Attention weight",
    ticks: str = "tokens",
) -> Figure:
    """Chosen query rows as lines of attention weight over key positions.

    ``queries`` are positions among the row's real (unpadded) tokens; by default up to 8 evenly
    spaced rows. Lines are labelled "Query t=<position>: <token>"; x ticks are the key tokens
    (``ticks="positions"``: positions 0..). Returns the Figure.
    """
    w, q_side, k_side = head_matrix(cache, layer, head, stack=stack, kind=kind, batch=batch)
    n_q = w.shape[0]
    if queries is None:
        queries = sorted(set(np.linspace(0, n_q - 1, min(n_q, _MAX_LINES)).round().astype(int).tolist()))
    queries = [int(q) for q in queries]
    bad = [q for q in queries if not 0 <= q < n_q]
    if bad:
        raise ProbeError(f"queries {bad} are out of range: this row has {n_q} query positions (0..{n_q - 1})")
    title = (
        f"Attention over time, {_title(cache, cache.pattern_stack(stack, kind), layer, head, kind)}"
        if title is None
        else title
    )
    names = [f"Query t={q}: {lab.display(q_side.tokens[q])}" for q in queries]
    x_names = _tick_names(k_side, ticks)
    with fonts.context([*x_names, *names, title, xlabel, ylabel]):
        if ax is None:
            fig = Figure(
                figsize=(max(6.0, min(side_inches(w.shape[1]) + 2, 14.0)), 4.5),
                dpi=DPI,
                layout="constrained",
            )
            ax = fig.add_subplot()
        fig = ax.figure
        palette = sns.color_palette("tab10" if len(queries) <= 10 else "husl", len(queries))
        x = np.arange(w.shape[1])
        for q, name, color in zip(queries, names, palette, strict=True):
            # Legend entries are parsed as mathtext: escape "$" so a token shows as typed.
            label = name.replace("$", r"\$")
            ax.plot(x, w[q], marker="o", markersize=3 if w.shape[1] <= 64 else 0, color=color, label=label)
        k = label_axis(ax, "x", x_names)
        ax.set_xlim(-0.5, w.shape[1] - 0.5)
        ax.set_ylim(bottom=0)
        ax.set_title(title, parse_math=False)
        ax.set_xlabel(axis_title(xlabel, k), parse_math=False)
        ax.set_ylabel(ylabel, parse_math=False)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        sns.despine(ax=ax)
    return fig


_RESIDUAL_SERIES = (
    ("resid_pre", "|E| entering the layer", "o", "-"),
    ("resid_post", "|E| leaving the layer", "s", "-"),
    ("self_attn.delta", "|ΔE| self-attention", "^", "--"),
    ("cross_attn.delta", "|ΔE| cross-attention", "v", "--"),
    ("mlp.delta", "|ΔE| MLP", "D", "--"),
)


def residual_norm_values(cache, stack: str, batch: int = 0) -> dict[str, tuple[list[int], np.ndarray]]:
    """Residual-stream norms of one text: for each of ``resid_pre``, ``resid_post`` and the
    sublayer deltas, ``(layers, values)`` where a value is the L2 norm over d_model averaged over
    the row's real (unpadded) tokens. Series the cache lacks are left out."""
    out: dict[str, tuple[list[int], np.ndarray]] = {}
    positions = torch.as_tensor(cache.stream_axis(stack, batch).positions)
    for name, *_ in _RESIDUAL_SERIES:
        layers = cache.layer_indices(stack, name)
        if layers:
            values = [
                float(cache[key(stack, i, name)][batch, positions].float().norm(dim=-1).mean())
                for i in layers
            ]
        else:  # a keep="stats" cache holds each position's norm (``<name>.norm`` [batch, T]) instead
            layers = cache.layer_indices(stack, f"{name}.norm")
            values = [
                float(cache[f"{key(stack, i, name)}.norm"][batch, positions].double().mean()) for i in layers
            ]
        if layers:
            out[name] = (layers, np.asarray(values))
    return out


def residual_norms(cache, batch: int = 0) -> Figure:
    """|E| per layer (entering and leaving) and |ΔE| per sublayer (L2 over d_model, mean over real
    tokens), one panel per stack, layers counted from 0. Returns the Figure."""
    names = [n for n, *_ in _RESIDUAL_SERIES]
    stacks = [s for s in cache.stacks if any(cache.layer_indices(s, n) for n in names)]
    if not stacks:
        raise ProbeError("this cache holds no residual-stream tensors; capture without restricting them")
    fig = Figure(figsize=(6.0 * len(stacks), 4.2), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, len(stacks), squeeze=False)[0]
    for ax, stack in zip(axes, stacks, strict=True):
        series = residual_norm_values(cache, stack, batch)
        for name, label, marker, style in _RESIDUAL_SERIES:
            if name in series:
                layers, values = series[name]
                ax.plot(layers, values, marker=marker, linestyle=style, label=label)
        layer_ticks(ax, sorted({l for layers, _ in series.values() for l in layers}))
        ax.set_xlabel(f"{stack} layer" if len(cache.stacks) > 1 else "layer")
        ax.set_ylabel("L2 norm (mean over tokens)")
        ax.set_title(f"Residual stream, {stack}" if len(cache.stacks) > 1 else "Residual stream")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        sns.despine(ax=ax)
    return fig
