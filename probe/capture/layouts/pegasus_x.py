"""Pegasus-X's block-local attention with global tokens, mapped back to ``[query, key]``.

Pegasus-X's encoder (``PegasusXGlobalLocalAttention``) runs two softmaxes per layer:

* the ``G`` global tokens (learned positions ahead of the input, not tokens of it) over
  ``[G global tokens | the padded sequence]``: ``[batch, heads, G, G + P]``;
* the tokens, in blocks of ``n``, each over ``[G global tokens | its own block]``:
  ``[batch, heads, blocks, n, G + n]``.

The model pads the sequence to a multiple of ``n`` and, in staggered layers, by ``n // 2`` on
both sides before the blocks (so those layers' blocks straddle the others'). Mapped back:
``pattern`` ``[batch, heads, T, T]`` the tokens' weights on the tokens (zeros outside each
query's block), ``globals`` ``[batch, heads, T, G]`` their weights on the global tokens (each
query's row of ``pattern`` and ``globals`` together sums to 1), and ``global_rows``
``[batch, heads, G, G + T]`` the global tokens' weights on the global tokens then the tokens.
Weights on the model's padding (zero: it masks it) are not stored; the residual stream is the
model's, over the sequence padded to a multiple of ``n`` (its first T positions are the input's).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from probe.capture.calls import Call
from probe.capture.layouts.registry import Layout, attention, refuse, register, skipped

GLOBAL_LOCAL_KIND = (
    "block-local attention with global tokens (Pegasus-X): pattern = the tokens' weights on the "
    "tokens, zeros outside each query's block; globals = their weights on the global tokens; "
    "global_rows = the global tokens' weights on [global tokens | tokens]; the layer's residual "
    "stream runs over the model's padded sequence (T rounded up to the block size), the patterns "
    "over the T input positions"
)


def global_block_of(module: nn.Module) -> int | None:
    """The block length of a Pegasus-X global-local attention module, else None."""
    n = getattr(module, "block_size", None)
    ok = isinstance(n, int) and hasattr(module, "compute_local_attention_representations")
    return n if ok else None


def local_rows(probs: Tensor, g: int, off: int, length: int) -> tuple[Tensor, Tensor]:
    """The tokens' block weights ``probs`` ``[batch, heads, blocks, n, g + n]`` as ``(pattern
    [batch, heads, T, T], globals [batch, heads, T, g])`` for the ``length`` = T positions that
    start ``off`` positions into the padded sequence."""
    b, h, nb, n, _ = probs.shape
    canvas = probs.new_zeros(b, h, nb * n, nb * n)
    for i in range(nb):
        canvas[:, :, i * n : (i + 1) * n, i * n : (i + 1) * n] = probs[:, :, i, :, g:]
    pattern = canvas[:, :, off : off + length, off : off + length].contiguous()
    globals_ = probs[..., :g].reshape(b, h, nb * n, g)[:, :, off : off + length].contiguous()
    return pattern, globals_


def global_rows(probs: Tensor, g: int, off: int, length: int) -> Tensor:
    """The global tokens' weights ``probs`` ``[batch, heads, g, g + P]`` as ``[batch, heads, g,
    g + T]``: the global keys, then the ``length`` = T positions from ``off`` on."""
    return torch.cat([probs[..., :g], probs[..., g + off : g + off + length]], dim=-1)


def input_length(call: Call) -> int | None:
    """The input's length T: the ids ``[batch, T]`` handed to the nearest enclosing call that got
    integer ids (the encoder's), else None."""
    c = call
    while c is not None:
        ids = [t for t in c.inputs if t.dim() == 2 and not t.is_floating_point()]
        if ids:
            return int(ids[0].shape[1])
        c = c.parent
    return None


class GlobalLocal(Layout):
    """Pegasus-X's global-local attention (see the module's docstring), claimed by the innermost
    call: the global tokens' softmax is held on the call until the blocks' arrives, then both are
    mapped and handed on. Refused where the shapes or the input's length do not fit."""

    name = "pegasus-x-global-local"
    priority = 60

    def claim(self, stack: list[Call], out: Any) -> Call | None:
        return stack[-1] if stack and global_block_of(stack[-1].module) is not None else None

    def softmax(self, rec, call: Call, out: Any) -> bool:
        n, p = global_block_of(call.module), call.primary
        if p is None or p.dim() != 3 or not isinstance(out, Tensor):
            refuse(rec)
            return True
        if out.dim() == 4:
            call.chunks = out  # the global tokens' softmax: the blocks' follows in the same call
            return True
        held, call.chunks = call.chunks, None
        T, padded = input_length(call), p.shape[1]
        outer = call.parent.primary if call.parent is not None else None
        if (
            out.dim() != 5
            or held is None
            or T is None
            or outer is None
            or out.shape[2] * n != padded
            or held.shape[-1] != held.shape[-2] + padded
            or out.shape[-1] != held.shape[-2] + n
            or outer.shape[1] < T
        ):
            refuse(rec)
            return True
        if skipped(rec):
            return True
        g, off = held.shape[-2], (padded - outer.shape[1]) // 2  # staggered layers pad n // 2 each side
        pattern, globals_ = local_rows(out, g, off, T)
        a = attention(rec, (T, T), GLOBAL_LOCAL_KIND)
        a.self_only = True  # the global tokens are a second stream of the layer's own
        a.extra = {"globals": globals_, "global_rows": global_rows(held, g, off, T)}
        rec.consumer.weights(a, pattern, "softmax")
        return True


GLOBAL_LOCAL = register(GlobalLocal())
