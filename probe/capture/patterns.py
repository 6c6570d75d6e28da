"""Attention weights of ``F.scaled_dot_product_attention``, which never materialises them.

SDPA computes ``softmax(q kᵀ · scale + mask) v`` without returning the weights. probe lets the
model call the fused kernel untouched (so its outputs stay bit-identical) and computes the
weights beside it from the very same ``q``, ``k``, mask and scale, with SDPA's documented
semantics, a block of query rows at a time:

* :func:`sdpa_blocks` yields the weights row block by row block (each block valid until the
  next is asked for): what a pattern consumer that never holds a whole pattern reads;
* :func:`sdpa_weights` writes every block into one ``[..., heads, L, S]`` tensor;
* :func:`sdpa_rows` computes chosen query rows only (``O(rows · S)``, never the whole pattern).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor


class _Scores:
    """The operands of one SDPA call, prepared for recomputing its weights block by block."""

    def __init__(
        self, query: Tensor, key: Tensor, attn_mask: Tensor | None, is_causal: bool, scale: float | None
    ) -> None:
        self.L, self.S = L, S = query.size(-2), key.size(-2)
        self.scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
        q = query.float()
        if query.dim() >= 3 and key.dim() >= 3 and key.size(-3) != query.size(-3):
            # grouped-query attention: each key head serves a contiguous group of query heads; the
            # repeat's copy is laid out [E, S] (the products read it a little faster that way)
            kt = key.float().transpose(-2, -1).repeat_interleave(query.size(-3) // key.size(-3), dim=-3)
        else:
            # each head's keys contiguous (models often hand SDPA a view of [B, T, heads, d]): the
            # products against every key read one head's keys, not a stride through all of them
            kt = key.float().contiguous().transpose(-2, -1)
        batch = q.shape[:-2]
        if kt.shape[:-2] != batch:
            batch = torch.broadcast_shapes(batch, kt.shape[:-2])
        self.batch, self.shape = batch, batch + (L, S)
        self.device, self.causal = query.device, is_causal
        float_mask = attn_mask is not None and attn_mask.dtype != torch.bool
        self.mask = attn_mask.float() if float_mask else attn_mask
        self.n = math.prod(batch)
        # the scale goes into the matrix product (baddbmm's alpha) instead of a pass over q or the
        # scores; that needs q and k with the same batch shape, which broadcasting may not give
        self.folded = q.shape[:-2] == batch and kt.shape[:-2] == batch
        if self.folded:
            q, kt = q.reshape(self.n, L, q.size(-1)), kt.reshape(self.n, kt.size(-2), S)
        else:
            q = q * self.scale
        self.q, self.kt = q, kt

    def spans(self, chunk: int, area: int | None = None) -> list[tuple[int, int]]:
        """The ``(start, end)`` query rows of each block: ``chunk`` rows, or under ``is_causal``
        with ``area`` (query x key cells per head) as many rows as keep ``rows x kend`` within
        ``area`` (early rows see few keys, so their blocks take more rows)."""
        L, out, i = self.L, [], 0
        while i < L:
            rows = chunk
            if area and self.causal:  # rows · (i + rows) <= area
                rows = max(chunk, int((math.sqrt(i * i + 4 * area) - i) // 2))
            out.append((i, min(L, i + rows)))
            i = out[-1][1]
        return out

    def blocks(
        self, chunk: int, into: Tensor | None = None, area: int | None = None, lazy: bool = False
    ) -> Iterator[tuple[int, int, Tensor]]:
        """``(start, end, block)``: the softmax weights of query rows ``start:end`` over the keys
        they may see, float32 ``[*batch, end - start, kend]`` (``kend`` is ``S``, or ``min(S, end)``
        under ``is_causal``: later keys are zero and never computed); rows as :meth:`spans`.

        Blocks live in one contiguous scratch buffer (ATen's fused softmax runs in place there),
        valid until the next block. ``into``: a contiguous float32 tensor of the whole shape; when
        one block holds every query and key (a short sequence) it is computed there, no copy.
        ``lazy``: yield ``(start, end, block, fill)`` with the block not yet computed;
        ``fill(bh, a, b, softmax=True)`` computes rows ``a:b`` of its ``bh``-th head (batch and
        heads flattened; ``softmax=False``: their scores only, see :meth:`fill`), so that a
        reader can compute each part on its own thread right before reading it, while it is in
        that core's cache. Every part must be filled before the block is read. ``fill.causal``:
        the call's ``is_causal`` (then ``fill(..., trim=True)`` computes only the keys a part's
        rows may see).
        """
        L, S, n, batch = self.L, self.S, self.n, self.batch
        spans = self.spans(chunk, area)
        kends = [min(S, e) if self.causal else S for _, e in spans]
        scratch = None
        # query r may not see keys after r: one upper triangle of -inf (0 elsewhere) serves every
        # diagonal block; added rather than masked_fill_ed (a broadcast boolean fill is much
        # slower), which gives the same scores (x + 0 is x; only -0.0 turns +0.0, exp of either is 1)
        diag = upper_triangle(max(e - i for i, e in spans), self.device) if self.causal else None
        for (i, e), kend in zip(spans, kends, strict=True):
            if into is not None and i == 0 and e == L and kend == S:
                blk = into
            else:
                if scratch is None:
                    size = max((e1 - i1) * k1 for (i1, e1), k1 in zip(spans, kends, strict=True))
                    scratch = torch.empty(n * size, dtype=torch.float32, device=self.device)
                blk = scratch[: n * (e - i) * kend].view(batch + (e - i, kend))
            if lazy:
                fill = functools.partial(self.fill, blk, i, kend, diag)
                fill.causal = self.causal  # type: ignore[attr-defined]  # (see fill's trim)
                yield i, e, blk, fill
                continue
            if self.folded:
                b3 = blk.view(n, e - i, kend)
                torch.baddbmm(b3, self.q[:, i:e], self.kt[..., :kend], beta=0.0, alpha=self.scale, out=b3)
            else:
                torch.matmul(self.q[..., i:e, :], self.kt[..., :kend], out=blk)  # [..., rows, kend]
            if self.causal and kend > i:  # the diagonal block
                blk[..., i:kend].add_(diag[: e - i, : kend - i])
            self._mask(blk, i, e, kend)
            torch.ops.aten._softmax.out(blk, -1, False, out=blk)
            # only a mask can hide every key of a query (causal rows always see key 0): then the
            # softmax gives NaN, and the row is all zeros
            if self.mask is not None and torch.isnan(blk[..., 0]).any():
                blk.nan_to_num_(nan=0.0)
            yield i, e, blk

    def fill(
        self,
        blk: Tensor,
        i: int,
        kend: int,
        diag: Tensor | None,
        bh: int,
        a: int,
        b: int,
        softmax: bool = True,
        out: Tensor | None = None,
        trim: bool = False,
    ) -> None:
        """Compute rows ``i + a : i + b`` of the ``bh``-th flattened head of the block ``blk``
        (:meth:`blocks` with ``lazy``): the same operations as a whole block, on one part.
        ``softmax=False``: leave the scores (scaled, masked: ``-inf`` where a key is hidden),
        for a reader that takes the softmax of each row itself. ``out`` ``[b - a, kend]``:
        computed there instead of in ``blk`` (a reader's own buffer, kept in its core's cache).
        ``trim`` (``is_causal`` only, with ``softmax=False``): the scores of keys ``:i + b`` only
        (``out`` ``[b - a, i + b]``), the keys after each row's query left as they come (a
        reader that stops at each row's query never reads them)."""
        if trim:
            if not (self.causal and not softmax):
                raise ValueError("fill(trim=True) is for the scores of an is_causal call")
            kend = min(kend, i + b)
        r = blk.size(-2)
        out = blk.view(self.n, r, blk.size(-1))[bh, a:b, :kend] if out is None else out
        at = _unravel(bh, self.batch)
        if self.folded:
            q, kt = self.q[bh, i + a : i + b], self.kt[bh, :, :kend]
            torch.addmm(out, q, kt, beta=0.0, alpha=self.scale, out=out)
        else:
            q = self.q.expand(self.batch + self.q.shape[-2:])[at]
            kt = self.kt.expand(self.batch + self.kt.shape[-2:])[at]
            torch.matmul(q[i + a : i + b], kt[:, :kend], out=out)
        q0, q1 = i + a, i + b
        if self.causal and kend > q0 and not trim:  # the part of the diagonal block
            out[:, q0:kend].add_(diag[a:b, a : a + kend - q0])
        m = self.mask
        if m is not None:
            m = m.expand(self.batch + m.shape[-2:])[at] if m.dim() > 2 else m
            m = m[q0:q1] if m.size(-2) == self.L else m
            m = m[..., :kend] if m.size(-1) == self.S else m
            if m.dtype == torch.bool:
                out.masked_fill_(~m, float("-inf"))
            else:
                out.add_(m)
        if not softmax:
            return
        torch.ops.aten._softmax.out(out, -1, False, out=out)
        if m is not None and torch.isnan(out[:, 0]).any():
            out.nan_to_num_(nan=0.0)

    def _mask(self, blk: Tensor, i: int, e: int, kend: int) -> None:
        m = self.mask
        if m is None:
            return
        m = m[..., i:e, :] if m.size(-2) == self.L else m
        m = m[..., :kend] if m.size(-1) == self.S else m
        if m.dtype == torch.bool:
            blk.masked_fill_(~m, float("-inf"))
        else:
            blk.add_(m)


@torch.no_grad()
def sdpa_blocks(
    query: Tensor,
    key: Tensor,
    value: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    chunk: int = 128,
    area: int | None = None,
    lazy: bool = False,
) -> Iterator[tuple[int, int, Tensor]]:
    """The weights of an SDPA call, ``chunk`` query rows at a time: ``(start, end, block)``.

    Takes SDPA's own arguments (``sdpa_blocks(*args, **kwargs)`` of a call seen), with the
    semantics of :func:`sdpa_weights`. Each ``block`` is float32 ``[..., heads, end - start,
    kend]``: rows ``start:end`` over keys ``:kend``; keys past ``kend`` (unseen by every row
    of a causal block) are zero. A block is overwritten by the next: copy what you keep.
    ``area``: under ``is_causal``, let blocks take more rows while ``rows x kend`` stays within
    ``area`` (see ``_Scores.spans``; every call with the same ``L``, ``chunk`` and ``area`` splits
    its rows the same way). ``lazy``: each block comes uncomputed with its ``fill`` (see
    ``_Scores.blocks``).
    """
    yield from _Scores(query, key, attn_mask, is_causal, scale).blocks(chunk, area=area, lazy=lazy)


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

    Computed in float32, ``chunk`` query rows at a time (:func:`sdpa_blocks`), each block copied
    into ``out`` (allocated if not given or not usable: with ``empty(shape, dtype, device)`` when
    given, e.g. a streaming sink's block-aligned buffers, else ``torch.empty``); under
    ``is_causal`` the keys a block cannot see are never computed, which halves the work.
    ``clean``: the given ``out`` was last filled by a causal call of the same shape, so the keys
    no query can see already hold zeros. ``dtype`` (float32 when None): the dtype ``out``
    stores; the weights are still computed in float32 and converted on their one copy into
    ``out`` (the same rounding as ``.to(dtype)``), never held in float32 as a whole.
    """
    scores = _Scores(query, key, attn_mask, is_causal, scale)
    dtype = dtype or torch.float32
    # fresh: out is known to be zero where a causal query cannot see, so that part needs no pass
    fresh = clean
    if out is None or out.shape != scores.shape or out.dtype != dtype or not out.is_contiguous():
        out = (empty or torch.empty)(scores.shape, dtype=dtype, device=query.device)
        fresh = bool(getattr(empty, "zeroed", False))  # memory that comes zero-filled
    S = scores.S
    for i, e, blk in scores.blocks(chunk, into=out if dtype == torch.float32 else None):
        kend = blk.size(-1)
        if blk is not out:
            out[..., i:e, :kend].copy_(blk)
        if kend < S and not fresh:
            out[..., i:e, kend:].zero_()
    return out


def weights_shape(query: Tensor, key: Tensor) -> tuple[int, ...]:
    """The shape of :func:`sdpa_weights` for an SDPA call's ``query`` and ``key`` (grouped key
    heads repeated to the query heads, batch dimensions broadcast), without computing them."""
    qb, kb = tuple(query.shape[:-2]), tuple(key.shape[:-2])
    if query.dim() >= 3 and key.dim() >= 3 and key.size(-3) != query.size(-3):
        kb = kb[:-1] + (query.size(-3),)
    batch = qb if qb == kb else tuple(torch.broadcast_shapes(qb, kb))
    return batch + (query.size(-2), key.size(-2))


@torch.no_grad()
def sdpa_rows(
    query: Tensor,
    key: Tensor,
    value: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    rows: Tensor,
) -> Tensor:
    """The weights of the query rows ``rows`` of an SDPA call over every key, float32
    ``[batch, heads, R, S]``: row ``r`` of text ``b`` is query ``rows[b, r]`` (``rows``: int64
    ``[batch, R]``, non-negative).

    Only those rows are computed (their queries gathered, the mask's rows gathered, ``is_causal``
    turned into the mask it stands for: query i sees keys ``<= i``), so memory and work are
    ``O(R · S)`` per head, with the semantics of :func:`sdpa_weights`. Needs a 4-d query
    ``[batch, heads, L, E]``.
    """
    B, H, L, E = query.shape
    R, S = rows.size(-1), key.size(-2)
    idx = rows.to(query.device)
    q = query.gather(-2, idx[:, None, :, None].expand(B, H, R, E))
    mask = attn_mask
    if is_causal:
        mask = torch.arange(S, device=query.device) <= idx[:, None, :, None]  # [B, 1, R, S]
    elif mask is not None:
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        if mask.size(-2) == L:
            m = mask.expand(B, mask.size(1), L, mask.size(-1))
            mask = m.gather(-2, idx[:, None, :, None].expand(B, m.size(1), R, m.size(-1)))
    return sdpa_weights(q, key, None, mask, scale=scale if scale is not None else 1.0 / math.sqrt(E))


_UPPER: dict[tuple[int, str], Tensor] = {}


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The index into ``shape`` of the ``flat``-th element in row-major order."""
    out = []
    for size in reversed(shape):
        flat, r = divmod(flat, size)
        out.append(r)
    return tuple(reversed(out))


def upper_triangle(n: int, device: torch.device) -> Tensor:
    """``n x n`` float32: -inf above the diagonal, 0 elsewhere (cached: the same every layer; only
    the last size is kept, so a long text's mask does not outlive the next capture)."""
    k = (n, str(device))
    m = _UPPER.get(k)
    if m is None:
        _UPPER.clear()
        m = torch.zeros(n, n, dtype=torch.float32, device=device)
        m.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=device).triu_(1), float("-inf"))
        _UPPER[k] = m
    return m


# -- flex_attention ------------------------------------------------------------------------------
def _vmap_bhqk(fn: Any, prefix: int) -> Any:
    """``fn`` vectorised over ``[b, h, q, k]`` index tensors (``prefix`` leading mapped arguments,
    the scores), as flex_attention applies its ``score_mod`` and ``mask_mod``."""
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=(0,) * prefix + dims)
    return fn


def _block_allowed(block_mask: tuple, m: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
    """``(partial, full)``: whether the block of each ``[.., .., m, n]`` position is computed with
    ``mask_mod`` applied (partial) or whole (full), from a ``BlockMask.as_tuple()``."""
    kv_num, kv_idx, full_num, full_idx = block_mask[2:6]
    kv_block, q_block = block_mask[-3], block_mask[-2]

    def dense(num: Tensor | None, idx: Tensor | None) -> Tensor:
        if num is None:
            return torch.zeros((1, 1, m.numel(), n.numel()), dtype=torch.bool, device=m.device)
        cols = torch.arange(idx.size(-1), device=idx.device)
        valid = cols < num.unsqueeze(-1)  # [B, H, q_blocks, slots]
        n_kv = max(int(idx.max()) + 1 if idx.numel() else 1, int(n.max() // kv_block) + 1)
        d = torch.zeros(*idx.shape[:-1], n_kv + 1, dtype=torch.bool, device=idx.device)
        d.scatter_(-1, torch.where(valid, idx.long(), n_kv), True)
        d = d[..., :n_kv]
        return d[:, :, (m // q_block).long()][..., (n // kv_block).long()]

    return dense(kv_num, kv_idx), dense(full_num, full_idx)


@torch.no_grad()
def flex_weights(
    query: Tensor,
    key: Tensor,
    value: Tensor | None,
    score_mod: Any,
    block_mask: tuple,
    scale: float,
    kernel_options: Any = None,
    score_mod_other_buffers: tuple = (),
    mask_mod_other_buffers: tuple = (),
    *,
    chunk: int = 128,
) -> Tensor:
    """The attention weights a ``flex_attention`` call uses, float32 ``[batch, heads, L, S]``.

    Takes the arguments of torch's flex_attention operator (what ``flex_attention(q, k, v,
    score_mod, block_mask, scale)`` hands it: ``block_mask`` as ``BlockMask.as_tuple()``, the
    scale resolved) with its semantics: scores ``q kᵀ · scale`` (float32, float64 for float64
    inputs), then ``score_mod(score, b, h, q_idx, kv_idx)``; a position is kept where its block
    is a full block of the block mask, or a partial block whose ``mask_mod(b, h, q_idx, kv_idx)``
    is true; softmax over the kept keys, rows with none all zeros. Grouped-query key heads serve
    contiguous groups of query heads. Computed ``chunk`` query rows at a time.
    """
    try:  # tensor indexing inside score_mod/mask_mod under vmap, as flex's own reference does
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    except ImportError:  # pragma: no cover - older torch
        import contextlib

        TransformGetItemToIndex = contextlib.nullcontext  # noqa: N806
    B, H, L, _ = query.shape
    if key.size(1) != H:
        key = key.repeat_interleave(H // key.size(1), dim=1)
    key = key.expand(B, *key.shape[1:])
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    q, kt = query.to(work), key.to(work).transpose(-2, -1)
    S = kt.size(-1)
    dev = query.device
    b, h, n = (torch.arange(x, device=dev) for x in (B, H, S))
    mask_mod = block_mask[-1]
    smod = _vmap_bhqk(lambda s, *i: score_mod(s, *i, *score_mod_other_buffers), 1)
    mmod = _vmap_bhqk(lambda *i: mask_mod(*i, *mask_mod_other_buffers), 0)
    out = torch.empty(B, H, L, S, dtype=torch.float32, device=dev)
    for i in range(0, L, chunk):
        e = min(L, i + chunk)
        m = torch.arange(i, e, device=dev)
        scores = (q[:, :, i:e] @ kt) * scale
        partial, full = _block_allowed(block_mask, m, n)
        with TransformGetItemToIndex():
            mod = smod(scores, b, h, m, n).to(work)
            keep = full | (partial & mmod(b, h, m, n))
        w = torch.softmax(mod.masked_fill(~keep, float("-inf")), dim=-1)
        out[:, :, i:e] = torch.nan_to_num(w, nan=0.0)
    return out
