"""Longformer's and LED's sliding-window attention, mapped back to ``[query, key]``.

Their sliding-chunk self-attention runs one softmax ``[batch, T, heads, 2w + 1]`` (column ``j`` is
the key ``i - w + j`` of query ``i``, ``w`` the one-sided window), over the sequence the model ran
(padded by the model to a multiple of its window). Mapped back to ``[batch, heads, T, T]``,
zeros outside each query's window and on the rows of masked queries (the model zeroes them).
Global attention (global columns joined ahead of the window, the global queries' softmax) is not
mapped: refused, naming the layers.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from probe.capture.calls import Call
from probe.capture.layouts.registry import Layout, hand_on, refuse, register, skipped

BAND_KIND = (
    "sliding-window attention (Longformer/LED), mapped back to [query, key] over the sequence the "
    "model ran (padded by the model to a multiple of its window); zeros outside each query's window"
)


def window_of(module: nn.Module) -> int | None:
    """The one-sided window of a Longformer/LED sliding-chunk self-attention module, else None."""
    w = getattr(module, "one_sided_attn_window_size", None)
    return w if isinstance(w, int) else None


def band_pattern(probs: Tensor, w: int, masked: Tensor) -> Tensor:
    """Longformer's sliding-window weights ``probs`` ``[batch, T, heads, 2w + 1]`` (column ``j`` is
    the key ``i - w + j`` of query ``i``) mapped back to ``[batch, heads, T, T]``, zeros outside the
    window and on the rows of the ``masked`` ``[batch, T]`` queries (the model zeroes them)."""
    b, T, h, _ = probs.shape
    out = probs.new_zeros(b, h, T, T)
    for j in range(2 * w + 1):
        d = j - w  # key offset from the query
        if abs(d) >= T:
            continue
        rows = probs[:, : T - d, :, j] if d >= 0 else probs[:, -d:, :, j]
        out.diagonal(offset=d, dim1=-2, dim2=-1).copy_(rows.transpose(1, 2))
    return out.masked_fill(masked[:, None, :, None], 0.0)


class SlidingWindow(Layout):
    """The band softmax of a sliding-chunk module (the innermost call); refused where it has global
    columns or its mask is not found."""

    name = "longformer-band"
    priority = 70

    def claim(self, stack: list[Call], out: Any) -> Call | None:
        return stack[-1] if stack and window_of(stack[-1].module) is not None else None

    def softmax(self, rec, call: Call, out: Any) -> bool:
        w = window_of(call.module)
        if not isinstance(out, Tensor) or out.dim() != 4 or out.shape[-1] != 2 * w + 1:
            refuse(rec)  # global keys joined ahead of the window, or the global queries' softmax
            return True
        b, T = out.shape[:2]
        masks = [t for t in call.inputs if t.is_floating_point() and tuple(t.shape) == (b, T)]
        if len(masks) != 1:
            refuse(rec)
            return True
        if not skipped(rec):
            hand_on(rec, band_pattern(out, w, masks[0] < 0), BAND_KIND)  # the model's is_index_masked
        return True


BAND = register(SlidingWindow())
