"""What each position of an image model's sequence is: class, distillation, register or patch.

A vision transformer cuts its picture into a grid of patches with one strided convolution (kernel
and stride the patch size, in input pixels), projects each patch to a vector and puts a few learned
tokens before them: ViT's and CLIP's class token, DeiT's distillation token, DINOv2's registers.
timm carries this as bookkeeping on the model (``patch_embed.grid_size``, ``num_prefix_tokens``);
here it is read off the module the same way for any model: the grid from the first convolution
that takes the pixels and the pixel input's shape, the prefix tokens from the learned parameters
the embedding holds. A sequence whose length is not prefix + rows x cols (masked patches, merged
tokens, windows) gets no grid: probe then says it does not know, rather than guess.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from probe.capture.calls import LayerRecord
from probe.capture.layouts.swin import layer_grids
from probe.capture.positions.grids import attach, lay_text, text_stacks

# learned tokens placed before the patches, in the order the models place them: (kind, the
# parameter names that hold them, label); registers hold several (their second dimension)
PREFIX = (
    ("class", ("cls_token", "class_embedding"), "[CLS]"),
    ("distillation", ("distillation_token", "dist_token"), "[DIST]"),
    ("register", ("register_tokens", "reg_token"), "reg"),
)


@dataclass(frozen=True)
class Grid:
    """The patch grid of one image in the sequence: ``rows`` x ``cols`` patches of ``patch``
    (height, width) input pixels, cut from the processed image of ``image`` (height, width)
    pixels, at sequence positions ``offset`` to ``offset + rows * cols`` (row-major)."""

    rows: int
    cols: int
    patch: tuple[int, int]
    image: tuple[int, int]
    offset: int

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["patch"], d["image"] = list(self.patch), list(self.image)
        return d


def patch_conv(model: nn.Module, channels: int) -> nn.Conv2d | None:
    """The convolution that cuts the pixels into patches: the first ``Conv2d`` taking ``channels``
    input channels whose stride equals its kernel (a patchify), None when there is none."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d) and m.in_channels == channels and tuple(m.stride) == tuple(m.kernel_size):
            return m
    return None


def _out(size: int, conv: nn.Conv2d, axis: int) -> int:
    pad = conv.padding[axis] if isinstance(conv.padding, tuple) else 0
    k, s, d = conv.kernel_size[axis], conv.stride[axis], conv.dilation[axis]
    return (size + 2 * pad - d * (k - 1) - 1) // s + 1


def prefix_tokens(model: nn.Module) -> list[tuple[str, str]]:
    """The learned tokens the model puts before its patches, as ``(kind, label)`` in order."""
    found: dict[str, int] = {}
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        for kind, names, _label in PREFIX:
            if leaf in names and kind not in found:
                found[kind] = int(p.shape[1]) if kind == "register" and p.dim() == 3 else 1
    out = []
    for kind, _names, label in PREFIX:
        n = found.get(kind, 0)
        out += [(kind, f"{label} {i}" if kind == "register" else label) for i in range(n)]
    return out


def image_positions(model: nn.Module, pixel_shape: list[int], length: int) -> dict[str, Any] | None:
    """``{"kinds", "labels", "grid"}`` for a sequence of ``length`` positions made from pixels of
    ``pixel_shape`` ``[batch, channels, height, width]``; None when the length is not the
    prefix tokens plus the patch grid (see the module docstring)."""
    if len(pixel_shape) != 4:
        return None
    conv = patch_conv(model, pixel_shape[1])
    if conv is None:
        return None
    H, W = pixel_shape[2], pixel_shape[3]
    rows, cols = _out(H, conv, 0), _out(W, conv, 1)
    prefix = prefix_tokens(model)
    if rows <= 0 or cols <= 0 or len(prefix) + rows * cols != length:
        return None
    grid = Grid(rows, cols, (conv.stride[0], conv.stride[1]), (H, W), len(prefix))
    kinds = [k for k, _ in prefix] + ["patch"] * (rows * cols)
    labels = [lab for _, lab in prefix] + [f"patch ({r}, {c})" for r in range(rows) for c in range(cols)]
    return {"kinds": kinds, "labels": labels, "grid": grid.to_dict()}


FEATURE_STRIDES = (4, 8, 16, 32, 64)  # the output strides of convolutional backbones


def feature_positions(model: nn.Module, pixel_shape: list[int], length: int) -> dict[str, Any] | None:
    """A convolutional backbone's feature map flattened into the sequence (DETR's encoder):
    ``{"kinds", "labels", "grid"}`` when ``length`` is ``ceil(H/s) x ceil(W/s)`` for exactly one
    backbone stride ``s`` (a stride-2 convolution or pooling with "same" padding rounds up),
    each position one ``s x s`` cell of the input; None otherwise (ambiguous or no match)."""
    if len(pixel_shape) != 4 or not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        return None
    H, W = pixel_shape[2], pixel_shape[3]
    fits = [s for s in FEATURE_STRIDES if -(-H // s) * -(-W // s) == length]
    if len(fits) != 1:
        return None
    s = fits[0]
    rows, cols = -(-H // s), -(-W // s)
    grid = Grid(rows, cols, (s, s), (H, W), 0)
    labels = [f"cell ({r}, {c})" for r in range(rows) for c in range(cols)]
    return {"kinds": ["patch"] * length, "labels": labels, "grid": grid.to_dict()}


def image_token_id(model: nn.Module) -> int | None:
    """The id a vision-language model puts in the text for each image position (LLaVA's
    ``image_token_index``, most models' ``image_token_id``), None when the model has none."""
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):  # the model's own, else its language model's
        for attr in ("image_token_id", "image_token_index"):
            v = getattr(c, attr, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def text_image_positions(
    ids: list[int], image_token: int, grid: dict[str, Any], unit: str | None = None
) -> dict[str, Any] | None:
    """``{"kinds", "labels", "grids"}`` for one text of a vision-language model whose image
    positions (``image_token``) are the vision tower's patches: each run of image positions is
    one or more whole ``grid``s (row-major), each laid at its own offset
    (:func:`~probe.capture.positions.grids.lay_text`). None when a run is not a whole number of
    grids (merged or pooled patches: probe does not guess). The image tokens read ``patch (r, c)``
    (one grid) or ``img g (r, c)``; with ``unit``, always ``<unit> g (r, c)``."""
    return lay_text(ids, image_token, lambda _k: grid, unit)


def _text_image_positions(
    meta: dict[str, Any],
    model: nn.Module,
    records: list[LayerRecord],
    stack_of: dict[str, str],
    found: dict[str, dict[str, Any]],
) -> None:
    """A vision-language model: in each stack over the text (``ids``), the image token's positions
    laid on the vision tower's grid, per text (``found[stack]["rows"]``); the tokens at those
    positions read ``patch (r, c)`` (``img i (r, c)`` with several images)."""
    token = image_token_id(model)
    grid = next((p["grid"] for p in found.values() if "grid" in p), None)
    ids = meta.get("ids")
    if token is None or grid is None or not ids:
        return
    stacks = text_stacks(records, stack_of, found, len(ids[0]))
    if not stacks:
        return
    rows = [text_image_positions(row, token, grid) for row in ids]
    if any(row is None for row in rows):
        meta["positions_note"] = (
            f"probe could not lay the {stacks[0]} stack's image positions on the vision tower's "
            f"{grid['rows']}x{grid['cols']} grid (a run of image tokens is not a whole number of grids)"
        )
        return
    attach(meta, stacks, found, rows)


def name_positions(
    meta: dict[str, Any], model: nn.Module, records: list[LayerRecord], stack_of: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Per stack whose self-attention runs over the picture's prefix tokens and patch grid, what
    each position is (:func:`probe.capture.positions.patches.image_positions`); the first such stack's
    labels become the cache's tokens (``[CLS]``, ``patch (r, c)``) when the input had no text.
    Where no stack's length fits, ``meta["positions_note"]`` says so and positions stay numbered."""
    found: dict[str, dict[str, Any]] = {}
    lengths: set[int] = set()
    for r in records:
        for role, _h, shape, _impl, _causal in r.patterns:
            s = stack_of[r.container]
            if role != "self" or s in found:
                continue
            lengths.add(shape[3])
            pos = image_positions(model, meta["image_shape"], shape[3])
            if pos is None and patch_conv(model, meta["image_shape"][1]) is None:
                pos = feature_positions(model, meta["image_shape"], shape[3])
            if pos is not None:
                found[s] = pos
    _text_image_positions(meta, model, records, stack_of, found)
    found.update(layer_grids(model, meta["image_shape"], records, stack_of))  # Swin: a grid per stage
    batch = meta["image_shape"][0]
    if found and "tokens" not in meta:
        meta["tokens"] = [list(next(iter(found.values()))["labels"]) for _ in range(batch)]
    elif not found:
        h, w = meta["image_shape"][2:4]
        seen = ", ".join(map(str, sorted(lengths)))
        meta["positions_note"] = (
            f"probe could not tell which positions are which patches of the {h}x{w} image: no "
            f"self-attention length ({seen}) is the model's learned prefix tokens plus the patch "
            "grid of its patchify convolution"
        )
        if "tokens" not in meta and lengths:
            meta["tokens"] = [[str(i) for i in range(min(lengths))] for _ in range(batch)]
    return found


__all__ = [
    "Grid",
    "image_positions",
    "image_token_id",
    "name_positions",
    "patch_conv",
    "prefix_tokens",
    "text_image_positions",
]
