"""Attention over packed sequences: one softmax per segment of a sequence split by ``cu_seqlens``.

Qwen2-VL's vision tower (and the towers built like it) packs the patches of every picture of a
batch into one sequence ``[positions, dim]`` and hands its attention the cumulative segment
lengths ``cu_seqlens`` (``[0, n_1, n_1 + n_2, ...]``): each picture's patches attend to their own
picture only. FlashAttention reads the segments in one call; the eager and SDPA paths split the
queries, keys and values at those lengths and run one attention per segment, in order. probe places
each segment's weights on the diagonal of one ``[1, heads, N, N]`` pattern over the packed
sequence, zeros between pictures (what the model's segments mean: no picture reads another). A
segment whose size does not follow ``cu_seqlens`` is refused, naming the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from probe.capture.calls import Call
from probe.capture.layouts.registry import Layout, hand_on, refuse, register, skipped
from probe.capture.patterns import sdpa_weights

PACKED_KIND = (
    "attention over a packed sequence split into segments (cu_seqlens: one picture each), each "
    "segment's softmax placed on the diagonal of [1, heads, N, N]; zeros between segments"
)
WHY = (
    "packed segments (cu_seqlens): a segment's weights do not have the size cu_seqlens gives it, so "
    "they cannot be placed on the packed sequence"
)


def cu_seqlens_of(call: Call) -> list[int] | None:
    """The segment boundaries handed to ``call`` (a 1-D integer tensor from 0 up to the packed
    length of its ``[positions, dim]`` input, or ``[1, positions, dim]``: HunYuan-VL's tower), or
    None when it has none."""
    p = call.primary
    if p is None or not (p.dim() == 2 or (p.dim() == 3 and p.shape[0] == 1)):
        return None
    n = p.shape[-2]
    for t in call.inputs:
        if t.dim() == 1 and not t.is_floating_point() and t.dtype != torch.bool and t.numel() >= 2:
            cu = [int(v) for v in t.tolist()]
            if cu[0] == 0 and cu[-1] == n and all(a <= b for a, b in zip(cu, cu[1:], strict=False)):
                return cu
    return None


@dataclass
class Segments:
    """The segments of one packed attention call seen so far, gathered into ``pattern``."""

    bounds: list[tuple[int, int]]
    pattern: Tensor | None = None
    seen: int = 0

    def add(self, weights: Tensor) -> bool:
        """Place one segment's ``[1, heads, n, n]`` weights; True when the last one arrived.
        Raises ValueError when it does not have the size of its segment."""
        if self.seen >= len(self.bounds):
            raise ValueError("more segments than cu_seqlens gives")
        s, e = self.bounds[self.seen]
        if weights.dim() != 4 or weights.shape[0] != 1 or tuple(weights.shape[-2:]) != (e - s, e - s):
            raise ValueError(f"segment {self.seen} has shape {tuple(weights.shape)}, not {e - s} x {e - s}")
        if self.pattern is None:
            n = self.bounds[-1][1]
            self.pattern = weights.new_zeros(1, weights.shape[1], n, n)
        self.pattern[:, :, s:e, s:e] = weights
        self.seen += 1
        return self.seen == len(self.bounds)


class PackedSegments(Layout):
    """Claimed by the nearest call on the stack handed ``cu_seqlens`` with a packed 2-D input; the
    last segment hands on the pattern over the packed sequence."""

    name = "packed-segments"
    priority = 45
    reads = frozenset({"softmax", "sdpa"})

    def claim(self, stack: list[Call], out: Any) -> Call | None:
        for c in reversed(stack):
            if cu_seqlens_of(c) is not None:
                return c
        return None

    def softmax(self, rec, call: Call, out: Any) -> bool:
        self._add(rec, call, out, "softmax")
        return True

    def sdpa(self, rec, call: Call, args: tuple, kwargs: dict) -> bool:
        with torch.no_grad():
            self._add(rec, call, sdpa_weights(*args, **kwargs), "sdpa")
        return True

    @staticmethod
    def _add(rec, call: Call, weights: Tensor, impl: str) -> None:
        if call.chunks is None:
            cu = cu_seqlens_of(call)
            call.chunks = Segments([(a, b) for a, b in zip(cu, cu[1:], strict=False) if b > a])
        try:
            done = call.chunks.add(weights)
        except ValueError:
            call.chunks = None
            refuse(rec, WHY)
            return
        if not done:
            return
        pattern, call.chunks = call.chunks.pattern, None
        if not skipped(rec):
            hand_on(rec, pattern, PACKED_KIND, impl)


PACKED = register(PackedSegments())
