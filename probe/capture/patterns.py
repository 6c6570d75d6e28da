"""Attention weights for the fused attention paths that never materialise them.

``F.scaled_dot_product_attention`` and the fused ``nn.MultiheadAttention`` kernels compute
``softmax(q kᵀ · scale + mask) v`` without returning the weights. probe lets the model call the
fused kernel untouched (so its outputs stay bit-identical) and computes the weights beside it
from the very same ``q``, ``k``, mask and scale, with SDPA's documented semantics.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from probe.capture.arena import zeroed


@torch.no_grad()
def sdpa_weights(
    query: Tensor,
    key: Tensor,
    value: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    out: Tensor | None = None,
    clean: bool = False,
    chunk: int = 128,
    empty: Any = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """The attention weights ``F.scaled_dot_product_attention`` uses, as ``[..., heads, L, S]``.

    Follows SDPA's semantics: ``scale`` defaults to ``1/sqrt(E)``; ``is_causal`` masks with a
    top-left aligned lower triangle; a boolean ``attn_mask`` marks positions that *may* be attended,
    a float mask is added to the scores; grouped-query key heads are repeated to the query heads.
    Rows with every key masked come out as zeros (SDPA's math path gives NaN there). Dropout is
    not applied: the pattern is the pre-dropout distribution.

    Computed in float32, ``chunk`` query rows at a time in a contiguous scratch block (ATen's
    fused softmax runs in place there), then copied into ``out`` (allocated if not given or not
    usable); under ``is_causal`` the keys a chunk cannot see are never computed, which halves
    the work. ``clean``: the given ``out`` was last filled by a causal call of the same shape,
    so the keys no query can see already hold zeros. A freshly allocated ``out`` comes from
    :func:`probe.capture.arena.zeroed` where it can (huge pages, already zero: the unseen keys
    are not written at all), else from ``empty(shape, dtype, device)`` when given (a streaming
    sink's block-aligned buffers), else ``torch.empty``. ``dtype`` (float32 when None): the
    dtype ``out`` stores; the weights are still computed in float32 and converted on their one
    copy into ``out`` (the same rounding as ``.to(dtype)``), never held in float32 as a whole.
    """
    L, S = query.size(-2), key.size(-2)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    if query.dim() >= 3 and key.dim() >= 3 and key.size(-3) != query.size(-3):
        # grouped-query attention: each key head serves a contiguous group of query heads
        key = key.repeat_interleave(query.size(-3) // key.size(-3), dim=-3)
    q, kt = query.float(), key.float().transpose(-2, -1)
    batch = q.shape[:-2]
    if kt.shape[:-2] != batch:
        batch = torch.broadcast_shapes(batch, kt.shape[:-2])
    shape = batch + (L, S)
    # fresh: out is known to be zero where a causal query cannot see, so that part needs no pass
    fresh = clean
    dtype = dtype or torch.float32
    if out is None or out.shape != shape or out.dtype != dtype or not out.is_contiguous():
        out = zeroed(shape, dtype, query.device)
        fresh = out is not None
        if out is None:
            out = (empty or torch.empty)(shape, dtype=dtype, device=query.device)
    mask = attn_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float()
    n = math.prod(batch)
    # the scale goes into the matrix product (baddbmm's alpha) instead of a pass over q or the
    # scores; that needs q and k with the same batch shape, which broadcasting may not give
    folded = q.shape[:-2] == batch and kt.shape[:-2] == batch
    if folded:
        q3, kt3 = q.reshape(n, L, q.size(-1)), kt.reshape(n, kt.size(-2), S)
    else:
        q = q * scale
    rows = min(chunk, L)
    scratch = None
    # query r may not see keys after r: one upper triangle of -inf (0 elsewhere) serves every
    # diagonal block; added, not masked_fill_ed (a broadcast boolean fill is ~10x slower), which
    # gives the same scores (x + 0 is x; only -0.0 turns +0.0, and exp of either is 1)
    diag = _upper(rows, query.device) if is_causal else None
    for i in range(0, L, chunk):
        e = min(L, i + chunk)
        kend = min(S, e) if is_causal else S
        # one block holding every query and key (a short sequence) is ``out`` itself: computed in
        # place, no copy; otherwise a contiguous scratch block (ATen's fused softmax may then
        # write over its own input), copied into ``out`` below
        whole = i == 0 and e == L and kend == S and dtype == torch.float32
        if whole:
            blk = out
        else:
            if scratch is None:
                scratch = torch.empty(n * rows * S, dtype=torch.float32, device=query.device)
            blk = scratch[: n * (e - i) * kend].view(batch + (e - i, kend))
        if folded:
            b3 = blk.view(n, e - i, kend)
            torch.baddbmm(b3, q3[:, i:e], kt3[..., :kend], beta=0.0, alpha=scale, out=b3)
        else:
            torch.matmul(q[..., i:e, :], kt[..., :kend], out=blk)  # [..., rows, kend]
        if is_causal and kend > i:  # the diagonal block
            blk[..., i:kend].add_(diag[: e - i, : kend - i])
        if mask is not None:
            m = mask[..., i:e, :] if mask.size(-2) == L else mask
            m = m[..., :kend] if m.size(-1) == S else m
            if m.dtype == torch.bool:
                blk.masked_fill_(~m, float("-inf"))
            else:
                blk.add_(m)
        torch.ops.aten._softmax.out(blk, -1, False, out=blk)
        # only a mask can hide every key of a query (causal rows always see key 0): then the
        # softmax gives NaN, and the row is all zeros
        if mask is not None and torch.isnan(blk[..., 0]).any():
            blk.nan_to_num_(nan=0.0)
        if not whole:
            out[..., i:e, :kend].copy_(blk)
        if kend < S and not fresh:
            out[..., i:e, kend:].zero_()
    return out


_UPPER: dict[tuple[int, str], Tensor] = {}


def _upper(n: int, device: torch.device) -> Tensor:
    """``n x n`` float32: -inf above the diagonal, 0 elsewhere (cached: the same every layer)."""
    k = (n, str(device))
    m = _UPPER.get(k)
    if m is None:
        if len(_UPPER) > 16:
            _UPPER.clear()
        m = torch.zeros(n, n, dtype=torch.float32, device=device)
        m.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=device).triu_(1), float("-inf"))
        _UPPER[k] = m
    return m


def mha_weights(module: torch.nn.MultiheadAttention, args: tuple, kwargs: dict) -> Tensor | None:
    """The per-head weights an ``nn.MultiheadAttention`` call used, as ``[batch, head, L, S]``.

    Recomputed with ``F.multi_head_attention_forward(need_weights=True,
    average_attn_weights=False)`` from the module's own parameters and the call's arguments, so it
    works whichever kernel (fast path or not) produced the module's output.
    """
    names = (
        "query",
        "key",
        "value",
        "key_padding_mask",
        "need_weights",
        "attn_mask",
        "average_attn_weights",
        "is_causal",
    )
    bound = dict(zip(names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    query, key, value = bound["query"], bound["key"], bound["value"]
    batched = query.dim() == 3
    if module.batch_first and batched:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    separate = not module._qkv_same_embed_dim
    attn_mask = bound.get("attn_mask")
    is_causal = bool(bound.get("is_causal", False))
    if is_causal and attn_mask is None:
        L, S = query.size(0), key.size(0)
        attn_mask = torch.ones(L, S, dtype=torch.bool, device=query.device).triu_(1)
    _, weights = F.multi_head_attention_forward(
        query,
        key,
        value,
        module.embed_dim,
        module.num_heads,
        module.in_proj_weight,
        module.in_proj_bias,
        module.bias_k,
        module.bias_v,
        module.add_zero_attn,
        0.0,
        module.out_proj.weight,
        module.out_proj.bias,
        training=False,
        key_padding_mask=bound.get("key_padding_mask"),
        need_weights=True,
        attn_mask=attn_mask,
        use_separate_proj_weight=separate,
        q_proj_weight=module.q_proj_weight if separate else None,
        k_proj_weight=module.k_proj_weight if separate else None,
        v_proj_weight=module.v_proj_weight if separate else None,
        average_attn_weights=False,
        is_causal=False,
    )
    if weights is None:
        return None
    return weights if batched else weights.unsqueeze(0)
