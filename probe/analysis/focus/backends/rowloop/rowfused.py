"""Every per-row term of a CPU block of weights, and its column sums, from a compiled loop (numba).

Each row is read while it sits in the core's cache:

1. :func:`~.rowpass.read_row`, two passes that LLVM vectorises: the exact (float64) chunk sums
   of :data:`CH` keys, the masses and counts below, in and next to the bin where the previous
   row's span crossed, and the column sums ``Σ_i w_i a_ij`` (the sink profile, float64, one
   accumulator per head); then eight weights a step, the entropy (the log of
   :func:`~.rowpass.ln32`), the masses on the three key classes, ``Σ (j − i)·a`` and
   ``Σ |j − i|·a``, each chunk's largest and smallest weight (the argmax; the largest weight
   after the query for the causal audit, as int32 bit patterns, which order non-negative float32
   as their values do; whether a weight is negative);
2. the first position of the largest weight: the first chunk holding it, then that chunk;
3. the effective span (:mod:`~.spanselect`, no sort): where the previous row's bin or a
   neighbour crosses, that bin's weights are collected at once; else a histogram of bit patterns
   finds the bin; :func:`~.spanselect.select` finds the crossing among its weights.

Each row's sums over the duplicate-token and induction pairs (``pairs``: the keys of each row,
in one compressed list) are read there too, while the row is in cache.

``beyond_<D>``, ``reach90`` (a binary search) and the word masses are differences of running sums
``C(j) = Σ_{j' <= j} a``: the chunk sums' running total plus a part of one chunk. Rows are split
over :func:`~.workers.threads` threads in tasks of one head's rows (each task sums its own
columns, added up afterwards, so no lock); each thread takes the next task when done with one (the
calling thread is one of them) and runs the compiled loop with the GIL released. Where the block
comes uncomputed (``fill``), each thread computes its parts' scores (one matrix product) into
its own buffer right before it reads them (:mod:`~.rowparts`: the block is never written), and
the loop takes each row's softmax itself
(:func:`~.rowpass.softmax_row`: a max, then ``e^(x − max)`` and its sums, the ``1/Z`` scale
folded into the first read; the entropy then from the scores, with no log of a weight).

The loop's compiled functions (here, in :mod:`~.rowpass` and :mod:`~.spanselect`) are compiled
without numba's runtime (``_nrt=False``): they allocate nothing (each thread's scratch comes from
:func:`_scratch`), so they need no reference counts, which numba otherwise keeps on each array and
view a function passes on, each a call into its runtime and an atomic add: 13% of the loop's
samples under ``perf`` (one thread, replayed on a layer's parts at 4,096 keys; without them the
loop took 0.874 of its time). Each also asks LLVM for 512-bit vectors (:func:`~.spanselect.wide`:
0.88 of the loop's time again, where the CPU has AVX-512).

Reported masses are float64 sums (the entropy, class masses and distances of float32 partial sums
of at most 256 weights). The backend :mod:`probe.analysis.focus.backends.numba_rows` uses it when
numba is installed (the ``fast`` extra); without it the rows are sorted
(:mod:`probe.analysis.focus.backends.reference`).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import numpy as np
import torch

from probe.analysis.focus.backends.rowloop import rowpass, workers
from probe.analysis.focus.backends.rowloop import spanselect as ss
from probe.analysis.focus.backends.rowloop.jit import njit, numba
from probe.analysis.focus.backends.rowloop.rowparts import (
    NAMES,
    Kept,
    Sink,
    outputs,
    part_buffer,
    results,
    tasks_of,
    word_ranges,
)
from probe.analysis.focus.backends.rowloop.spanselect import spans
from probe.analysis.focus.definitions.table import BEYOND, REACH_MASS

CH = rowpass.CH

if numba is not None:

    @njit(fastmath=ss.FAST, inline="always", cache=True, nogil=True, error_model="numpy")
    def _run(x, lo, hi, PS, c, i, total):  # pragma: no cover - compiled
        """``C(hi) − C(lo)`` for ``-1 <= lo <= hi < len(x)``: running sums from the chunk totals
        ``PS`` (``PS[c]`` = the sum of chunks ``< c``) plus the parts of the chunks at the ends;
        ``i``: every weight after key ``i`` is zero (−1: not known), so ``C(j) = total`` for ``j >= i``
        (and ``x`` may end at ``i``: a row read to its query)."""
        top = total if 0 <= i <= hi else _upto(x, hi, PS, c)
        return top - (total if 0 <= i <= lo else _upto(x, lo, PS, c))

    @njit(fastmath=ss.FAST, inline="always", cache=True, nogil=True, error_model="numpy")
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

    @njit(fastmath=ss.FAST, cache=True, nogil=True, error_model="numpy", _nrt=False)
    def _distances(x, i, K, total, words, out, PS, flat):  # pragma: no cover - compiled
        """``beyond_<D>``, ``reach`` and the word masses of row ``x`` (query ``i``) into ``out``;
        ``flat``: no weight after the query (a causal row: one end of each range costs nothing)."""
        ss.wide()
        n = x.shape[0]
        z = i if flat else -1
        for t in range(3):
            D = BEYOND[t]
            out[7 + t] = total - _run(x, i - D - 1, min(i + D, n - 1), PS, CH, z, total) if D < K else 0.0
        lo, hi = 0, K - 1  # reach: the smallest d with within(d) >= REACH_MASS · total
        want = REACH_MASS * total
        if flat and total == total:
            lo = hi = _reach_flat(x, i, total, want, PS)  # (the search below then has nothing to do)
        while lo < hi:
            mid = (lo + hi) // 2
            if _run(x, i - mid - 1, min(i + mid, n - 1), PS, CH, z, total) >= want:
                hi = mid
            else:
                lo = mid + 1
        out[6] = hi
        for t in range(words.shape[0]):
            out[16 + t] = _run(x, words[t, 0], words[t, 1], PS, CH, z, total)

    @njit(fastmath=ss.FAST, inline="always", cache=True, nogil=True, error_model="numpy")
    def _reach_flat(x, i, total, want, PS):  # pragma: no cover - compiled
        """``reach`` of a row with no weight after its query ``i``: there ``within(d) = total −
        C(i − d − 1)`` falls as ``i − d − 1`` grows, so the smallest ``d`` with ``within(d) >=
        want`` comes from the last key ``j = i − d − 1`` that keeps it: the last chunk whose
        start keeps it (a binary search over the chunk totals ``PS``), then a walk through that
        chunk (where :func:`_distances`' binary search over ``d`` summed part of a chunk at each
        of its dozen steps)."""
        lo, hi = 0, i // CH  # C(c·CH − 1) = PS[c]; PS[0] = 0 always keeps it
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if total - PS[mid] >= want:
                lo = mid
            else:
                hi = mid - 1
        j, s = lo * CH - 1, PS[lo]
        end = min(i - 1, lo * CH + CH - 2)  # (the next chunk's start is known not to keep it)
        while j < end and total - (s + np.float64(x[j + 1])) >= want:
            j += 1
            s += np.float64(x[j])
        return i - j - 1

    @njit(cache=True, nogil=True, error_model="numpy", _nrt=False)
    def _argmax(x, bits, top, M):  # pragma: no cover - compiled
        """The first position of the largest bit pattern ``top``: the first chunk holding it
        (``M``: each chunk's largest, as many as ``x`` has chunks), then its first place there."""
        ss.wide()
        for c in range((x.shape[0] + CH - 1) // CH):
            if M[c] == top:
                at = c * CH
                while bits[at] != top:
                    at += 1
                return at
        return 0

    @njit(fastmath=ss.FAST, cache=True, nogil=True, error_model="numpy", _nrt=False)
    def _one(x, i, self_attn, K, cols, first, words, w, acc, out, work, guess):  # pragma: no cover
        """The terms of one row ``x`` (query ``i``) into ``out`` (:data:`NAMES`, then the argmax);
        ``w · x`` added to the column sums ``acc``. ``guess``: the first-level bin where the
        previous row's span crossed (−1: none); returns this row's (see :func:`_span`). ``x`` is
        weights, or a softmax to finish where ``work``'s ``soft[0]`` is 1 (see
        :func:`~.rowpass.read_row`)."""
        ss.wide()
        PS, M, hmass, hcnt, cand, sums, soft, pad, _ = work
        n = x.shape[0]
        bits = x.view(np.int32)
        glo = max(guess - 1, 0)
        top, low, low_seen, after = rowpass.read_row(x, i, cols, glo, w, acc, PS, M, sums, soft, pad)
        total = PS[(n + CH - 1) // CH]
        out[15] = low < 0  # a negative weight (or -0.0): the caller sorts instead
        if low < 0:
            return -1
        at = _argmax(x, bits, top, M)
        out[0] = total
        out[1] = -sums[0]
        out[2] = x[at]
        out[19] = at
        out[10], out[11], out[12] = sums[1], sums[2], sums[3]
        out[13] = x[first] if first < n else 0.0
        out[14] = ss.f32(after)
        seen, zeros = min(n, i + 1), 0
        if self_attn and after == 0 and 0 < seen < n:
            # nothing after the query (a causal row): the zeros there are the smallest weights,
            # all left out of the span, so only keys up to the query are read
            low, n, zeros = low_seen, seen, n - seen
        crossed = _span(x[:n], bits[:n], total, low, top, glo if guess >= 0 else -1, sums, zeros, work, out)
        if not self_attn:
            return crossed
        out[4], out[5] = sums[5] - sums[4], sums[5] + sums[4]
        _distances(x, i, K, total, words, out, PS, after == 0)
        return crossed

    @njit(fastmath=ss.FAST, cache=True, nogil=True, error_model="numpy", _nrt=False)
    def _span(x, bits, total, low, top, glo, sums, zeros, work, out):  # pragma: no cover - compiled
        """The effective span of ``x`` into ``out[3]``; returns the first-level bin where it
        crossed (−1: none). Neighbouring rows of a head read the same keys, so their spans mostly
        cross in the same bin or the next one: ``glo`` is the bin below the previous row's (−1:
        none), and the row's masses and counts below ``glo``, ``glo + 1`` and ``glo + 2``
        (``sums``, see :func:`~.rowpass.read_row`) say whether one of those two bins crosses, else
        whether ``glo + 2`` may (its weights then summed here); else the histogram
        (:func:`~.spanselect.crossing`) finds the bin. The crossing bin's weights are collected and
        :func:`~.spanselect.select` leaves out as many as fit. ``zeros``: the zeros after a
        causal row's query, counted below any bin above 0 but not part of ``x``."""
        ss.wide()
        out[3] = 0
        if not total > 0.0:
            return -1
        PS, M, hmass, hcnt, cand, _, _, _, _ = work
        rest = (1.0 - ss.SPAN_MASS) * total
        b, cum, left = -1, 0.0, 0
        if glo >= 0:
            c0, c1, c2 = sums[6], sums[8], sums[10]
            if c0 <= rest < c1:
                b, cum, left = glo, c0, int(sums[7])
            elif c1 <= rest < c2:
                b, cum, left = glo + 1, c1, int(sums[9])
            elif c2 <= rest:
                b, cum, left = glo + 2, c2, int(sums[11])
            left -= zeros * (b > 0)
        if b >= 0:
            m = ss.collect(x, bits, b, b + 1, cand)
            mass = 0.0
            for t in range(m):
                mass += np.float64(cand[t])
            if cum + mass > rest:
                left, _ = ss.select(cand, m, cum, left, rest)
                out[3] = x.shape[0] - left
                return b
        b, cum, left = ss.crossing(x, bits, total, low >> ss.SHIFT, top >> ss.SHIFT, hmass, hcnt)
        out[3] = ss.finish(x, bits, total, b, cum, left, cand)
        return b

    @njit(cache=True, nogil=True, error_model="numpy", _nrt=False)
    def _pair_sums(x, pairs, at, stride, row):  # pragma: no cover - compiled
        """Each template's sum of the row's weights on its keys (see :func:`_tasks`), float64."""
        ss.wide()
        ptr, keys, sums = pairs
        n = x.shape[0]  # (a row read to its query: every later key's weight is 0)
        for t in range(sums.shape[0]):
            k = t * stride + at
            s = 0.0
            for c in range(ptr[k], ptr[k + 1]):
                s += np.float64(x[keys[c]]) if keys[c] < n else 0.0
            sums[t, row] = s

    @njit(cache=True, nogil=True, error_model="numpy", _nrt=False)
    def _kept(x, i, near, first, frow):  # pragma: no cover - compiled
        """The weights of row ``x`` (query ``i``) on the keys ``i − W .. i + W`` into ``near``
        (``2W + 1`` of them; 0 where a key is missing, or past the row's end: a row read to its
        query) and, where ``i`` is its text's ``first`` real query, the row into ``frow``."""
        ss.wide()
        W = (near.shape[0] - 1) // 2
        n = x.shape[0]
        for c in range(near.shape[0]):
            j = i - W + c
            near[c] = x[j] if 0 <= j < n else 0.0
        if i == first:
            for j in range(n):  # (a slice assignment allocates, and this loop runs without numba's runtime)
                frow[j] = x[j]

    @njit(cache=True, nogil=True, error_model="numpy")
    def _scratch(n):  # pragma: no cover - compiled
        """What :func:`_tasks` works in for rows of ``n`` keys: the chunk sums and maxima, the
        span's histograms (zero, and left zero by each row's selection) and candidates, and the
        sums of :func:`~.rowpass.read_row` and the softmax's (:func:`~.rowpass.softmax_row`), and
        the chunks both pad a row's last part into, with pass 2's sums of a chunk, and one row's
        terms (:func:`_one` writes them there, :func:`_tasks` copies them out)."""
        PS = np.empty((n + CH - 1) // CH + 1, np.float64)
        M = np.empty((n + CH - 1) // CH, np.int32)
        hmass, hcnt, cand = ss.scratch(n)
        sums, soft = np.empty(len(rowpass.SUMS), np.float64), np.zeros(4, np.float64)
        return PS, M, hmass, hcnt, cand, sums, soft, np.empty((3, CH), np.float32), np.empty(len(NAMES) + 1)

    @njit(fastmath=ss.FAST, cache=True, nogil=True, error_model="numpy", _nrt=False)
    def _tasks(
        x, xoff, trim, tasks, h, r, q0, self_attn, K, cols, first, words, colw, keep, out, acc, work,
        guesses, ends, pairs, near, firsts, frows,
    ):  # pragma: no cover  # fmt: skip
        """The rows of each task ``(head, row start, row end)`` (row ``bh·r + a`` is ``x[bh·r + a −
        xoff]``: ``x`` the block ``[B·h·r, n]`` with ``xoff`` 0, or one task's rows; ``trim``:
        each row read only to its query, the keys an ``is_causal`` call hides after it, which
        need hold nothing); ``out`` ``(terms, arg, oq, o0)``: the terms of row ``a`` of head ``bh``
        go to the output row ``o = bh·oq + o0 + a`` (``oq, o0``: ``r, 0`` for a block's own
        arrays, ``Q, q0`` for a whole attention's, :class:`~.rowparts.Sink`): its :data:`NAMES`
        into ``terms[:, o]`` (float32, as each term's tensor takes them) and its argmax into
        ``arg[o]``; the column sums of task ``t`` go to ``acc[t]``; ``work``:
        :func:`_scratch`'s arrays. Each task starts from the bin ``guesses[head]`` (the previous
        block's last row of that head) and the task that ends a head's rows leaves its last row's
        in ``ends[head]``. ``keep`` ``[B, n]`` (float32; ``[0, 0]``: ``x`` holds weights): ``x``
        holds scores, each row's softmax taken here (:func:`~.rowpass.softmax_row`, the weights
        on keys where ``keep`` is 0 then dropped). ``pairs`` ``(ptr, keys, sums)``: the keys of
        template ``t`` on row ``a`` of text ``b`` are ``keys[ptr[k]:ptr[k + 1]]``, ``k = (t·B +
        b)·r + a``; their weights' sum goes to ``sums[t, o]`` (float32). ``near`` (row ``o``),
        ``firsts``, ``frows``: what :class:`~.rowparts.Kept` keeps of the weights (``near`` ``[0,
        1]``: nothing), by :func:`_kept`."""
        ss.wide()
        soft, pad, one = work[6], work[7], work[8]
        terms, arg, oq, o0 = out
        for t in range(tasks.shape[0]):
            bh, a0, a1 = tasks[t, 0], tasks[t, 1], tasks[t, 2]
            b = bh // h
            guess = guesses[bh]
            for a in range(a0, a1):
                row, o = bh * r + a, bh * oq + o0 + a
                xr = x[row - xoff]
                if trim:
                    xr = xr[: min(xr.shape[0], q0 + a + 1)]
                if keep.shape[0]:
                    rowpass.softmax_row(xr, keep[b], soft, pad)
                else:
                    soft[0] = 0.0
                for c in range(one.shape[0]):
                    one[c] = 0.0
                guess = _one(
                    xr, q0 + a, self_attn, K, cols[b], first[b], words[b, a], colw[b, a],
                    acc[t], one, work, guess,
                )  # fmt: skip
                for c in range(terms.shape[0]):
                    terms[c, o] = one[c]
                arg[o] = np.int64(one[terms.shape[0]])
                _pair_sums(xr, pairs, b * r + a, cols.shape[0] * r, o)
                if near.shape[0]:
                    _kept(xr, q0 + a, near[o], firsts[b], frows[bh])
            if a1 == r:
                ends[bh] = guess


_LOCAL = threading.local()  # each thread's _scratch (see _work)


def _work(n: int) -> tuple:
    """This thread's :func:`_scratch` for rows of up to ``n`` keys, kept from block to block (made
    afresh for each block, its arrays were allocated and its histograms zeroed once a block a
    thread): larger than a row needs is fine, the loop sizes what it reads by the row, and every
    row's selection leaves the histograms zero."""
    got = getattr(_LOCAL, "work", None)
    if got is None or got[0] < n:
        got = _LOCAL.work = (n, _scratch(n))
    return got[1]


def available() -> bool:
    """Whether the compiled row loop is installed (numba, the ``fast`` extra)."""
    return numba is not None


def row_terms(
    P: torch.Tensor,
    q0: int,
    K: int | None,
    cols: torch.Tensor,
    first: torch.Tensor,
    words: dict[str, tuple[torch.Tensor, torch.Tensor]] | np.ndarray | None = None,
    colw: torch.Tensor | None = None,
    fill: Callable[..., None] | None = None,
    guesses: np.ndarray | None = None,
    keep: torch.Tensor | None = None,
    pairs: dict[str, tuple[torch.Tensor, ...]] | None = None,
    kept: tuple[int, torch.Tensor] | None = None,
    trim: bool = False,
    into: Sink | None = None,
) -> dict[str, torch.Tensor] | None:
    """Every per-row term of a CPU block ``P`` ``[B, h, r, kend]`` (rows ``q0:q0 + r``), each
    ``[B, h, r]``: :data:`NAMES` (``after``: the largest weight on a key after the query) and
    ``arg``; None where a weight is negative (then sort instead). ``K``: the attention's key count
    for self-attention (distances, ``beyond_<D>``, ``reach`` and, with ``words`` (``{name:
    (start, end)}`` ``[B, r]`` as :func:`~probe.analysis.focus.definitions.terms.word_targets` gives them at
    these rows, or their :func:`~.rowparts.word_bounds`), the word masses); None for
    cross-attention. ``cols`` ``[B, 3, kend]``: the key
    classes; ``first`` ``[B]``: each text's first real key. ``colw`` ``[B, r]``: each query's
    weight in the column sums, returned as ``recv`` ``[B, h, kend]`` (float64, ``Σ_i w_i a_ij``).

    ``fill(bh, a, b, out=buf, trim=...)``: ``P`` is never written; each part (rows ``a:b`` of head ``bh``,
    flattened) is computed by ``fill`` into a buffer of the thread that reads it, right before
    (:mod:`~.rowparts`), and what the caller reads of the weights after the loop comes back
    instead (``kept``, see :class:`~.rowparts.Kept`); where a weight is negative (a softmax gives
    none), ``P`` is filled with the weights before None is returned. ``trim`` (``fill`` of an
    ``is_causal`` call, :meth:`~probe.capture.patterns._Scores.fill`): each part computes only the
    keys its rows may see, and each row is read to its query and no further.

    ``guesses`` ``[B·h]`` (int64): the first-level bin where each head's span crossed in the row
    before the block (−1: none), updated to this block's last row: consecutive blocks of one
    attention pass it on, so each head's first row tries its neighbour's bin too. ``keep`` ``[B,
    kend]`` (1 or 0): ``P`` (or what ``fill`` computes) holds a softmax's scores (scaled, ``-inf``
    on hidden keys): the loop takes each row's softmax as it reads the row
    (:func:`~.rowpass.softmax_row`), then drops the weights on keys where ``keep`` is 0 (padding
    keys; the rest not renormalised). ``pairs`` ``{name: (b, i, j, ...)}``: pairs of a template
    (``i`` a row of the block, ``j`` a key;
    :func:`~probe.analysis.focus.backends.workspace.template_pairs`): returned as ``name`` ``[B,
    h, r]``, each row's sum of its weights on its pairs' keys, read while the row is in cache.

    ``into``: the attention's :class:`~.rowparts.Sink` (this block's rows at ``q0``): the terms, pair
    sums and near-diagonal weights go there; only ``recv`` and ``first_row`` come back."""
    B, h, r, n = P.shape
    x = P.reshape(B * h * r, n).contiguous().numpy() if fill is None else np.empty((0, n), np.float32)
    w = np.zeros((B, r), np.float64) if colw is None else colw.double().contiguous().numpy()
    k, trim = workers.threads(), trim and fill is not None
    tasks = tasks_of(B * h, r, n, k, fill is not None, q0 + r if trim else 0)
    acc = np.zeros((len(tasks), n), np.float64)
    start = np.full(B * h, -1, np.int64) if guesses is None else guesses.copy()
    ends = np.full(B * h, -1, np.int64) if guesses is None else guesses
    keep_ = np.zeros((0, 0), np.float32) if keep is None else keep.float().contiguous().numpy()
    args = (h, r, q0, K is not None, K or n, cols.float().contiguous().numpy(), first.long().numpy())
    held_of = (kept or (0, None)) if fill is not None else None  # (what is kept of a part never written)
    out, (names, csr), held = outputs((B, h, r, n), q0, into, pairs, held_of)
    args += (word_ranges(words, B, r, n), w, keep_, out)
    near = held.arrays() if held is not None else Kept.NOTHING
    order = itertools.count()  # each thread takes the next task when it is done with one
    most = int((tasks[:, 2] - tasks[:, 1]).max()) * n if len(tasks) else 0

    listed = tasks.tolist()

    def run(*_: int) -> None:  # a thread's share is whatever tasks it takes, not spread's run
        work = _work(n)
        buf = part_buffer(most) if fill is not None else None
        while (t := next(order)) < len(listed):
            bh, a0, a1 = listed[t]
            rows, off = x, 0
            if buf is not None:  # this part into the thread's own buffer, then read there
                kp = min(n, q0 + a1) if trim else n  # (trimmed: the keys its last row sees)
                rows, off = buf[: (a1 - a0) * kp].reshape(a1 - a0, kp), bh * r + a0
                fill(bh, a0, a1, out=torch.from_numpy(rows), trim=trim)
            _tasks(rows, off, trim, tasks[t : t + 1], *args, acc[t : t + 1], work, start, ends, csr, *near)

    workers.spread(run, min(k, len(tasks)))
    return results(P, out, acc if colw is not None else None, tasks, (names, csr[2]), held, into, fill, keep)


__all__ = ["row_terms", "spans", "available", "NAMES"]
