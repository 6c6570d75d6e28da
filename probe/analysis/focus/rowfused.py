"""Every per-row term of a CPU block of weights from one read of each row: a compiled loop (numba).

The streamed statistics on a CPU used to make a pass over the block per statistic (the entropy's
log, the masks' product, the causal audit, prefix sums, the gathers of ``beyond_<D>`` and
``reach90``) and sort every row for the effective span (numpy's sort was 43% of the time at 16k
tokens). Here each row is read once, by a loop compiled with numba and split over threads by
rows; while the row sits in the core's cache the loop keeps:

* the total, entropy, largest weight and its first position, the masses on the three key
  classes, the weight on the text's first key, ``Σ (j − i)·a``, ``Σ |j − i|·a``, the largest
  weight after the query (the causal audit) and the row's running sums ``C`` (float64);
* a histogram of the weights' bit patterns (the top 11 bits: sign, exponent and 2 mantissa bits;
  non-negative float32 order as their bit patterns do) holding each bin's count and mass.

Then ``beyond_<D>``, ``reach90`` (a binary search) and the word masses are differences of ``C``,
and the effective span needs no sort: the histogram's running mass finds the one bin where the
smallest weights stop fitting in the left-over mass ``(1 − SPAN_MASS) · total``; only that bin's
weights are sorted (a few, unless a row is nearly uniform) and walked in ascending order, ties one
by one, exactly as the sort of the whole row would (:func:`span_oracle` in the tests).

Masses are float64. Used by :mod:`probe.analysis.focus.streaming` and by the whole-pattern path
(:mod:`probe.analysis.focus.rows`) when numba is installed (the ``fast`` extra); without it both
sort (:func:`spans`'s fallback), which gives the same spans.
"""

from __future__ import annotations

import numpy as np
import torch

from probe.analysis.focus.reach import BEYOND, REACH_MASS
from probe.analysis.focus.rows import SPAN_MASS

try:  # an optional extra: without numba the rows are sorted instead
    import numba
    from numba import njit, prange
except ImportError:  # pragma: no cover - depends on the install
    numba = None

NAMES = (
    "total", "ent", "top", "span", "signed", "dist", "reach", "beyond_16", "beyond_128", "beyond_1024",
    "special", "punct", "content", "first", "after", "neg", "word_prev", "word_self", "word_next",
)  # fmt: skip
SHIFT = 20  # histogram bins: the bit patterns' top 11 bits (2048 bins; +inf is 0x7F8)
BINS = 1 << (31 - SHIFT)
TINY32 = np.float32(np.finfo(np.float32).tiny)

if numba is not None:

    @njit(cache=True, nogil=True)
    def _span(x, bits, total, hmass, hcnt, cand, kmin, kmax):  # pragma: no cover - compiled
        """The effective span of one row (see the module docstring); the histogram's bins
        ``kmin..kmax`` (the only ones the row touched) are zeroed again for the next row."""
        span = 0
        if total > 0.0:
            rest = (1.0 - SPAN_MASS) * total
            cum, left, b = 0.0, 0, kmin
            while b < kmax and cum + hmass[b] <= rest:
                cum += hmass[b]
                left += hcnt[b]
                b += 1
            n = 0
            for j in range(x.shape[0]):
                if (bits[j] >> SHIFT) == b:
                    cand[n] = x[j]
                    n += 1
            vals = np.sort(cand[:n])
            for v in vals:
                if cum + v > rest:
                    break
                cum += v
                left += 1
            span = x.shape[0] - left
        hmass[kmin : kmax + 1] = 0.0
        hcnt[kmin : kmax + 1] = 0
        return span

    @njit(cache=True, nogil=True)
    def _within(C, i, d):  # pragma: no cover - compiled
        """Mass within distance ``d`` of query ``i`` from running sums ``C``."""
        n = C.shape[0]
        hi = min(i + d, n - 1)
        lo = i - d - 1
        return C[hi] - (C[lo] if lo >= 0 else 0.0)

    @njit(cache=True, nogil=True)
    def _one(x, row, i, self_attn, K, cols, first, words, out, arg, C, hmass, hcnt, cand):  # pragma: no cover
        n = x.shape[0]
        bits = x.view(np.int32)
        total, ent, top, at, kmin, kmax = 0.0, 0.0, -1.0, 0, BINS - 1, 0
        signed, dist, m0, m1, m2, after, neg = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
        for j in range(n):
            v = x[j]
            vd = np.float64(v)
            total += vd
            C[j] = total
            if vd > top:
                top, at = vd, j
            ent -= vd * np.log(max(v, TINY32))  # float32 log, as the whole-pattern path takes it
            m0 += vd * cols[0, j]
            m1 += vd * cols[1, j]
            m2 += vd * cols[2, j]
            if v < 0:
                neg = 1.0
            else:
                k = bits[j] >> SHIFT
                hmass[k] += vd
                hcnt[k] += 1
                kmin, kmax = min(kmin, k), max(kmax, k)
            if self_attn:
                d = j - i
                signed += d * vd
                dist += abs(d) * vd
                if d > 0 and vd > after:
                    after = vd
        out[row, 0] = total
        out[row, 1] = ent
        out[row, 2] = max(top, 0.0)
        out[row, 4] = signed
        out[row, 5] = dist
        out[row, 10] = m0
        out[row, 11] = m1
        out[row, 12] = m2
        out[row, 13] = x[first] if first < n else 0.0
        out[row, 14] = after
        out[row, 15] = neg
        arg[row] = at
        out[row, 3] = _span(x, bits, total, hmass, hcnt, cand, kmin, max(kmin, kmax))
        if self_attn:
            for c in range(3):
                D = BEYOND[c]
                out[row, 7 + c] = total - _within(C, i, D) if D < K else 0.0
            lo, hi = 0, K - 1  # reach: the smallest d with within(d) >= REACH_MASS · total
            want = REACH_MASS * total
            while lo < hi:
                mid = (lo + hi) // 2
                if _within(C, i, mid) >= want:
                    hi = mid
                else:
                    lo = mid + 1
            out[row, 6] = hi
            for c in range(words.shape[0]):
                w_lo, w_hi = words[c, 0], words[c, 1]
                out[row, 16 + c] = C[w_hi] - (C[w_lo] if w_lo >= 0 else 0.0)

    @njit(parallel=True, cache=True, nogil=True)
    def _rows(P, h, r, q0, self_attn, K, cols, first, words, out, arg, chunks):  # pragma: no cover
        R, n = P.shape
        step = (R + chunks - 1) // chunks
        for c in prange(chunks):
            C = np.empty(n, np.float64)
            hmass = np.zeros(BINS, np.float64)  # zeroed again after each row, where it was touched
            hcnt = np.zeros(BINS, np.int64)
            cand = np.empty(n, np.float32)
            for row in range(c * step, min(R, (c + 1) * step)):
                b = row // (h * r)
                i = q0 + row % r
                _one(
                    P[row],
                    row,
                    i,
                    self_attn,
                    K,
                    cols[b],
                    first[b],
                    words[b, row % r],
                    out,
                    arg,
                    C,
                    hmass,
                    hcnt,
                    cand,
                )


def available() -> bool:
    """Whether the compiled row loop is installed (numba, the ``fast`` extra)."""
    return numba is not None


def row_terms(
    P: torch.Tensor,
    q0: int,
    K: int | None,
    cols: torch.Tensor,
    first: torch.Tensor,
    words: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor] | None:
    """Every per-row term of a CPU block ``P`` ``[B, h, r, kend]`` (rows ``q0:q0 + r``), each
    ``[B, h, r]``: :data:`NAMES` (``after``: the largest weight on a key after the query) and
    ``arg``; None where a weight is negative (then sort instead). ``K``: the attention's key count
    for self-attention (distances, ``beyond_<D>``, ``reach`` and, with ``words`` (``{name:
    (start, end)}`` ``[B, r]`` as :func:`~probe.analysis.focus.metrics.word_targets` gives them at
    these rows), the word masses); None for cross-attention. ``cols`` ``[B, 3, kend]``: the key
    classes; ``first`` ``[B]``: each text's first real key."""
    B, h, r, n = P.shape
    x = P.reshape(B * h * r, n).contiguous().numpy()
    R = x.shape[0]
    out = np.zeros((R, len(NAMES)), np.float64)
    arg = np.zeros(R, np.int64)
    if words is not None:  # C[e] − C[s − 1], the ends clamped as word_masses clamps them
        names = ("word_prev", "word_self", "word_next")
        s = torch.stack([words[m][0] for m in names], 1)  # [B, 3, r]
        e = torch.stack([words[m][1] for m in names], 1)
        w = torch.stack([torch.where(s > 0, (s - 1).clamp(0, n - 1), -1), e.clamp(0, n - 1)], -1)
    else:
        w = torch.zeros(B, 0, r, 2, dtype=torch.long)
    w = w.permute(0, 2, 1, 3).contiguous().numpy().astype(np.int64)  # [B, r, 3, 2]
    chunks = max(1, min(R, 4 * numba.get_num_threads()))
    _rows(
        x, h, r, q0, K is not None, K or n, cols.float().contiguous().numpy(),
        first.long().numpy(), w, out, arg, chunks,
    )  # fmt: skip
    if out[:, 15].any():
        return None
    t = torch.from_numpy(out).float().T.reshape(len(NAMES), B, h, r)
    got = {m: t[c] for c, m in enumerate(NAMES) if m != "neg"}
    got["arg"] = torch.from_numpy(arg).reshape(B, h, r)
    return got


def spans(P: torch.Tensor) -> torch.Tensor:
    """The effective span of every row of ``P`` ``[..., n]`` (float32), ``[...]``: the compiled
    selection where numba is installed, else a sort with float64 running sums (the same rule)."""
    n = P.shape[-1]
    lead = P.shape[:-1]
    if P.numel() == 0:
        return torch.zeros(lead)
    if numba is not None and bool((P >= 0).all()):
        x = P.reshape(-1, n).float().contiguous().numpy()
        return (
            torch.from_numpy(_spans(x, max(1, min(x.shape[0], 4 * numba.get_num_threads()))))
            .float()
            .reshape(lead)
        )
    vals = P.double().sort(-1).values
    c = vals.cumsum(-1)
    left = (c <= (1 - SPAN_MASS) * c[..., -1:]).sum(-1)
    return (n - left).float()


if numba is not None:

    @njit(parallel=True, cache=True, nogil=True)
    def _spans(x, chunks):  # pragma: no cover - compiled
        R, n = x.shape
        out = np.zeros(R, np.int64)
        step = (R + chunks - 1) // chunks
        for c in prange(chunks):
            hmass = np.zeros(BINS, np.float64)  # zeroed again after each row, where it was touched
            hcnt = np.zeros(BINS, np.int64)
            cand = np.empty(n, np.float32)
            for row in range(c * step, min(R, (c + 1) * step)):
                v = x[row]
                bits = v.view(np.int32)
                total, kmin, kmax = 0.0, BINS - 1, 0
                for j in range(n):
                    k = bits[j] >> SHIFT
                    hmass[k] += v[j]
                    hcnt[k] += 1
                    total += v[j]
                    kmin, kmax = min(kmin, k), max(kmax, k)
                out[row] = _span(v, bits, total, hmass, hcnt, cand, kmin, max(kmin, kmax))
        return out


__all__ = ["row_terms", "spans", "available", "NAMES"]
