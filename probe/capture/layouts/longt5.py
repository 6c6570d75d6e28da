"""LongT5's block-local attention, mapped back to ``[query, key]``; its transient-global layout refused.

LongT5's local attention splits the sequence into blocks of ``n`` and runs one softmax
``[batch, blocks, heads, n, 3n]``: query ``a`` of block ``i`` over the keys of blocks ``i - 1, i,
i + 1``. Mapped back to ``[batch, heads, T, T]``, zeros outside each query's three blocks; a
padding query's weight on positions past the sequence's ends is not stored. Its transient-global
attention (modules with ``global_block_size``) joins keys that are summaries of blocks, not
positions: probe does not map it, and refuses the layers rather than store a pattern that could
pass for one by its sizes.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from probe.capture.calls import Call
from probe.capture.layouts.registry import Layout, hand_on, refuse, register, skipped

BLOCK_KIND = (
    "block-local attention (LongT5), mapped back to [query, key]; zeros outside each query's "
    "three blocks; a padding query's weight on positions past the sequence's ends is not stored"
)
# attributes of the modules that compute local attention over a layout probe does not map yet:
# LongT5's transient-global blocks (their global keys are summaries of blocks, not positions)
UNMAPPED = ("global_block_size",)


def block_len_of(module: nn.Module) -> int | None:
    """The block length of LongT5's local attention module (blocks without global keys), else None."""
    n = getattr(module, "block_len", None)
    return n if isinstance(n, int) and not hasattr(module, "global_block_size") else None


def block_pattern(probs: Tensor, length: int) -> Tensor:
    """LongT5's local weights ``probs`` ``[batch, blocks, heads, n, 3n]`` (query ``a`` of block ``i``
    over the keys of blocks ``i - 1, i, i + 1``) mapped back to ``[batch, heads, T, T]`` for the
    ``length`` = T positions, zeros elsewhere."""
    b, nb, h, n, _ = probs.shape
    canvas = probs.new_zeros(b, h, nb * n, (nb + 2) * n)  # key column k + n holds key k
    for i in range(nb):
        canvas[:, :, i * n : (i + 1) * n, i * n : (i + 3) * n] = probs[:, i]
    return canvas[:, :, :length, n : n + length].contiguous()


def is_unmapped(module: nn.Module) -> bool:
    """Whether ``module`` computes local attention whose layout probe does not map back yet."""
    return any(hasattr(module, a) for a in UNMAPPED)


class TransientGlobal(Layout):
    """LongT5's transient-global attention (the innermost call): refused, every softmax of it."""

    name = "longt5-transient-global"
    priority = 50

    def claim(self, stack: list[Call], out: Any) -> Call | None:
        return stack[-1] if stack and is_unmapped(stack[-1].module) else None

    def softmax(self, rec, call: Call, out: Any) -> bool:
        refuse(rec)  # a layout that could pass for a pattern by its sizes: never stored
        return True


class LongT5Blocks(Layout):
    """LongT5's local softmax ``[batch, blocks, heads, n, 3n]`` (the innermost call) mapped back to
    ``[batch, heads, T, T]``; refused when it does not have that shape."""

    name = "longt5-blocks"
    priority = 80

    def claim(self, stack: list[Call], out: Any) -> Call | None:
        return stack[-1] if stack and block_len_of(stack[-1].module) is not None else None

    def softmax(self, rec, call: Call, out: Any) -> bool:
        n, p = block_len_of(call.module), call.primary
        if p is None or p.dim() != 3 or out.dim() != 5 or out.shape[-2:] != (n, 3 * n):
            refuse(rec)
            return True
        if out.shape[1] * n < p.shape[1]:
            refuse(rec)
            return True
        if not skipped(rec):
            hand_on(rec, block_pattern(out, p.shape[1]), BLOCK_KIND)
        return True


TRANSIENT_GLOBAL = register(TransientGlobal())
BLOCKS = register(LongT5Blocks())
