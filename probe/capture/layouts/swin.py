"""Swin's windowed attention over a picture's patch grid, (shifted) windows mapped back to the grid.

Swin (and Swinv2, DonutSwin, MaskFormerSwin, which copy its layer) cuts each stage's patch grid
of ``H x W`` patches into windows of ``ws x ws`` patches and runs attention inside each window:
one softmax (or SDPA call) ``[batch * windows, heads, ws*ws, ws*ws]`` per block. The grid is
first padded at the bottom and right to a multiple of ``ws``; every other block shifts it
cyclically by ``-shift`` rows and columns before cutting (``torch.roll``), and masks the pairs a
window joins across the wrap-around (an additive ``-100``, so those weights are tiny, not zero).

Mapped back: ``[batch, heads, H*W, H*W]`` over the stage's grid in row-major order of the
unshifted picture, each window's weights placed at its queries' and keys' own grid positions,
zeros where a window does not reach. Positions the model padded are dropped: a query in a window
that reaches the padding keeps its weights on the patches (its row sums to less than one, the
rest went to the padding). The stage's grid is read off the model: the patch embedding's
``patch_size`` (the pixels padded to a multiple of it, as the model pads them) gives stage 0,
and each patch merging halves the rows and columns (rounded up, as the model pads them). A block
whose windows do not fit that grid is refused, naming the layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from probe.capture.calls import Call
from probe.capture.layouts.registry import Layout, hand_on, refuse, register, skipped
from probe.capture.patterns import sdpa_weights

WINDOW_KIND = (
    "windowed attention (Swin): each window's softmax over its ws x ws patches, shifted windows "
    "rolled back, mapped onto the stage's patch grid (row-major, the unshifted picture); zeros "
    "where a window does not reach; weights on the model's padding of the grid are not stored"
)
WHY = (
    "Swin's windows: a block's window weights did not fit the patch grid probe reads off the "
    "model (the pixel input, the patch embedding's patch size, one halving per patch merging), "
    "so they cannot be mapped back onto the picture"
)


def is_window_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a Swin-style block: an int ``window_size`` and ``shift_size``, and
    the block's own ``maybe_pad`` and ``get_attn_mask``."""
    return (
        isinstance(getattr(module, "window_size", None), int)
        and isinstance(getattr(module, "shift_size", None), int)
        and callable(getattr(module, "maybe_pad", None))
        and callable(getattr(module, "get_attn_mask", None))
    )


def patch_embedding(model: nn.Module) -> nn.Module | None:
    """Swin's patch embedding: a module with a ``Conv2d`` ``projection``, a ``patch_size`` pair and
    a ``maybe_pad`` (it pads the pixels to a multiple of the patch size); None when there is none."""
    for m in model.modules():
        p = getattr(m, "patch_size", None)
        if (
            isinstance(getattr(m, "projection", None), nn.Conv2d)
            and isinstance(p, (tuple, list))
            and len(p) == 2
            and callable(getattr(m, "maybe_pad", None))
        ):
            return m
    return None


def stage_grids(model: nn.Module, pixel_shape: list[int] | tuple[int, ...]) -> list[dict[str, Any]]:
    """The patch grid of each Swin stage for pixels of ``pixel_shape`` ``[batch, channels, height,
    width]``, as ``{"rows", "cols", "patch", "image", "offset"}`` (the grid format of
    :class:`probe.capture.positions.patches.Grid`; ``patch`` in input pixels), stage 0 first, down to one
    patch; empty when the model has no Swin patch embedding taking these channels."""
    emb = patch_embedding(model)
    if emb is None or len(pixel_shape) != 4 or emb.projection.in_channels != pixel_shape[1]:
        return []
    H, W = int(pixel_shape[2]), int(pixel_shape[3])
    (ph, pw) = (int(emb.patch_size[0]), int(emb.patch_size[1]))
    rows, cols = math.ceil(H / ph), math.ceil(W / pw)
    grids = []
    while True:
        grids.append({"rows": rows, "cols": cols, "patch": [ph, pw], "image": [H, W], "offset": 0})
        if rows == 1 and cols == 1:
            return grids
        rows, cols, ph, pw = math.ceil(rows / 2), math.ceil(cols / 2), 2 * ph, 2 * pw


def window_index(rows: int, cols: int, ws: int, shift: int) -> Tensor:
    """``[windows, ws*ws]``: the grid position ``r * cols + c`` of each window slot, in the order the
    model cuts its windows (window rows, then columns; inside a window row-major) after padding the
    grid to a multiple of ``ws`` and rolling it by ``-shift``; -1 for a padded position."""
    Hp, Wp = math.ceil(rows / ws) * ws, math.ceil(cols / ws) * ws
    y = (torch.arange(Hp) + shift) % Hp  # torch.roll(x, -shift)[i] = x[(i + shift) % n]
    x = (torch.arange(Wp) + shift) % Wp
    flat = y[:, None] * cols + x[None, :]
    flat = torch.where((y[:, None] < rows) & (x[None, :] < cols), flat, -1)
    return flat.view(Hp // ws, ws, Wp // ws, ws).transpose(1, 2).reshape(-1, ws * ws)


def windows_to_grid(probs: Tensor, index: Tensor, length: int) -> Tensor:
    """Window weights ``probs`` ``[batch * windows, heads, n, n]`` placed at the grid positions
    ``index`` ``[windows, n]`` (:func:`window_index`) of ``[batch, heads, length, length]``, zeros
    elsewhere; the slots at -1 (padding) dropped. Each (query, key) pair is in one window at
    most, so every weight is copied once, never summed."""
    nw, n = index.shape
    b, h = probs.shape[0] // nw, probs.shape[1]
    index = index.to(probs.device)
    q, k = index[:, :, None].expand(nw, n, n), index[:, None, :].expand(nw, n, n)
    valid = ((q >= 0) & (k >= 0)).reshape(-1)
    flat = (q * length + k).reshape(-1)[valid]
    src = probs.reshape(b, nw, h, n * n).transpose(1, 2).reshape(b, h, nw * n * n)
    out = probs.new_zeros(b, h, length * length)
    out[:, :, flat] = src[:, :, valid]
    return out.view(b, h, length, length)


def pixel_shape(stack: list[Call], channels: int) -> list[int] | None:
    """The shape of the pixels handed to the model's own call (``stack[0]``): its one 4-d floating
    input of ``channels`` channels, else None."""
    found = [
        list(t.shape)
        for t in stack[0].inputs
        if t.dim() == 4 and t.is_floating_point() and t.shape[1] == channels
    ]
    return found[0] if len(found) == 1 else None


class SwinWindows(Layout):
    """Swin's window attention (see the module docstring): claimed by the Swin block the softmax or
    SDPA call runs inside; mapped onto the stage's grid, or refused where it does not fit."""

    name = "swin-windows"
    priority = 90
    reads = frozenset({"softmax", "sdpa"})

    def claim(self, stack: list[Call], out: Any) -> Call | None:
        for c in reversed(stack):
            if is_window_layer(c.module):
                return c
        return None

    def softmax(self, rec, call: Call, out: Any) -> bool:
        self._map(rec, call, out, "softmax")
        return True

    def sdpa(self, rec, call: Call, args: tuple, kwargs: dict) -> bool:
        if not rec.wants():
            rec.note_event()
            return True
        with torch.no_grad():
            self._map(rec, call, sdpa_weights(*args, **kwargs), "sdpa")
        return True

    def _map(self, rec, call: Call, probs: Any, impl: str) -> None:
        index = self._index(rec, call, probs)
        if index is None:
            refuse(rec, WHY)
        elif not skipped(rec):
            hand_on(rec, windows_to_grid(probs, index, call.primary.shape[1]), WINDOW_KIND, impl)

    @staticmethod
    def _index(rec, call: Call, probs: Any) -> Tensor | None:
        """The window slots' grid positions (:func:`window_index`) of ``call``'s block, or None
        where its weights ``probs`` do not fit the stage's grid."""
        m, p = call.module, call.primary
        ws, shift = m.window_size, m.shift_size
        if not isinstance(probs, Tensor) or probs.dim() != 4 or tuple(probs.shape[-2:]) != (ws * ws,) * 2:
            return None
        if p is None or p.dim() != 3 or not rec.stack:
            return None
        emb = patch_embedding(rec.stack[0].module)
        shape = pixel_shape(rec.stack, emb.projection.in_channels) if emb is not None else None
        grid = next(
            (g for g in stage_grids(rec.stack[0].module, shape or []) if g["rows"] * g["cols"] == p.shape[1]),
            None,
        )
        if grid is None:
            return None
        rows, cols = grid["rows"], grid["cols"]
        windows = math.ceil(rows / ws) * math.ceil(cols / ws)
        if probs.shape[0] != p.shape[0] * windows or not 0 <= shift < ws:
            return None
        return window_index(rows, cols, ws, shift)


def layer_grids(
    model: nn.Module, pixel_shape: list[int], records: list, stack_of: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Per stack whose layers' attention this layout mapped (their ``kind``), its positions:
    ``kinds`` and ``labels`` (``patch (r, c)``) and ``grid`` of stage 0, and ``layer_grids``: each
    such layer's own stage grid by layer index (a stack of one layer list; the grid whose size is
    the layer's sequence length)."""
    grids = stage_grids(model, pixel_shape)
    out: dict[str, dict[str, Any]] = {}
    containers: dict[str, set[str]] = {}
    for r in records:
        containers.setdefault(stack_of[r.container], set()).add(r.container)
    for r in records:
        s = stack_of[r.container]
        if len(containers[s]) != 1:
            continue
        for (_role, _f, shape, _impl, _causal), kind in zip(
            r.patterns, r.kinds or [None] * len(r.patterns), strict=True
        ):
            g = next((g for g in grids if g["rows"] * g["cols"] == shape[2]), None)
            if kind != WINDOW_KIND or g is None:
                continue
            entry = out.setdefault(s, {"layer_grids": {}})
            entry["layer_grids"][str(r.index)] = g
    for entry in out.values():
        g0 = grids[0]
        entry["grid"] = g0
        entry["kinds"] = ["patch"] * (g0["rows"] * g0["cols"])
        entry["labels"] = [f"patch ({r}, {c})" for r in range(g0["rows"]) for c in range(g0["cols"])]
    return out


WINDOWS = register(SwinWindows())
