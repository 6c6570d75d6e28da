"""Attention over a feature map with the batch and the heads in one axis: ViTDet, SAM's vision
encoder run eagerly, SLANeXt's and PP-FormulaNet's vision towers (and the models built on them).

The attention module takes the stream as a map ``[b, H, W, C]`` (in a windowed block, the
windows of it, ``[b · windows, ws, ws, C]``), projects it with one ``qkv`` Linear and runs its
softmax over ``[b · heads, H·W, H·W]``: three axes, the batch and the heads flattened into the
first. Which of the two varies fastest is read off the module's own code: transformers'
implementations reshape ``qkv(x)`` to ``[b, H·W, 3, heads, d]``, permute it ``(2, 0, 3, 1, 4)``
and reshape it to ``[3, b · heads, H·W, d]``: the batch first, the heads inside it. A module whose
forward does exactly that is mapped, ``view(b, heads, N, N)``, the weights unchanged; one whose
forward does not is refused, naming the layer: probe cannot tell the batch from the heads.

A windowed block's pattern is stored per window, ``[b · windows, heads, ws², ws²]``, as the
model's own ``output_attentions`` returns it (and as SAM's SDPA windows are stored).
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

from torch import Tensor, nn

from probe.capture.calls import Call
from probe.capture.layouts.registry import Layout, hand_on, refuse, register, skipped

SPATIAL_KIND = (
    "attention over a feature map, softmax over [batch · heads, H·W, H·W] (batch first, read from "
    "the module's code), stored as [batch, heads, H·W, H·W]; a windowed block per window"
)
WHY = (
    "a softmax over [batch · heads, H·W, H·W] (the batch and the heads in one axis) in a module "
    "whose code probe does not read as batch first, so it cannot tell the batch from the heads"
)
# the flattening transformers' ViTDet/SAM-style attention does, batch before heads
_PERMUTE = re.compile(r"\.permute\(2,0,3,1,4\)")
_RESHAPE = re.compile(r"reshape\(3,batch_size\*self\.num_(attention_)?heads,height\*width,-1\)")


def heads_of(module: nn.Module) -> int | None:
    """The module's head count (``num_heads`` or ``num_attention_heads``), None when it has none."""
    for name in ("num_heads", "num_attention_heads"):
        h = getattr(module, name, None)
        if isinstance(h, int) and not isinstance(h, bool) and h > 0:
            return h
    return None


@functools.lru_cache(maxsize=64)
def batch_first(cls: type) -> bool:
    """Whether ``cls.forward`` flattens the batch before the heads, as transformers' ViTDet and
    SAM-style attention does (see the module docstring), read from its source."""
    try:
        source = re.sub(r"\s+", "", inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return False
    return bool(_PERMUTE.search(source) and _RESHAPE.search(source))


def spatial_call(call: Call, out: Any) -> bool:
    """Whether the softmax ``out`` is ``[b · heads, H·W, H·W]`` in an attention module with a
    ``qkv`` Linear handed the map ``[b, H, W, C]``."""
    m, p = call.module, call.primary
    h = heads_of(m)
    if h is None or not isinstance(getattr(m, "qkv", None), nn.Linear) or p is None or p.dim() != 4:
        return False
    b, n = p.shape[0], p.shape[1] * p.shape[2]
    return isinstance(out, Tensor) and tuple(out.shape) == (b * h, n, n)


class SpatialHeads(Layout):
    """Batch and heads in one axis (see the module docstring): claimed by the innermost call."""

    name = "spatial-heads"
    priority = 42

    def claim(self, stack: list[Call], out: Any) -> Call | None:
        return stack[-1] if stack and spatial_call(stack[-1], out) else None

    def softmax(self, rec, call: Call, out: Any) -> bool:
        if not batch_first(type(call.module)):
            refuse(rec, WHY)
        elif not skipped(rec):
            b, h, n = call.primary.shape[0], heads_of(call.module), out.shape[-1]
            hand_on(rec, out.view(b, h, n, n), SPATIAL_KIND)
        return True


SPATIAL = register(SpatialHeads())
