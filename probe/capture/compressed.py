"""DeepSeek-V4's compressed attention: one softmax over ``[T positions | C block summaries | sink]``.

DeepSeek-V4's compressed layers (CSA, HCA) join ``C`` compressed entries (each a learned summary
of a block of positions, not a position) and a learned sink column to the keys, and run one
softmax over all of them, ``[batch, heads, q, K + C + 1]`` (``K`` the positions, cached ones
included). Stored: ``pattern`` ``[batch, heads, q, K]``, the weights on the positions;
``compressed`` ``[batch, heads, q, C]``, the weights on the block summaries; ``sink`` (the sink
column's mass). Each query's three together sum to 1.
"""

from __future__ import annotations

from torch import Tensor, nn

from probe.capture.calls import Call

COMPRESSED_KIND = (
    "softmax over the positions, compressed block summaries and a sink column (DeepSeek-V4): "
    "pattern = the weights on the positions; compressed = on the block summaries; sink = the "
    "sink's mass"
)


def is_compressed(module: nn.Module) -> bool:
    """Whether ``module`` is a DeepSeek-V4 attention layer with a compressor (CSA or HCA)."""
    return getattr(module, "compressor", None) is not None and hasattr(module, "sinks")


class CompressedHandlers:
    """The recorder's handler of DeepSeek-V4's compressed attention (see the module's docstring).
    Uses the recorder's ``forward``, ``consumer``, ``wants``, ``note_event``, ``_open`` and
    ``_unseen``."""

    def _compressed(self, call: Call, out: Tensor) -> None:
        """Split the softmax ``out`` ``[b, h, q, K + C + 1]`` into pattern, compressed and sink;
        refused (unseen) where the positions ``K = cached + q`` leave no room for them."""
        if not isinstance(out, Tensor) or out.dim() != 4:
            self._unseen()
            return
        q = out.shape[-2]
        k = self.forward.cached + q
        if out.shape[-1] < k + 1:
            self._unseen()
            return
        if not self.wants():
            self.note_event()
            return
        a = self._open((q, k), "softmax")
        a.kind = COMPRESSED_KIND
        a.sinks.append(out[..., -1])
        a.extra = {"compressed": out[..., k:-1]}
        self.consumer.weights(a, out[..., :k], "softmax")
