"""Inkling2's block attention residuals: a softmax over the outputs of earlier blocks, weights over depth.

A module with a learned ``query`` handed the stacked block states ``[batch, T, n, d]`` (and the
block being built) runs a softmax ``[batch, T, q, n + 1]`` over the blocks: weights over depth,
not over keys. It is no attention pattern: noted in the layer's ``not_attention``, never stored.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from probe.capture.calls import Call
from probe.capture.layouts.registry import Layout, register

DEPTH_NOTE = (
    "a softmax of learned queries over the outputs of earlier blocks (block attention residuals, "
    "Inkling2): weights over depth, not keys"
)


def mixes_blocks(call: Call, out: Tensor) -> bool:
    """Whether the softmax ``out`` mixes the outputs of earlier blocks (Inkling2's block attention
    residuals): a module with a learned ``query`` handed the stacked block states ``[batch, T,
    n, d]`` (and the block being built), whose weights are ``[batch, T, q, n + 1]``."""
    p, q = call.primary, getattr(call.module, "query", None)
    if not isinstance(q, nn.Parameter) or p is None or p.dim() != 4 or not isinstance(out, Tensor):
        return False
    return out.dim() == 4 and tuple(out.shape[:2]) == tuple(p.shape[:2]) and out.shape[-1] == p.shape[2] + 1


class DepthMix(Layout):
    """Weights over depth (see the module docstring): claimed by the innermost call, noted."""

    name = "depth-mix"
    priority = 20

    def claim(self, stack: list[Call], out: Any) -> Call | None:
        return stack[-1] if stack and mixes_blocks(stack[-1], out) else None

    def softmax(self, rec, call: Call, out: Any) -> bool:
        if rec.layers.layer is not None:
            rec.layers.layer.skipped.add(DEPTH_NOTE)
        return True


DEPTH = register(DepthMix())
