"""Figures on the picture (``probe.plot.image_map``, ``probe.plot.image_heads``).

A map over an image's patch grid (:func:`probe.attention_map`) drawn as the model cut the picture:
patch (r, c) covers rows ``r * patch_h`` to ``(r + 1) * patch_h`` of the processed image and the
matching columns, so the axes are in input pixels. Given the picture (a PIL image, an ``[H, W(,
C)]`` array or an image file), it is resized to the processed size and drawn beneath the map.
Like every probe figure: a bare ``Figure``, layers and heads counted from 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from probe.analysis.maps import attention_map, image_grid, image_stack
from probe.errors import ProbeError
from probe.report.matrix import DPI, layer_ticks


def _picture(picture: Any, size: tuple[int, int]) -> np.ndarray:
    """``picture`` as an RGB array resized to ``size`` (height, width), values in [0, 1]."""
    from PIL import Image

    if isinstance(picture, (str, Path)):
        try:
            with Image.open(picture) as img:
                picture = img.convert("RGB")
        except (OSError, ValueError) as e:
            raise ProbeError(f"cannot read {str(picture)!r} as a picture ({e})") from None
    if not isinstance(picture, Image.Image):
        arr = np.asarray(picture)
        if arr.dtype != np.uint8:
            arr = (np.clip(arr, 0, 1) * 255).astype(np.uint8)
        picture = Image.fromarray(arr.squeeze()).convert("RGB")
    H, W = size
    return np.asarray(picture.convert("RGB").resize((W, H)), dtype=np.float32) / 255.0


def _query_name(query: Any, cache: Any, stack: str, batch: int) -> str:
    if query == "rollout":
        return "rollout from [CLS]"
    if query == "cls":
        return "[CLS]"
    if isinstance(query, tuple):
        return f"patch {query}"
    tokens = cache.tokens[batch] if cache.tokens and batch < len(cache.tokens) else []
    return f"position {query}" + (f" ({tokens[query]!r})" if 0 <= query < len(tokens) else "")


def draw_map(
    ax: Axes,
    m: np.ndarray,
    grid: dict[str, Any],
    picture: Any = None,
    alpha: float = 0.6,
    cmap: str = "inferno",
) -> Any:
    """Draw map ``m`` ``[rows, cols]`` over its image's pixels on ``ax`` (the picture beneath)."""
    H, W = grid["image"]
    extent = (0, grid["cols"] * grid["patch"][1], grid["rows"] * grid["patch"][0], 0)
    if picture is not None:
        ax.imshow(_picture(picture, (H, W)), extent=(0, W, H, 0))
    im = ax.imshow(
        m,
        extent=extent,
        cmap=cmap,
        alpha=alpha if picture is not None else 1.0,
        interpolation="nearest",
        vmin=0,
    )
    ax.set_xlim(0, W)
    ax.set_ylim(H, 0)
    return im


def _panels(n: int, max_cols: int, size: tuple[float, float]) -> tuple[Figure, list[Axes]]:
    """A figure of ``n`` panels in rows of at most ``max_cols``, each ``size`` (width, height)
    inches; the first ``n`` axes, the grid's spare ones turned off."""
    cols = min(n, max_cols)
    rows = -(-n // cols)
    fig = Figure(figsize=(size[0] * cols, size[1] * rows + 0.4), dpi=DPI, layout="constrained")
    axes = list(np.atleast_1d(fig.subplots(rows, cols)).reshape(-1))
    for ax in axes[n:]:
        ax.set_axis_off()
    return fig, axes[:n]


def _outline(ax: Axes, cells: list[tuple[int, int]], grid: dict[str, Any]) -> None:
    """Outline the patches ``cells`` ``(row, col)`` of ``grid`` on ``ax``."""
    from matplotlib.patches import Rectangle

    ph, pw = grid["patch"]
    for r, c in cells:
        ax.add_patch(Rectangle((c * pw, r * ph), pw, ph, fill=False, edgecolor="cyan", linewidth=1.2))


def image_map(
    cache: Any,
    layer: int,
    head: int | None = None,
    *,
    query: Any = "cls",
    stack: str | None = None,
    batch: int = 0,
    image: int = 0,
    picture: Any = None,
    alpha: float = 0.6,
    cmap: str = "inferno",
) -> Figure:
    """What one query reads of the picture (:func:`probe.attention_map`), over the image's pixels,
    the picture beneath when given; a colour bar of the weights. Returns the Figure."""
    m = attention_map(cache, layer, head, query, stack, batch, image).numpy()
    stack, pos = image_grid(cache, stack, batch, image)
    grid = pos["grid"]
    fig = Figure(figsize=(5.2, 4.2), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    im = draw_map(ax, m, grid, picture, alpha, cmap)
    fig.colorbar(im, ax=ax, label="attention weight")
    who = "mean over heads" if head is None or query == "rollout" else f"Head {head}"
    ax.set_title(f"Layer {layer}, {who}: what {_query_name(query, cache, stack, batch)} reads", fontsize=10)
    ax.set_xlabel("x (input pixels)")
    ax.set_ylabel("y (input pixels)")
    return fig


def image_heads(
    cache: Any,
    layer: int,
    *,
    query: Any = "cls",
    stack: str | None = None,
    batch: int = 0,
    image: int = 0,
    picture: Any = None,
    alpha: float = 0.6,
    cmap: str = "inferno",
) -> Figure:
    """One small map per head of ``layer`` for one query, side by side (each on its own scale)."""
    if query == "rollout":
        raise ProbeError("rollout mixes every head; use image_map(..., query='rollout')")
    stack, pos = image_grid(cache, stack, batch, image)
    grid = pos["grid"]
    n = cache.pattern(stack, layer, batch=batch).shape[0]
    fig, axes = _panels(n, 6, (2.2, 2.2))
    for h, ax in enumerate(axes):
        draw_map(
            ax, attention_map(cache, layer, h, query, stack, batch, image).numpy(), grid, picture, alpha, cmap
        )
        ax.set_title(f"Head {h}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(
        f"Layer {layer}: what {_query_name(query, cache, stack, batch)} reads, per head", fontsize=10
    )
    return fig


def picture_of(cache: Any, batch: int = 0) -> np.ndarray | None:
    """The picture the model saw for text ``batch`` (the cache's ``image_png``), as an RGB array
    in [0, 1]; None when the cache holds none."""
    import base64
    import io

    from PIL import Image

    pngs = cache.metadata.get("image_png") or []
    if not 0 <= batch < len(pngs):
        return None
    with Image.open(io.BytesIO(base64.b64decode(pngs[batch]))) as img:
        return np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0


def image_layers(
    cache: Any,
    *,
    query: Any = "cls",
    stack: str | None = None,
    batch: int = 0,
    picture: Any = None,
    alpha: float = 0.6,
    cmap: str = "inferno",
    artifacts: Any = None,
) -> Figure:
    """One map per layer for one query (mean over heads), then attention rollout up to the last
    layer when the model has a class token; each on its own scale. With ``artifacts`` (a
    :class:`probe.Artifacts` of the cache) each layer's artifact patches are outlined in cyan."""
    stack, pos = image_stack(cache, stack)
    if "grid" not in pos:
        raise ProbeError("image_layers draws an image model's own grid; for a text's pictures use image_map")
    layers = cache.pattern_layers(stack)
    panels = [(f"Layer {i}", attention_map(cache, i, None, query, stack, batch)) for i in layers]
    if "class" in pos["kinds"] and layers == list(range(len(layers))):
        panels.append(
            (f"rollout to L{layers[-1]}", attention_map(cache, layers[-1], None, "rollout", stack, batch))
        )
    fig, axes = _panels(len(panels), 6, (2.2, 2.1))
    for ax, panel in zip(axes, panels, strict=True):
        draw_map(ax, panel[1].numpy(), pos["grid"], picture, alpha, cmap)
        if artifacts is not None and panel[0].startswith("Layer "):
            _outline(ax, artifacts.positions(int(panel[0].split()[1]), batch=batch), pos["grid"])
        ax.set_title(panel[0], fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(
        f"What {_query_name(query, cache, stack, batch)} reads, layer by layer (mean over heads)", fontsize=10
    )
    return fig


def stage_maps(
    cache: Any,
    *,
    stack: str | None = None,
    batch: int = 0,
    picture: Any = None,
    alpha: float = 0.6,
    cmap: str = "inferno",
) -> Figure:
    """For a stack whose layers have grids of their own (Swin's stages, ``positions
    ["layer_grids"]``): what the patch at the centre of each stage's grid reads, one panel per
    block of each stage (mean over heads), the query patch outlined."""
    stack, pos = image_stack(cache, stack)
    grids = pos.get("layer_grids") or {}
    if not grids:
        raise ProbeError("stage_maps draws a stack whose layers have grids of their own (Swin's stages)")
    panels = []
    for layer in sorted(int(k) for k in grids):
        g = grids[str(layer)]
        centre = (g["rows"] // 2, g["cols"] // 2)
        for _kind, index in [a for a in cache.attentions(stack, layer) if a[0] == "self"]:
            m = attention_map(cache, layer, None, centre, stack, batch, index=index)
            name = f"L{layer}" + (f" block {index}" if index is not None else "")
            panels.append((name, m, g, centre))
    if not panels:
        raise ProbeError(f"the {stack} stack has no self-attention stored on its stages' grids")
    fig, axes = _panels(len(panels), 4, (2.8, 2.1))
    for ax, panel in zip(axes, panels, strict=True):
        name, m, g, centre = panel
        draw_map(ax, m.numpy(), g, picture, alpha, cmap)
        _outline(ax, [centre], g)
        ax.set_title(f"{name}: patch {centre}", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle("What the centre patch of each stage reads, block by block (mean over heads)", fontsize=10)
    return fig


def distance_depth(stats: Any, stack: str | None = None) -> Figure:
    """Mean attention distance in input pixels per head against depth (Dosovitskiy et al. 2020,
    Fig. 7): one dot per head at its layer, ``distance_px`` from a :class:`probe.HeadStats` of an
    image cache (``probe.head_stats(cache)``)."""
    rows = [
        r
        for r in stats.table
        if r["kind"] == "self"
        and (stack is None or r["stack"] == stack)
        and r["distance_px"] == r["distance_px"]
    ]
    if not rows:
        raise ProbeError(
            "no distance_px in these statistics: compute them with probe.head_stats(cache) from a capture "
            "of an image model's pixels (whole patterns)"
        )
    stacks = list(dict.fromkeys(r["stack"] for r in rows))
    fig = Figure(figsize=(5.2, 3.6), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    for s in stacks:
        mine = [r for r in rows if r["stack"] == s]
        ax.scatter([r["layer"] for r in mine], [r["distance_px"] for r in mine], s=18, label=s, alpha=0.8)
    ax.set_xlabel("layer")
    ax.set_ylabel("mean attention distance (input pixels)")
    ax.set_title("How far across the picture each head reads", fontsize=10)
    layer_ticks(ax, sorted({r["layer"] for r in rows}))
    if len(stacks) > 1:
        ax.legend(fontsize=7)
    return fig


__all__ = ["distance_depth", "draw_map", "image_heads", "image_layers", "image_map", "picture_of"]
