"""Every per-row statistic of an SDPA self-attention from tiles of ``q`` and ``k``: the weights are
never written to memory (a Triton kernel, for CUDA devices).

The streamed statistics otherwise recompute each block of weights into memory (``T²/2`` float32
per head, written then read again) and reduce it. Here one Triton program per block of
:data:`BM` query rows of one head reads ``K`` tile by tile:

1. **the row's log-sum-exp**: scores ``q kᵀ · scale`` (+ the mask; ``is_causal`` keys after the
   query are never read), an online maximum and sum, as in flash attention;
2. **the terms**: each tile's weights ``p = exp(s − lse)`` (zero on padding keys) give the row's
   total, entropy, largest weight and its first position, the masses on the three key classes,
   the weight on the text's first key, ``Σ (j − i)·p``, ``Σ |j − i|·p``, the masses within
   ``D`` of the query (``beyond_<D>``), whether any weight lies after the query (the causal audit),
   and the column sums over real queries (the sink profile; float64 atomics);
3. **the two statistics that need the whole row**, the effective span and ``reach90``, by a
   search over the whole row that tests :data:`NT` thresholds per pass over ``K``: the span's
   threshold over the bit patterns of the non-negative float32 weights (their order is their
   weights' order), as :mod:`~.rowkernel` does in registers, and the reach over
   the distance. The first of these passes is pass 2 itself; each further pass divides every
   row's interval by ``NT + 1`` (:data:`LEVELS` passes in all for the span's 2³⁰ patterns).

Masses are summed per tile in float32 and across tiles in float64. The span is exact in the sense
of :mod:`~probe.analysis.focus.backends.rowloop.spanselect` (the weights strictly below the
threshold, then as many copies of the threshold as still fit in the left-over mass). Masks:
``is_causal``, a boolean or additive float ``attn_mask`` broadcast to ``[B, H, L, S]``, grouped-query
key heads, any scale.

On a CPU Triton's interpreter (``TRITON_INTERPRET=1`` before this module is imported) runs the same
kernel on CPU tensors: that is how the tests check it where no GPU is.
"""

from __future__ import annotations

import math

import torch

from probe.analysis.focus.definitions.table import BEYOND, REACH_MASS, SPAN_MASS

try:  # Triton ships with PyTorch's CUDA wheels; a CPU-only install has none, and needs none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BM = 32  # query rows per program
BN = 32  # keys per tile
NT = 16  # thresholds tested per pass by the span and reach searches (a power of 2)
SPAN_BITS = 0x3F800001  # one past the bit pattern of 1.0: every weight exp(s − lse) <= 1 is below
NAMES = (
    "total", "ent", "top", "span", "signed", "dist", "reach",
    "beyond_16", "beyond_128", "beyond_1024", "special", "punct", "content", "first", "after",
    "word_prev", "word_self", "word_next",
)  # fmt: skip
WORDS = ("word_prev", "word_self", "word_next")
# (REACH_LEVELS is at least 4, enough for 17^4 keys: one compiled kernel serves every length)


def levels(n: int, nt: int = NT) -> int:
    """Passes of ``nt`` thresholds that narrow an interval of ``n`` integers to one."""
    out = 0
    while n > 1:
        n = -(-n // (nt + 1))
        out += 1
    return max(out, 1)


# fmt: off
if triton is not None:

    @triton.jit
    def _scores(q, Kb, sk_s, offs_n, rows, S, scale, Mb, sm_l, sm_s, CAUSAL: tl.constexpr, MASK: tl.constexpr,
                BLOCK_E: tl.constexpr, E):
        """Scores of the query tile ``q`` against keys ``offs_n``: -inf where a key is hidden."""
        e = tl.arange(0, BLOCK_E)
        kmask = (offs_n[:, None] < S) & (e[None, :] < E)
        k = tl.load(Kb + offs_n[:, None].to(tl.int64) * sk_s + e[None, :], mask=kmask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        inside = (offs_n[None, :] < S) & (rows[:, None] >= 0)
        ok = inside
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= rows[:, None])
        if MASK != 0:
            mptr = Mb + rows[:, None].to(tl.int64) * sm_l + offs_n[None, :].to(tl.int64) * sm_s
            if MASK == 1:
                ok = ok & (tl.load(mptr, mask=inside, other=0) != 0)
            else:
                s = s + tl.load(mptr, mask=inside, other=0.0)
        return tl.where(ok, s, float("-inf"))

    @triton.jit
    def _weights(s, lse, kreal):
        """``exp(s − lse)`` (0 for a row with no key), zero on padding keys."""
        live = lse > float("-inf")
        p = tl.exp(s - tl.where(live, lse, 0.0)[:, None])
        return tl.where(live[:, None] & (kreal[None, :] != 0) & (s > float("-inf")), p, 0.0)

    @triton.jit
    def _word(p, j2, lo, hi):
        """``Σ_{j <= hi} p − Σ_{j <= lo} p`` per row (a word's mass as the prefix-sum difference)."""
        up = tl.sum(tl.where(j2 <= hi[:, None], p, 0.0), axis=1)
        return (up - tl.sum(tl.where(j2 <= lo[:, None], p, 0.0), axis=1)).to(tl.float64)

    @triton.jit
    def _f64(x):
        return tl.sum(x, axis=1).to(tl.float64)

    @triton.jit
    def _lse(q, Kb, Mb, sk_s, sm_l, sm_s, rows_c, S, n_end, scale, E, CAUSAL: tl.constexpr,
             MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
        """Pass 1: each row's log-sum-exp (an online maximum and sum; -inf for a row with no key)."""
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        for n0 in range(0, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            s = _scores(q, Kb, sk_s, offs_n, rows_c, S, scale, Mb, sm_l, sm_s, CAUSAL, MASK, BLOCK_E, E)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            l_i = l_i * tl.exp(m_i - safe) + tl.sum(tl.exp(s - safe[:, None]), axis=1)
            m_i = m_new
        return tl.where(m_i > float("-inf"), m_i + tl.log(tl.maximum(l_i, 1.0)), float("-inf"))

    @triton.jit
    def _below(p, ad, ts, tr, fs, cs, wr, REACH: tl.constexpr):
        """Add one tile to the searches: the mass and count of weights below each span threshold
        ``ts`` and the mass within each distance ``tr``."""
        bits = p.to(tl.int32, bitcast=True)
        below = bits[:, :, None] < ts[:, None, :]
        fs += tl.sum(tl.where(below, p[:, :, None], 0.0), axis=1).to(tl.float64)
        cs += tl.sum((below & (p[:, :, None] > 0)).to(tl.int32), axis=1)
        if REACH:
            near = ad[:, :, None] <= tr[:, None, :]
            wr += tl.sum(tl.where(near, p[:, :, None], 0.0), axis=1).to(tl.float64)
        return fs, cs, wr

    @triton.jit
    def _thresholds(lo, hi, ks, NTH: tl.constexpr):
        """``NTH`` integers spread over ``[lo, hi)`` per row, ``[BLOCK_M, NTH]``."""
        n = (hi - lo).to(tl.int64)
        return (lo[:, None].to(tl.int64) + (n[:, None] * ks[None, :]) // (NTH + 1)).to(tl.int32)

    @triton.jit
    def _narrow(fs, cs, wr, ts, tr, ks, total, rest_share, reach_share, st, NTH: tl.constexpr,
                REACH: tl.constexpr):
        """One step of both searches on ``st = (lo_s, hi_s, f_lo, c_lo, c_hi, lo_r, hi_r)``. Span:
        the largest pattern whose strictly smaller weights sum to at most the rest; reach: the
        smallest distance whose mass within is reach_share of the total."""
        lo_s, hi_s, f_lo, c_lo, c_hi, lo_r, hi_r = st
        n_ok = tl.sum((fs <= (rest_share * total)[:, None]).to(tl.int32), axis=1)
        pick_lo = ks[None, :] == n_ok[:, None]  # threshold n_ok (1-based) is the last that fits
        pick_hi = ks[None, :] == (n_ok + 1)[:, None]
        has_lo = n_ok > 0
        has_hi = n_ok < NTH
        lo_s = tl.where(has_lo, tl.sum(tl.where(pick_lo, ts, 0), axis=1), lo_s)
        f_lo = tl.where(has_lo, tl.sum(tl.where(pick_lo, fs, 0.0), axis=1), f_lo)
        c_lo = tl.where(has_lo, tl.sum(tl.where(pick_lo, cs, 0), axis=1), c_lo)
        hi_s = tl.where(has_hi, tl.sum(tl.where(pick_hi, ts, 0), axis=1), hi_s)
        c_hi = tl.where(has_hi, tl.sum(tl.where(pick_hi, cs, 0), axis=1), c_hi)
        if REACH:
            good = wr >= (reach_share * total)[:, None]
            hi_r = tl.minimum(hi_r, tl.min(tl.where(good, tr, 0x7FFFFFFF), axis=1))
            lo_r = tl.maximum(lo_r, tl.max(tl.where(good, -1, tr), axis=1) + 1)
        return lo_s, hi_s, f_lo, c_lo, c_hi, lo_r, hi_r

    @triton.jit
    def _level(q, Kb, Mb, KREAL, b, sk_s, sm_l, sm_s, rows, rows_c, S, n_end, scale, E, lse, ts, tr,
               CAUSAL: tl.constexpr, MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_E: tl.constexpr, NTH: tl.constexpr, REACH: tl.constexpr):
        """A further pass over the keys for the searches alone."""
        fs = tl.zeros((BLOCK_M, NTH), tl.float64)
        cs = tl.zeros((BLOCK_M, NTH), tl.int32)
        wr = tl.zeros((BLOCK_M, NTH), tl.float64)
        for n0 in range(0, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            s = _scores(q, Kb, sk_s, offs_n, rows_c, S, scale, Mb, sm_l, sm_s, CAUSAL, MASK, BLOCK_E, E)
            p = _weights(s, lse, tl.load(KREAL + b.to(tl.int64) * S + offs_n, mask=offs_n < S, other=0))
            fs, cs, wr = _below(p, tl.abs(offs_n[None, :] - rows[:, None]), ts, tr, fs, cs, wr, REACH)
        return fs, cs, wr

    @triton.jit
    def _add(acc, p, d, ad, n0, offs_n, cb, S, first_key, qreal, wlo, whi, D0, D1, D2, WORDS: tl.constexpr):
        """Add one tile of weights to the row sums ``acc`` (see :func:`_terms`)."""
        total, ent, top, arg, signed, dist, w0, w1, w2, c0, c1, c2, at_first, after, npos, x0, x1, x2 = acc
        kin = offs_n < S
        t_max = tl.max(p, axis=1)
        arg = tl.where(t_max > top, tl.argmax(p, axis=1, tie_break_left=True).to(tl.int32) + n0, arg)
        top = tl.maximum(top, t_max)
        total += _f64(p)
        ent -= _f64(p * tl.log(tl.maximum(p, 1.1754943508222875e-38)))
        signed += _f64(p * d.to(tl.float32))
        dist += _f64(p * ad.to(tl.float32))
        w0 += _f64(tl.where(ad <= D0, p, 0.0))
        w1 += _f64(tl.where(ad <= D1, p, 0.0))
        w2 += _f64(tl.where(ad <= D2, p, 0.0))
        c0 += _f64(p * tl.load(cb, mask=kin, other=0.0)[None, :])
        c1 += _f64(p * tl.load(cb + S, mask=kin, other=0.0)[None, :])
        c2 += _f64(p * tl.load(cb + 2 * S, mask=kin, other=0.0)[None, :])
        at_first += _f64(tl.where(offs_n[None, :] == first_key, p, 0.0))
        after = tl.maximum(after, tl.max(tl.where((d > 0) & (qreal[:, None] != 0), p, 0.0), axis=1))
        npos += tl.sum((p > 0).to(tl.int32), axis=1)
        if WORDS:
            x0 += _word(p, offs_n[None, :], tl.load(wlo), tl.load(whi))
            x1 += _word(p, offs_n[None, :], tl.load(wlo + 1), tl.load(whi + 1))
            x2 += _word(p, offs_n[None, :], tl.load(wlo + 2), tl.load(whi + 2))
        return total, ent, top, arg, signed, dist, w0, w1, w2, c0, c1, c2, at_first, after, npos, x0, x1, x2

    @triton.jit
    def _terms(q, Kb, Mb, KREAL, COLS, RECV, bh, b, first_key, qreal, wlo, whi, sk_s, sm_l, sm_s, rows,
               rows_c, S, n_end, scale, E, lse, ts, tr, D0, D1, D2, CAUSAL: tl.constexpr, MASK: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, NTH: tl.constexpr,
               WORDS: tl.constexpr):
        """Pass 2: every per-row term (``total, ent, top, arg, signed, dist, beyond_<D> x3, the
        three key classes, first, after, npos, the three word masses``), the column sums over real
        queries into ``RECV``, and the searches' first step."""
        z = tl.zeros((BLOCK_M,), tl.float64)
        top = tl.full((BLOCK_M,), -1.0, tl.float32)
        after = tl.zeros((BLOCK_M,), tl.float32)
        i0 = tl.zeros((BLOCK_M,), tl.int32)
        acc = (z, z, top, i0, z, z, z, z, z, z, z, z, z, after, i0, z, z, z)
        fs = tl.zeros((BLOCK_M, NTH), tl.float64)
        cs = tl.zeros((BLOCK_M, NTH), tl.int32)
        wr = tl.zeros((BLOCK_M, NTH), tl.float64)
        for n0 in range(0, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            s = _scores(q, Kb, sk_s, offs_n, rows_c, S, scale, Mb, sm_l, sm_s, CAUSAL, MASK, BLOCK_E, E)
            p = _weights(s, lse, tl.load(KREAL + b.to(tl.int64) * S + offs_n, mask=offs_n < S, other=0))
            d = offs_n[None, :] - rows[:, None]
            ad = tl.abs(d)
            cb = COLS + b.to(tl.int64) * 3 * S + offs_n
            acc = _add(acc, p, d, ad, n0, offs_n, cb, S, first_key, qreal, wlo, whi, D0, D1, D2, WORDS)
            col = tl.sum(p * qreal[:, None], axis=0).to(tl.float64)
            tl.atomic_add(RECV + bh.to(tl.int64) * S + offs_n, col, mask=offs_n < S)
            fs, cs, wr = _below(p, ad, ts, tr, fs, cs, wr, True)
        return acc, fs, cs, wr

    @triton.jit
    def _qk_stats(Q, Kp, M, KREAL, QREAL, COLS, FIRST, WLO, WHI, OUT, ARG, LSE, RECV,
                  H, G, L, S, E, scale, rest_share, reach_share, D0, D1, D2,
                  sq_b, sq_h, sq_l, sk_b, sk_h, sk_s, sm_b, sm_h, sm_l, sm_s,
                  CAUSAL: tl.constexpr, MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_E: tl.constexpr, NTH: tl.constexpr, SPAN_LEVELS: tl.constexpr,
                  REACH_LEVELS: tl.constexpr, N_OUT: tl.constexpr, WORDS: tl.constexpr):
        """One program: ``BLOCK_M`` query rows of one (text, head); see the module docstring."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rvalid = rows < L
        rows_c = tl.where(rvalid, rows, -1)  # a missing row sees no key
        e = tl.arange(0, BLOCK_E)
        qb = Q + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h
        qmask = rvalid[:, None] & (e[None, :] < E)
        q = tl.load(qb + rows[:, None].to(tl.int64) * sq_l + e[None, :], mask=qmask, other=0.0)
        Kb = Kp + b.to(tl.int64) * sk_b + (h // G).to(tl.int64) * sk_h
        Mb = M + b.to(tl.int64) * sm_b + h.to(tl.int64) * sm_h
        n_end = S
        if CAUSAL:
            n_end = tl.minimum(S, (pid_m + 1) * BLOCK_M)
        lse = _lse(q, Kb, Mb, sk_s, sm_l, sm_s, rows_c, S, n_end, scale, E, CAUSAL, MASK, BLOCK_M, BLOCK_N,
                   BLOCK_E)
        qreal = tl.load(QREAL + b.to(tl.int64) * L + rows, mask=rvalid, other=0).to(tl.float32)
        ks = (tl.arange(0, NTH) + 1).to(tl.int64)
        i0 = tl.zeros((BLOCK_M,), tl.int32)
        st = (i0, i0 + 0x3F800001, tl.zeros((BLOCK_M,), tl.float64), i0, i0, i0, i0 + (S - 1))
        ts = _thresholds(st[0], st[1], ks, NTH)
        tr = _thresholds(st[5], st[6], ks, NTH)
        wb = (b.to(tl.int64) * L + tl.where(rvalid, rows, 0)) * 3  # word ends [B, L, 3]
        acc, fs, cs, wr = _terms(q, Kb, Mb, KREAL, COLS, RECV, bh, b, tl.load(FIRST + b), qreal, WLO + wb,
                                 WHI + wb, sk_s, sm_l, sm_s, rows, rows_c, S, n_end, scale, E, lse, ts, tr,
                                 D0, D1, D2, CAUSAL, MASK, BLOCK_M, BLOCK_N, BLOCK_E, NTH, WORDS)
        total = acc[0]
        st = (st[0], st[1], st[2], st[3], acc[14], st[5], st[6])  # c_hi: every positive weight
        st = _narrow(fs, cs, wr, ts, tr, ks, total, rest_share, reach_share, st, NTH, True)
        for level in tl.static_range(1, SPAN_LEVELS):
            ts = _thresholds(st[0], st[1], ks, NTH)
            tr = _thresholds(st[5], st[6], ks, NTH)
            fs, cs, wr = _level(q, Kb, Mb, KREAL, b, sk_s, sm_l, sm_s, rows, rows_c, S, n_end, scale, E, lse,
                                ts, tr, CAUSAL, MASK, BLOCK_M, BLOCK_N, BLOCK_E, NTH, level < REACH_LEVELS)
            st = _narrow(fs, cs, wr, ts, tr, ks, total, rest_share, reach_share, st, NTH,
                         level < REACH_LEVELS)
        _store(OUT, ARG, LSE, bh, L, rows, rvalid, lse, acc, st, rest_share, N_OUT)

    @triton.jit
    def _store(OUT, ARG, LSE, bh, L, rows, rvalid, lse, acc, st, rest_share, N_OUT: tl.constexpr):
        """The span from the searches' end (the weights equal to the threshold v come next in
        sorted order: as many as still fit), then every term of the row, in :data:`NAMES` order."""
        total, npos = acc[0], acc[14]
        lo_s, f_lo, c_lo, c_hi = st[0], st[2], st[3], st[4]
        v = lo_s.to(tl.float32, bitcast=True).to(tl.float64)
        j = tl.where(v > 0, tl.floor((rest_share * total - f_lo) / tl.where(v > 0, v, 1.0)), 0.0)
        j = tl.minimum(tl.maximum(j, 0.0), (c_hi - c_lo).to(tl.float64))
        span = npos - c_lo - j.to(tl.int32)
        base = OUT + (bh.to(tl.int64) * L + rows) * N_OUT
        tl.store(base + 0, total.to(tl.float32), mask=rvalid)
        tl.store(base + 1, acc[1].to(tl.float32), mask=rvalid)
        tl.store(base + 2, tl.maximum(acc[2], 0.0), mask=rvalid)
        tl.store(base + 3, span.to(tl.float32), mask=rvalid)
        tl.store(base + 4, acc[4].to(tl.float32), mask=rvalid)
        tl.store(base + 5, acc[5].to(tl.float32), mask=rvalid)
        tl.store(base + 6, st[6].to(tl.float32), mask=rvalid)
        tl.store(base + 7, (total - acc[6]).to(tl.float32), mask=rvalid)  # beyond_<D> (0 if D >= S: below)
        tl.store(base + 8, (total - acc[7]).to(tl.float32), mask=rvalid)
        tl.store(base + 9, (total - acc[8]).to(tl.float32), mask=rvalid)
        for c in tl.static_range(3):
            tl.store(base + 10 + c, acc[9 + c].to(tl.float32), mask=rvalid)
            tl.store(base + 15 + c, acc[15 + c].to(tl.float32), mask=rvalid)
        tl.store(base + 13, acc[12].to(tl.float32), mask=rvalid)
        tl.store(base + 14, acc[13], mask=rvalid)
        tl.store(ARG + bh.to(tl.int64) * L + rows, acc[3].to(tl.int64), mask=rvalid)
        tl.store(LSE + bh.to(tl.int64) * L + rows, lse, mask=rvalid)
# fmt: on


def usable(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None) -> bool:
    """Whether :func:`qk_terms` takes this SDPA call: Triton, ``[B, H, L, E]`` queries and keys
    (key heads dividing query heads), float32/float16/bfloat16, and a mask that broadcasts to
    ``[B, H, L, S]``."""
    if triton is None or q.dim() != 4 or k.dim() != 4:
        return False
    B, H, L, E = q.shape
    if k.size(0) not in (1, B) or H % k.size(1) or k.size(-1) != E or E > 256:
        return False
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or q.device != k.device:
        return False
    if attn_mask is not None:
        try:
            torch.broadcast_shapes(attn_mask.shape, (B, H, L, k.size(2)))
        except RuntimeError:
            return False
        if attn_mask.dim() > 4:
            return False
    return True


def qk_terms(
    q: torch.Tensor,
    k: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    *,
    kreal: torch.Tensor,
    qreal: torch.Tensor,
    cols: torch.Tensor,
    first: torch.Tensor,
    words: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """The per-row terms of the SDPA self-attention ``softmax(q kᵀ · scale + mask)``, each
    ``[B, H, L]`` (:data:`NAMES`, ``arg`` and ``lse``, the row's log-sum-exp), plus ``recv``
    ``[B, H, S]`` (float64): ``Σ_i qreal_i · p_ij``.

    ``kreal`` ``[B, S]``: real keys (weight on others is zeroed after the softmax, as the streamed
    path does); ``qreal`` ``[B, L]``: the queries whose rows count in ``recv`` and in ``after``
    (the largest weight on a key after the query); ``cols`` ``[B, 3, S]``: the special, punct and
    content key classes; ``first`` ``[B]``: each text's first real key; ``words``
    (:func:`~probe.analysis.focus.definitions.terms.word_targets`) ``{name: (start, end)}`` ``[B, L]``:
    also each query's mass on its previous/own/next word, as
    :func:`~probe.analysis.focus.definitions.terms.word_masses` takes it from prefix sums."""
    B, H, L, E = q.shape
    S = k.size(2)
    dev = q.device
    q = q.float().contiguous()
    k = k.float().expand(B, *k.shape[1:]).contiguous()
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    kind, m = 0, torch.zeros(1, device=dev)
    strides = (0, 0, 0, 0)
    if attn_mask is not None:  # broadcast by strides (0 along broadcast dimensions), never copied whole
        kind = 1 if attn_mask.dtype == torch.bool else 2
        mm = attn_mask.view(torch.uint8) if kind == 1 else attn_mask.float()
        while mm.dim() < 4:
            mm = mm.unsqueeze(0)
        m = mm.expand(B, H, L, S)
        strides = tuple(m.stride())
    out = torch.empty(B * H * L, len(NAMES), dtype=torch.float32, device=dev)
    arg = torch.empty(B * H * L, dtype=torch.long, device=dev)
    lse = torch.empty(B * H * L, dtype=torch.float32, device=dev)
    recv = torch.zeros(B * H * S, dtype=torch.float64, device=dev)
    wlo = whi = torch.zeros(1, dtype=torch.int32, device=dev)
    if words is not None:  # C[e] − C[s − 1] with the ends clamped as word_masses clamps them
        s_, e_ = (torch.stack([words[n][i] for n in WORDS], -1).to(dev) for i in (0, 1))  # [B, L, 3]
        whi = e_.clamp(0, S - 1).to(torch.int32).contiguous()
        wlo = torch.where(s_ > 0, (s_ - 1).clamp(0, S - 1), -1).to(torch.int32).contiguous()
    grid = (triton.cdiv(L, BM), B * H)
    _qk_stats[grid](
        q, k, m, kreal.to(dev, torch.uint8).contiguous(), qreal.to(dev, torch.uint8).contiguous(),
        cols.to(dev, torch.float32).contiguous(), first.to(dev, torch.int32).contiguous(), wlo, whi,
        out, arg, lse, recv,
        H, H // k.size(1), L, S, E, scale, 1.0 - SPAN_MASS, REACH_MASS, *BEYOND,
        *q.stride()[:3], *k.stride()[:3], *strides,
        CAUSAL=bool(is_causal), MASK=kind, BLOCK_M=BM, BLOCK_N=BN,
        BLOCK_E=max(16, triton.next_power_of_2(E)), NTH=NT, SPAN_LEVELS=levels(SPAN_BITS),
        REACH_LEVELS=max(4, levels(S)), N_OUT=len(NAMES), WORDS=words is not None, num_warps=4,
    )  # fmt: skip
    got = {n: out[:, c].reshape(B, H, L) for c, n in enumerate(NAMES)}
    for D in BEYOND:
        if D >= S:  # no key is that far
            got[f"beyond_{D}"].zero_()
    got["arg"], got["lse"] = arg.reshape(B, H, L), lse.reshape(B, H, L)
    got["recv"] = recv.reshape(B, H, S)
    return got


__all__ = ["qk_terms", "usable", "levels", "NAMES", "BM", "BN", "NT"]
