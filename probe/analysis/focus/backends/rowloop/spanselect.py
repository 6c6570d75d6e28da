"""The effective span of a row of weights without sorting it, and a log that vectorises (numba).

The effective span is the fewest keys whose weights cover :data:`SPAN_MASS` of the row's mass: sort
the row ascending, keep a float64 running sum, and leave out the most smallest weights whose sum
stays within the rest ``(1 − SPAN_MASS) · total``. Here no row is sorted. Non-negative float32
values order as their bit patterns do, so a histogram of the 11 bits after the sign (the exponent
and three mantissa bits: 2,048 bins, each bin's count and float64 mass, in :data:`LANES`
interleaved copies) finds the one bin where the smallest weights stop fitting in the rest: every
bin below it is left out whole (:func:`crossing`; the row loop of
:mod:`~probe.analysis.focus.backends.rowloop.rowfused` first tries the previous row's bin and its neighbours,
whose masses it sums as it reads the row). That bin's weights are then collected
(:func:`collect`, eight a step where the CPU can: :mod:`~.compress`; :func:`finish`) and
:func:`select` leaves out as many as fit, in ascending order, ties one by one, as the sort of
the whole row would: a quickselect on sums (the weights below a pivot summed in float64; where
they all fit they are left out and the search goes on above the pivot, else among them), the
last few sorted (``tests/test_span_select.py`` checks both
against a sort written in the test).

:func:`ln` is the natural log of a float32 from its bit pattern (the exponent's ``e · ln 2`` in
float64 plus ``2·atanh((m − 1)/(m + 1))`` of the mantissa ``m`` as a series in float32, within
1e-7 of the exact log, closer than a float32 log's rounding): plain arithmetic that LLVM
vectorises, where a call to the C library's ``logf`` would keep the row loop scalar.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from probe.analysis.focus.backends.rowloop import compress
from probe.analysis.focus.backends.rowloop.jit import intrinsic, ir, njit, numba, types
from probe.analysis.focus.backends.rowloop.workers import spread
from probe.analysis.focus.definitions.table import SPAN_MASS

SHIFT = 20  # first histogram: the bit patterns' top 11 bits (2048 bins; +inf is 0x7F8)
BINS = 1 << (31 - SHIFT)
LANES = 4  # interleaved copies of each histogram (independent chains of adds; see _hist)
FEW = 16  # select() sorts the last few weights (fewer than this) instead of partitioning
TINY_BITS = 0x00800000  # float32's smallest normal number: p·log max(p, tiny)
LN2 = math.log(2.0)
SQRT2_32 = np.float32(math.sqrt(2.0))
# the loops may reorder sums and fuse multiply-adds (vectorised reductions); no NaN/inf shortcuts
FAST = {"reassoc", "contract"}

if numba is not None:

    @intrinsic
    def f32(typingctx, b):  # pragma: no cover - compiled
        """The float32 whose bit pattern is the int32 ``b``."""
        sig = types.float32(types.int32)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())

        return sig, codegen

    @intrinsic
    def wide(typingctx):  # pragma: no cover - compiled
        """Marks the function that calls it for 512-bit vectors where the CPU has them (LLVM's
        ``prefer-vector-width`` attribute; elsewhere it changes nothing). LLVM vectorises for
        AVX-512 CPUs with 256-bit registers unless told otherwise, and numba has no option for
        it but the process-wide one, which a library should leave alone. The row loop's
        functions each call this first: one thread replaying a layer's parts at 4,096 keys took
        0.88 of its time with them marked."""
        sig = types.none()

        def codegen(context, builder, signature, args):
            attrs = builder.function.attributes  # (llvmlite's add() knows no string attributes)
            set.add(attrs, '"prefer-vector-width"="512"')
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def bits32(typingctx, v):  # pragma: no cover - compiled
        """The int32 bit pattern of the float32 ``v``."""
        sig = types.int32(types.float32)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return sig, codegen

    @njit(fastmath=FAST, inline="always", cache=True, error_model="numpy")
    def ln(b):  # pragma: no cover - compiled
        """``log`` of the positive normal float32 with bit pattern ``b`` (int32), in float64: the
        exponent's ``e · ln 2`` in float64, the mantissa's log in float32 (16 lanes a vector),
        within 1e-7 of the exact log (a float32 log rounds to within half an ulp of |log|)."""
        e = (b >> 23) - 127
        m = f32((b & 0x007FFFFF) | 0x3F800000)  # the mantissa, in [1, 2)
        if m > SQRT2_32:  # in [sqrt(1/2), sqrt(2)): the series converges fastest
            m = m * np.float32(0.5)
            e += 1
        s = (m - np.float32(1.0)) / (m + np.float32(1.0))  # |s| <= 0.1716: log m = 2·atanh(s)
        z = s * s
        p = np.float32(1.0 / 9.0)
        p = np.float32(1.0 / 7.0) + z * p
        p = np.float32(1.0 / 5.0) + z * p
        p = np.float32(1.0 / 3.0) + z * p
        return e * LN2 + np.float64(np.float32(2.0) * s * (np.float32(1.0) + z * p))

    @njit(cache=True, nogil=True, error_model="numpy")
    def scratch(n):  # pragma: no cover - compiled
        """What :func:`select_span` works in for rows of up to ``n`` keys: the first-level
        histogram ``[LANES, BINS]`` (zero; each selection leaves it zero) and ``n`` candidate
        slots."""
        return np.zeros((LANES, BINS), np.float64), np.zeros((LANES, BINS), np.int32), np.empty(n, np.float32)

    @njit(cache=True, nogil=True, error_model="numpy", _nrt=False)
    def _hist(x, bits, hmass, hcnt):  # pragma: no cover - compiled
        """Add the row ``x`` to the histogram of its first-level bins ``bits >> SHIFT``
        (``hmass``/``hcnt`` ``[LANES, BINS]``), in :data:`LANES` interleaved copies: a
        near-uniform row's consecutive weights fall in one bin, and with one copy each add waits
        for the previous one's store."""
        wide()
        m = x.shape[0]
        top = m - m % LANES
        for t in range(0, top, LANES):
            for u in range(LANES):  # unrolled by LLVM: LANES independent chains
                k = bits[t + u] >> SHIFT
                hmass[u, k] += x[t + u]
                hcnt[u, k] += 1
        for t in range(top, m):
            k = bits[t] >> SHIFT
            hmass[0, k] += x[t]
            hcnt[0, k] += 1

    @njit(cache=True, nogil=True, error_model="numpy", _nrt=False)
    def _walk(hmass, hcnt, kmin, kmax, rest):  # pragma: no cover - compiled
        """Leave out the bins from ``kmin`` up while their mass still fits in ``rest`` and clear
        ``kmin..kmax``; returns ``(bin, mass below it, count below it)``, ``bin`` the one that
        crosses (``kmax`` where every bin below it fit: the largest weight's bin crosses)."""
        wide()
        b, cum, left = kmin, 0.0, 0
        while b < kmax:
            mass, cnt = 0.0, 0
            for u in range(LANES):
                mass += hmass[u, b]
                cnt += hcnt[u, b]
            if cum + mass > rest:
                break
            cum += mass
            left += cnt
            b += 1
        hmass[:, kmin : kmax + 1] = 0.0
        hcnt[:, kmin : kmax + 1] = 0
        return b, cum, left

    @njit(fastmath=FAST, cache=True, nogil=True, error_model="numpy", _nrt=False)
    def _below(vals, lo, hi, p):  # pragma: no cover - compiled
        """The float64 mass and the count of ``vals[lo:hi]`` below ``p``, and the count equal."""
        wide()
        s, nl, ne = 0.0, 0, 0
        for t in range(lo, hi):
            v = vals[t]
            s += np.float64(v) if v < p else 0.0
            nl += v < p
            ne += v == p
        return s, nl, ne

    @njit(cache=True, nogil=True, error_model="numpy", _nrt=False)
    def _keep_scalar(vals, lo, hi, p, smaller):  # pragma: no cover - compiled
        """Compact ``vals[lo:hi]`` to those below ``p`` (``smaller``) or above it, in place from
        ``lo``, without a branch; returns the new end."""
        wide()
        k = lo
        for t in range(lo, hi):
            v = vals[t]
            vals[k] = v
            k += (v < p) if smaller else (v > p)
        return k

    @njit(cache=True, nogil=True, error_model="numpy", _nrt=False)
    def _keep_packed(vals, lo, hi, p, smaller):  # pragma: no cover - compiled
        """:func:`_keep_scalar` eight a step (:func:`~.compress.pack8`; the values are
        non-negative, so below ``p`` is a bit pattern below its, and above ``p`` one above):
        each step reads its eight before it writes at most that far."""
        wide()
        bp = np.uint32(bits32(np.float32(p)))
        b0, width = (np.uint32(0), bp) if smaller else (bp + np.uint32(1), np.uint32(0x7FFFFFFF) - bp)
        k = lo
        top = hi - (hi - lo) % 8
        for t in range(lo, top, 8):
            k = compress.pack8(vals, k, vals, t, b0, width)
        for t in range(top, hi):
            v = vals[t]
            vals[k] = v
            k += (v < p) if smaller else (v > p)
        return k

    _keep = _keep_packed if compress.AVAILABLE else _keep_scalar

    @njit(cache=True, nogil=True, error_model="numpy", _nrt=False)
    def heapsort(vals, lo, hi):  # pragma: no cover - compiled
        """``vals[lo:hi]`` sorted ascending in place (no copy: the row loop runs without numba's
        runtime, which ``np.sort`` needs); at most ``2·m·log2(m)`` comparisons for ``m`` values."""
        wide()
        m = hi - lo
        for start in range(m // 2 - 1, -1, -1):
            _sift(vals, lo, start, m)
        for end in range(m - 1, 0, -1):
            vals[lo], vals[lo + end] = vals[lo + end], vals[lo]
            _sift(vals, lo, 0, end)

    @njit(inline="always", cache=True, error_model="numpy")
    def _sift(vals, lo, root, m):  # pragma: no cover - compiled
        """The heap ``vals[lo:lo + m]`` mended below ``root`` (the largest value at its top)."""
        while 2 * root + 1 < m:
            child = 2 * root + 1
            if child + 1 < m and vals[lo + child] < vals[lo + child + 1]:
                child += 1
            if not vals[lo + root] < vals[lo + child]:
                return
            vals[lo + root], vals[lo + child] = vals[lo + child], vals[lo + root]
            root = child

    @njit(cache=True, nogil=True, error_model="numpy", _nrt=False)
    def select(vals, m, cum, left, rest):  # pragma: no cover - compiled
        """Leave out the smallest of ``vals[:m]`` (non-negative float32; reordered) in ascending
        order, ties one by one, while the running sum from ``cum`` stays within ``rest``, as a
        sort of them would: ``(left + how many, the bit pattern of the first that does not fit
        or −1)``. A quickselect on the sums: the weights below a pivot (the median of three) are
        summed; where they do not all fit the search goes on among them, else they are left
        out, the pivot's ties one by one, and it goes on above; the last :data:`FEW` are sorted in
        place by insertion (``np.sort``'s copy took longer than the rest of a selection of 40); a
        selection out of rounds is sorted first (:func:`heapsort`)."""
        wide()
        lo, hi, rounds = 0, m, 0
        while hi - lo > FEW and rounds < 64:  # 64 rounds: a sort settles any pathological order
            rounds += 1
            a, b, c = vals[lo], vals[(lo + hi) // 2], vals[hi - 1]
            p = max(min(a, b), min(max(a, b), c))
            s, nl, ne = _below(vals, lo, hi, p)
            if cum + s > rest:
                hi = _keep(vals, lo, hi, p, True)
                continue
            cum += s
            left += nl
            for _ in range(ne):
                if cum + np.float64(p) > rest:
                    return left, bits32(p)
                cum += np.float64(p)
                left += 1
            hi = _keep(vals, lo, hi, p, False)
        if hi - lo > FEW:  # out of rounds (a pathological order): sorted, the insertion then a pass
            heapsort(vals, lo, hi)
        for t in range(lo + 1, hi):  # the last few in place, by insertion
            v, k = vals[t], t
            while k > lo and vals[k - 1] > v:
                vals[k] = vals[k - 1]
                k -= 1
            vals[k] = v
        for t in range(lo, hi):
            v = vals[t]
            if cum + np.float64(v) > rest:
                return left, bits32(v)
            cum += np.float64(v)
            left += 1
        return left, np.int32(-1)

    @njit(cache=True, nogil=True, error_model="numpy", _nrt=False)
    def collect_scalar(x, bits, k0, k1, cand):  # pragma: no cover - compiled
        """The weights of ``x`` in first-level bins ``k0 <= k < k1``, compacted into ``cand``
        without a branch, in the row's order; returns how many (:func:`collect` where the
        CPU has no AVX-512VL). The two halves of the row are compacted side by side, the second
        from ``cand``'s middle, then moved down: two independent chains (a fifth faster than one
        in a scratch timing)."""
        wide()
        lo, width = np.uint32(k0 << SHIFT), np.uint32((k1 - k0) << SHIFT)
        n = x.shape[0]
        h = n // 2
        a, b = 0, h
        for j in range(h):
            cand[a] = x[j]
            a += np.uint32(bits[j]) - lo < width  # k0 <= k < k1 in one unsigned compare
            cand[b] = x[h + j]
            b += np.uint32(bits[h + j]) - lo < width
        for t in range(h, b):
            cand[a] = cand[t]
            a += 1
        for j in range(2 * h, n):
            cand[a] = x[j]
            a += np.uint32(bits[j]) - lo < width
        return a

    @njit(cache=True, nogil=True, error_model="numpy", _nrt=False)
    def collect_packed(x, bits, k0, k1, cand):  # pragma: no cover - compiled
        """:func:`collect_scalar`'s weights, in the row's order, eight a step with the CPU's
        compress instruction (:func:`~.compress.pack8`: AVX-512VL only), the last few one by one:
        about a quarter of the time on a row in cache."""
        wide()
        lo, width = np.uint32(k0 << SHIFT), np.uint32((k1 - k0) << SHIFT)
        n = x.shape[0]
        top = n - n % 8
        a = 0
        for j in range(0, top, 8):
            a = compress.pack8(cand, a, x, j, lo, width)
        for j in range(top, n):
            cand[a] = x[j]
            a += np.uint32(bits[j]) - lo < width
        return a

    # the weights of x in first-level bins k0 <= k < k1, compacted into cand; returns how many
    collect = collect_packed if compress.AVAILABLE else collect_scalar

    @njit(cache=True, nogil=True, error_model="numpy")
    def select_span(x, bits, total, kmin, kmax, hmass, hcnt, cand):  # pragma: no cover - compiled
        """The effective span of the row ``x`` (float32, no negative weight; ``bits`` its int32
        view; ``total`` its float64 sum; ``kmin``/``kmax`` the first-level bins of its smallest and
        largest weight). ``hmass``/``hcnt`` are zero on entry and left zero; ``cand`` has ``len(x)``
        float32 slots."""
        if not total > 0.0:
            return 0
        b, cum, left = crossing(x, bits, total, kmin, kmax, hmass, hcnt)
        return finish(x, bits, total, b, cum, left, cand)

    @njit(cache=True, nogil=True, error_model="numpy", _nrt=False)
    def crossing(x, bits, total, kmin, kmax, hmass, hcnt):  # pragma: no cover - compiled
        """The first-level bin where the smallest weights stop fitting in the rest, by the
        histogram: ``(bin, mass below it, count below it)`` (``total`` > 0)."""
        wide()
        _hist(x, bits, hmass, hcnt)
        return _walk(hmass, hcnt, kmin, kmax, (1.0 - SPAN_MASS) * total)

    @njit(cache=True, nogil=True, error_model="numpy", _nrt=False)
    def finish(x, bits, total, b, cum, left, cand):  # pragma: no cover - compiled
        """The span, given the first-level bin ``b`` that crosses the rest, the mass ``cum`` and
        the count ``left`` of the weights in the bins below it: that bin's weights are collected
        and :func:`select` leaves out as many as fit."""
        wide()
        m = collect(x, bits, b, b + 1, cand)
        left, _ = select(cand, m, cum, left, (1.0 - SPAN_MASS) * total)
        return x.shape[0] - left

    @njit(fastmath=FAST, cache=True, nogil=True, error_model="numpy")
    def _span_rows(x, r0, r1, out):  # pragma: no cover - compiled
        n = x.shape[1]
        hmass, hcnt, cand = scratch(n)
        for row in range(r0, r1):
            v = x[row]
            bits = v.view(np.int32)
            total, lo, hi = 0.0, np.int32(0x7FFFFFFF), np.int32(0)
            for j in range(n):
                total += np.float64(v[j])
                lo = min(lo, bits[j])
                hi = max(hi, bits[j])
            out[row] = select_span(v, bits, total, lo >> SHIFT, hi >> SHIFT, hmass, hcnt, cand)


def spans(P: torch.Tensor) -> torch.Tensor:
    """The effective span of every row of ``P`` ``[..., n]`` (float32), ``[...]``: the selection
    where numba is installed and no weight is negative, else a sort with float64 running sums
    (the same rule)."""
    n = P.shape[-1]
    lead = P.shape[:-1]
    if P.numel() == 0:
        return torch.zeros(lead)
    if numba is not None and not bool(torch.signbit(P).any()):  # -0.0 too: it would bin apart
        x = P.reshape(-1, n).float().contiguous().numpy()
        out = np.zeros(x.shape[0], np.int64)
        spread(lambda a, b: _span_rows(x, a, b, out), x.shape[0])
        return torch.from_numpy(out).float().reshape(lead)
    vals = P.double().sort(-1).values
    c = vals.cumsum(-1)
    left = (c <= (1 - SPAN_MASS) * c[..., -1:]).sum(-1)
    return (n - left).float()


__all__ = [
    "spans",
    "select_span",
    "crossing",
    "finish",
    "ln",
    "f32",
    "SHIFT",
    "BINS",
]
