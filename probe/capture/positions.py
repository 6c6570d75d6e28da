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


__all__ = ["Grid", "image_positions", "patch_conv", "prefix_tokens"]
