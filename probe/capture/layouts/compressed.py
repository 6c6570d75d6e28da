"""DeepSeek-V4's compressed attention: one softmax over ``[T positions | C block summaries | sink]``.

DeepSeek-V4's compressed layers (CSA, HCA) join ``C`` compressed entries (each a learned summary
of a block of positions, not a position) and a learned sink column to the keys, and run one
softmax over all of them, ``[batch, heads, q, K + C + 1]`` (``K`` the positions, cached ones
included). Stored: ``pattern`` ``[batch, heads, q, K]``, the weights on the positions;
``compressed`` ``[batch, heads, q, C]``, the weights on the block summaries; ``sink`` (the sink
column's mass). Each query's three together sum to 1.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from probe.capture.calls import Call
from probe.capture.layouts.registry import Layout, attention, refuse, register, skipped

COMPRESSED_KIND = (
    "softmax over the positions, compressed block summaries and a sink column (DeepSeek-V4): "
    "pattern = the weights on the positions; compressed = on the block summaries; sink = the "
    "sink's mass"
)


def is_compressed(module: nn.Module) -> bool:
    """Whether ``module`` is a DeepSeek-V4 attention layer with a compressor (CSA or HCA)."""
    return getattr(module, "compressor", None) is not None and hasattr(module, "sinks")


class Compressed(Layout):
    """A 4-d softmax of a compressed layer (the innermost call): split into pattern, compressed and
    sink; refused where the positions ``K = cached + q`` leave no room for them."""

    name = "deepseek-compressed"
    priority = 30

    def claim(self, stack: list[Call], out: Any) -> Call | None:
        if stack and is_compressed(stack[-1].module) and isinstance(out, Tensor) and out.dim() == 4:
            return stack[-1]
        return None

    def softmax(self, rec, call: Call, out: Tensor) -> bool:
        q = out.shape[-2]
        k = rec.forward.cached + q
        if out.shape[-1] < k + 1:
            refuse(rec)
            return True
        if skipped(rec):
            return True
        a = attention(rec, (q, k), COMPRESSED_KIND)
        a.sinks.append(out[..., -1])
        a.extra = {"compressed": out[..., k:-1]}
        rec.consumer.weights(a, out[..., :k], "softmax")
        return True


COMPRESSED = register(Compressed())
