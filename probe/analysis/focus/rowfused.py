"""Every per-row term of a CPU block of weights, and its column sums, from a compiled loop (numba).

Each row is read while it sits in the core's cache, in three short loops (the first one
vectorised by LLVM: it is plain arithmetic, with the log of :func:`~.spanselect.ln` instead of a
call to the C library's, and the sums may be reordered):

1. one flat loop: the entropy, masses on the three key classes, ``Σ (j − i)·a`` and
   ``Σ |j − i|·a`` (float64), the largest weight after the query (the causal audit; as int32 bit
   patterns, which order non-negative float32 as their values do), whether a weight is negative,
   the column sums ``Σ_i w_i a_ij`` (the sink profile, float64, one accumulator per head), and the
   masses below and in the bin where the previous row's span crossed and its two neighbours;
2. over chunks of :data:`CH` keys: each chunk's sum (the total) and largest weight, then the first
   position of the largest weight (the first chunk holding it, then that chunk);
3. the effective span (:mod:`~.spanselect`, no sort): where one of those three bins crosses,
   its weights collected at once; else a histogram of bit patterns finds the bin.

``beyond_<D>``, ``reach90`` (a binary search) and the word masses are differences of running sums
``C(j) = Σ_{j' <= j} a``: the chunk sums' running total plus a part of one chunk. Rows are split
over :func:`~.spanselect.threads` threads by head (a head's rows on one thread, so its column sums
need no lock; the calling thread is one of them), each running the compiled loop with the GIL
released. Where the block comes uncomputed (``fill``), each thread computes its parts right
before it reads them.

Masses are float64. Used by :mod:`probe.analysis.focus.streaming` when numba is installed (the
``fast`` extra); without it the rows are sorted (:mod:`probe.analysis.focus.rowblock`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from probe.analysis.focus import spanselect as ss
from probe.analysis.focus.reach import BEYOND, REACH_MASS
from probe.analysis.focus.spanselect import numba, spans

if numba is not None:
    from numba import njit

NAMES = (
    "total", "ent", "top", "span", "signed", "dist", "reach", "beyond_16", "beyond_128", "beyond_1024",
    "special", "punct", "content", "first", "after", "neg", "word_prev", "word_self", "word_next",
)  # fmt: skip
PART = 1 << 17  # weights per part when the block is filled part by part (512 KiB: a core's cache)
PART_ROWS = 32  # but no fewer rows a part (a skinnier matrix product is slower than the cache saves)
CH = 256  # keys per chunk: its sum and largest weight are kept for the running sums and argmax

if numba is not None:

    @njit(fastmath=ss.FAST, cache=True, nogil=True, error_model="numpy")
    def _run(x, lo, hi, PS, c):  # pragma: no cover - compiled
        """``C(hi) − C(lo)`` for ``-1 <= lo <= hi < len(x)``: running sums from the chunk totals
        ``PS`` (``PS[c]`` = the sum of chunks ``< c``) plus the parts of the chunks at the ends."""
        return _upto(x, hi, PS, c) - _upto(x, lo, PS, c)

    @njit(fastmath=ss.FAST, cache=True, nogil=True, error_model="numpy")
    def _upto(x, j, PS, c):  # pragma: no cover - compiled
        if j < 0:
            return 0.0
        k = j // c
        s = 0.0
        if j - k * c < c // 2 or (k + 1) * c > x.shape[0]:  # from the nearer end of its chunk
            for t in range(k * c, j + 1):
                s += np.float64(x[t])
            return PS[k] + s
        for t in range(j + 1, (k + 1) * c):
            s += np.float64(x[t])
        return PS[k + 1] - s

    @njit(fastmath=ss.FAST, cache=True, nogil=True, error_model="numpy")
    def _chunks(x, bits, PS, M):  # pragma: no cover - compiled
        """Each chunk's sum (running, into ``PS``) and largest bit pattern (``M``); the largest."""
        n = x.shape[0]
        top = np.int32(-1)
        PS[0] = 0.0
        for c in range((n + CH - 1) // CH):  # a fixed trip count vectorises
            s, mx = 0.0, np.int32(-1)
            base = c * CH
            if base + CH <= n:
                for t in range(CH):
                    s += np.float64(x[base + t])
                    mx = max(mx, bits[base + t])
            else:
                for j in range(base, n):
                    s += np.float64(x[j])
                    mx = max(mx, bits[j])
            PS[c + 1] = PS[c] + s
            M[c] = mx
            top = max(top, mx)
        return top

    @njit(fastmath=ss.FAST, cache=True, nogil=True, error_model="numpy")
    def _distances(x, i, K, total, words, out, PS):  # pragma: no cover - compiled
        """``beyond_<D>``, ``reach`` and the word masses of row ``x`` (query ``i``) into ``out``."""
        n = x.shape[0]
        for t in range(3):
            D = BEYOND[t]
            out[7 + t] = total - _run(x, i - D - 1, min(i + D, n - 1), PS, CH) if D < K else 0.0
        lo, hi = 0, K - 1  # reach: the smallest d with within(d) >= REACH_MASS · total
        want = REACH_MASS * total
        while lo < hi:
            mid = (lo + hi) // 2
            if _run(x, i - mid - 1, min(i + mid, n - 1), PS, CH) >= want:
                hi = mid
            else:
                lo = mid + 1
        out[6] = hi
        for t in range(words.shape[0]):
            out[16 + t] = _run(x, words[t, 0], words[t, 1], PS, CH)

    @njit(fastmath=ss.FAST, cache=True, nogil=True, error_model="numpy")
    def _one(
        x, i, self_attn, K, cols, first, words, w, acc, out, PS, M, hmass, hcnt, cand, guess
    ):  # pragma: no cover
        """The terms of one row ``x`` (query ``i``) into ``out`` (:data:`NAMES`, then the argmax);
        ``w · x`` added to the column sums ``acc``. ``guess``: the first-level bin where the
        previous row's span crossed (−1: none); returns this row's (see :func:`_span`: this row's
        masses and counts below and in the bins ``guess − 1``, ``guess``, ``guess + 1`` are
        summed here as the row is read)."""
        n = x.shape[0]
        bits = x.view(np.int32)
        ent, m0, m1, m2, signed, dist, neg = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0
        after, low, low_seen = np.int32(0), np.int32(0x7FFFFFFF), np.int32(0x7FFFFFFF)
        glo, ghi = guess - 1, guess + 1
        s_below, s_lo, s_mid, s_hi, n_below, n_lo, n_mid = 0.0, 0.0, 0.0, 0.0, 0, 0, 0
        for j in range(n):  # one flat loop: LLVM keeps every sum in vector registers
            b = bits[j]
            v = np.float64(x[j])
            k = b >> ss.SHIFT
            s_below += v if k < glo else 0.0
            s_lo += v if k == glo else 0.0
            s_mid += v if k == guess else 0.0
            s_hi += v if k == ghi else 0.0
            n_below += k < glo
            n_lo += k == glo
            n_mid += k == guess
            ent += v * ss.ln(max(b, np.int32(ss.TINY_BITS)))  # p · log max(p, tiny)
            m0 += v * cols[0, j]
            m1 += v * cols[1, j]
            m2 += v * cols[2, j]
            d = np.float64(j - i)
            signed += d * v
            dist += abs(d) * v
            after = max(after, b if j > i else np.int32(0))
            low = min(low, b)
            low_seen = min(low_seen, b if j <= i else np.int32(0x7FFFFFFF))
            neg |= b < 0  # a negative weight (or -0.0): the caller sorts instead
            acc[j] += w * v
        nch = (n + CH - 1) // CH
        top = _chunks(x, bits, PS, M)
        total = PS[nch]
        out[15] = neg
        if neg:
            return -1
        at = 0
        for c in range(nch):  # the first chunk holding the largest weight, then its first place
            if M[c] == top:
                at = c * CH
                while bits[at] != top:
                    at += 1
                break
        out[0] = total
        out[1] = -ent
        out[2] = x[at]
        out[19] = at
        out[10], out[11], out[12] = m0, m1, m2
        out[13] = x[first] if first < n else 0.0
        out[14] = ss.f32(after)
        seen, zeros = min(n, i + 1), 0
        if self_attn and after == 0 and 0 < seen < n:
            # nothing after the query (a causal row): the zeros there are the smallest weights,
            # all left out of the span, so only keys up to the query are binned
            low, n, zeros = low_seen, seen, n - seen
        sums = (s_below, s_lo, s_mid, s_hi)
        counts = (n_below, n_lo, n_mid, zeros)
        crossed = _span(x[:n], bits[:n], total, low, top, guess, sums, counts, hmass, hcnt, cand, out)
        if not self_attn:
            return crossed
        out[4], out[5] = signed, dist
        _distances(x, i, K, total, words, out, PS)
        return crossed

    @njit(cache=True, nogil=True, error_model="numpy")
    def _span(x, bits, total, low, top, guess, sums, counts, hmass, hcnt, cand, out):  # pragma: no cover
        """The effective span of ``x`` into ``out[3]``; returns the first-level bin that crossed
        (−1: none). Neighbouring rows of a head read the same keys, so their spans mostly cross
        in the same bin or the next one: where one of the bins ``guess − 1``, ``guess`` and
        ``guess + 1`` crosses (the masses below it fit in the rest and with the bin's own do not;
        ``sums``: the mass below ``guess − 1`` and in each of the three, ``counts``: the count below
        ``guess − 1`` and in the first two, then the zeros after a causal row's query, counted
        below any bin above 0 but not part of ``x``), the histogram is skipped; else
        :func:`~.spanselect.crossing` finds the bin."""
        out[3] = 0
        if not total > 0.0:
            return -1
        rest = (1.0 - ss.SPAN_MASS) * total
        b, cum, left = -1, 0.0, 0
        if guess >= 0:
            c0 = sums[0]
            c1 = c0 + sums[1]
            c2 = c1 + sums[2]
            if guess >= 1 and c0 <= rest < c1:
                b, cum, left = guess - 1, c0, counts[0]
            elif c1 <= rest < c2:
                b, cum, left = guess, c1, counts[0] + counts[1]
            elif c2 <= rest < c2 + sums[3]:
                b, cum, left = guess + 1, c2, counts[0] + counts[1] + counts[2]
            left -= counts[3] * (b > 0)
        if b < 0:
            b, cum, left = ss.crossing(x, bits, total, low >> ss.SHIFT, top >> ss.SHIFT, hmass, hcnt)
        out[3] = ss.finish(x, bits, total, b, cum, left, hmass, hcnt, cand)
        return b

    @njit(cache=True, nogil=True, error_model="numpy")
    def _scratch(n):  # pragma: no cover - compiled
        """What :func:`_tasks` works in for rows of ``n`` keys: the chunk sums and maxima, and
        the span's histograms (zero, and left zero by each row's selection) and candidates."""
        PS = np.empty((n + CH - 1) // CH + 1, np.float64)
        M = np.empty((n + CH - 1) // CH, np.int32)
        hmass, hcnt, cand = ss.scratch(n)
        return PS, M, hmass, hcnt, cand

    @njit(fastmath=ss.FAST, cache=True, nogil=True, error_model="numpy")
    def _tasks(
        x, tasks, h, r, q0, self_attn, K, cols, first, words, colw, out, acc, work
    ):  # pragma: no cover
        """The rows of each task ``(head, row start, row end)`` (``x`` ``[B·h·r, n]``); the
        column sums of task ``t`` go to ``acc[t]``; ``work``: :func:`_scratch`'s arrays."""
        PS, M, hmass, hcnt, cand = work
        for t in range(tasks.shape[0]):
            bh, a0, a1 = tasks[t, 0], tasks[t, 1], tasks[t, 2]
            b = bh // h
            guess = -1
            for a in range(a0, a1):
                row = bh * r + a
                guess = _one(
                    x[row], q0 + a, self_attn, K, cols[b], first[b], words[b, a], colw[b, a],
                    acc[t], out[row], PS, M, hmass, hcnt, cand, guess,
                )  # fmt: skip


def available() -> bool:
    """Whether the compiled row loop is installed (numba, the ``fast`` extra)."""
    return numba is not None


def _tasks_of(heads: int, r: int, n: int, k: int, filled: bool) -> np.ndarray:
    """The ``(head, row start, row end)`` tasks of a block for ``k`` threads: a head's rows on one
    thread (its column sums then need no lock), split further when there are fewer heads than
    threads, or (``filled``: each part computed by its thread) into parts of about :data:`PART`
    weights and at least :data:`PART_ROWS` rows, which stay in a core's cache."""
    per = -(-2 * k // heads) if heads < 2 * k else 1
    if filled:
        per = max(per, min(-(-r * n // PART), r // PART_ROWS))
    return np.array([(bh, a0, a1) for bh in range(heads) for a0, a1 in ss.parts(r, per)], np.int64)


def row_terms(
    P: torch.Tensor,
    q0: int,
    K: int | None,
    cols: torch.Tensor,
    first: torch.Tensor,
    words: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    colw: torch.Tensor | None = None,
    fill: Callable[[int, int, int], None] | None = None,
) -> dict[str, torch.Tensor] | None:
    """Every per-row term of a CPU block ``P`` ``[B, h, r, kend]`` (rows ``q0:q0 + r``), each
    ``[B, h, r]``: :data:`NAMES` (``after``: the largest weight on a key after the query) and
    ``arg``; None where a weight is negative (then sort instead). ``K``: the attention's key count
    for self-attention (distances, ``beyond_<D>``, ``reach`` and, with ``words`` (``{name:
    (start, end)}`` ``[B, r]`` as :func:`~probe.analysis.focus.metrics.word_targets` gives them at
    these rows), the word masses); None for cross-attention. ``cols`` ``[B, 3, kend]``: the key
    classes; ``first`` ``[B]``: each text's first real key. ``colw`` ``[B, r]``: each query's
    weight in the column sums, returned as ``recv`` ``[B, h, kend]`` (float64, ``Σ_i w_i a_ij``).

    ``fill(bh, a, b)``: ``P`` (contiguous) is not computed yet; each part (the rows ``a:b`` of its
    ``bh``-th head, batch and heads flattened) is computed by ``fill`` on the thread that reads it,
    right before, in parts of about :data:`PART` weights, so that it is read from that core's cache
    (and the recompute runs on every thread too)."""
    B, h, r, n = P.shape
    if fill is not None and not P.is_contiguous():
        raise ValueError("row_terms fills only a contiguous block")
    x = P.reshape(B * h * r, n).contiguous().numpy()
    out = np.zeros((B * h * r, len(NAMES) + 1), np.float64)  # + the argmax
    if words is not None:  # C[e] − C[s − 1], the ends clamped as word_masses clamps them
        names = ("word_prev", "word_self", "word_next")
        s = torch.stack([words[m][0] for m in names], 1)  # [B, 3, r]
        e = torch.stack([words[m][1] for m in names], 1)
        wr = torch.stack([torch.where(s > 0, (s - 1).clamp(0, n - 1), -1), e.clamp(0, n - 1)], -1)
    else:
        wr = torch.zeros(B, 0, r, 2, dtype=torch.long)
    wr = wr.permute(0, 2, 1, 3).contiguous().numpy().astype(np.int64)  # [B, r, 3, 2]
    w = np.zeros((B, r), np.float64) if colw is None else colw.double().contiguous().numpy()
    k = ss.threads()
    tasks = _tasks_of(B * h, r, n, k, fill is not None)
    acc = np.zeros((len(tasks), n), np.float64)
    args = (
        h,
        r,
        q0,
        K is not None,
        K or n,
        cols.float().contiguous().numpy(),
        first.long().numpy(),
        wr,
        w,
        out,
    )

    def run(a: int, b: int) -> None:
        work = _scratch(n)  # once per thread's share, not per part
        if fill is None:
            _tasks(x, tasks[a:b], *args, acc[a:b], work)
            return
        for t in range(a, b):
            fill(*(int(v) for v in tasks[t]))
            _tasks(x, tasks[t : t + 1], *args, acc[t : t + 1], work)

    ss.spread(run, len(tasks))
    if out[:, 15].any():
        return None
    t = torch.from_numpy(out[:, : len(NAMES)]).float().T.reshape(len(NAMES), B, h, r)
    got = {m: t[c] for c, m in enumerate(NAMES) if m != "neg"}
    got["arg"] = torch.from_numpy(out[:, len(NAMES)]).long().reshape(B, h, r)
    if colw is not None:
        recv = torch.from_numpy(acc)
        got["recv"] = (
            torch.zeros(B * h, n, dtype=torch.float64)
            .index_add_(0, torch.from_numpy(tasks[:, 0]), recv)
            .view(B, h, n)
        )
    return got


__all__ = ["row_terms", "spans", "available", "NAMES"]
