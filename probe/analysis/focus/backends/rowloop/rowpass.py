"""One read of a row of weights for its sums (numba): the first loop of the CPU row loop.

:mod:`~probe.analysis.focus.backends.rowloop.rowfused` calls :func:`read_row` on each row while it sits in the
core's cache. It makes two short passes over the row, both vectorised by LLVM:

1. **exact sums** (float64, the order of the additions free): each chunk of :data:`CH` keys' sum
   (kept as running sums for ``beyond_<D>``, ``reach90``, the word masses and the total), the
   masses and counts of the weights below three consecutive first-level bins (where the
   effective span's search starts, see :mod:`~.spanselect`), and the column
   sums ``acc += w · row``;
2. **the other sums, eight weights a step** (float32 inside a chunk, each chunk's sum added in
   float64): ``Σ a·ln a`` (:func:`ln32`), the masses on the three key classes and the distances,
   with each chunk's largest and smallest bit pattern (the argmax and the causal audit). A chunk
   wholly before the query adds ``Σ (i − j)·a`` as ``(i − e)·S + Σ (e − j)·a`` and one wholly
   after it ``Σ (j − i)·a`` as ``(s − i)·S + Σ (j − s)·a`` (``s``/``e`` the chunk's first/last key,
   ``S`` its exact sum): both parts are non-negative, so float32 rounding stays relative to the
   distance (a previous-token head's distance of 1 stays 1 to float32 precision). The chunk that
   holds the query, and a last partial chunk, are summed in float64, the keys up to the query
   and those after it each in a loop of their own (:func:`_part`; one loop testing each key's
   side was left scalar); where the row holds weights (the entropy from a log of each), weight
   by weight.

Where the row holds a softmax's scores (:func:`softmax_row`, the CPU blocks probe recomputes),
the loop first takes its max, then ``e^(x − max)`` (:func:`exp32`, vectorised) with ``Z = Σ e``
and ``Σ e·(x − max)``; pass 1 scales the row by ``1/Z`` as it reads it, and pass 2 skips the log:
``Σ a·ln a = Σ e·(x − max)/Z − ln Z · Σ a``.

A row's last part, shorter than a chunk, is read weight by weight where a loop of its own count
is left scalar by LLVM; from :data:`PAD_MIN` keys on, the softmax's exponentials and pass 1 read
it as a whole chunk copied into scratch and padded (scores ``-inf``, weights 0), several times
faster a weight (a row read to its query ends in one such part, of 128 keys on average).

Float32 partial sums of at most 256 weights in eight lanes round within about 1e-7 of the sum;
the masses that decide a count (the total and the mass below the span's bin) are the float64 sums
of pass 1, so the span stays the sort's.
"""

from __future__ import annotations

import math

import numpy as np

from probe.analysis.focus.backends.rowloop import spanselect as ss
from probe.analysis.focus.backends.rowloop.jit import njit, numba

if numba is not None:
    from probe.analysis.focus.backends.rowloop.spanselect import f32

CH = 256  # keys per chunk: its sum and largest weight are kept for the running sums and argmax
PAD_MIN = 32  # a row's last part, shorter than a chunk, is read as a whole padded chunk from this long
SUMS = (
    "ent", "special", "punct", "content", "before", "after_d", "below0", "n0", "below1", "n1", "below2", "n2",
)  # fmt: skip
_UP = np.arange(CH, dtype=np.float32)  # j − s over a chunk
_DOWN = _UP[::-1].copy()  # e − j
_F, _I = np.float32, np.int32
LN2_32 = np.float32(math.log(2.0))
LOG2E = np.float32(1.0 / math.log(2.0))
LN2_HI, LN2_LO = np.float32(0.693145751953125), np.float32(1.4286068203094173e-06)  # ln 2 in two parts
EXP_ZERO = np.float32(-104.0)  # exp32 is 0 below (float32's exp is 0 there too, from -103.97)

if numba is not None:

    @njit(fastmath=ss.FAST, inline="always", cache=True, error_model="numpy")
    def ln32(b):  # pragma: no cover - compiled
        """``log`` of the positive normal float32 with bit pattern ``b`` (int32), all in float32
        (eight lanes a vector): the exponent's ``e · ln 2`` plus the mantissa's
        ``2·atanh((m − 1)/(m + 1))`` as :func:`~.spanselect.ln`, within about a float32 rounding
        of the exact log (1.2e-7 of it)."""
        e = (b >> 23) - _I(127)
        m = f32((b & _I(0x007FFFFF)) | _I(0x3F800000))  # the mantissa, in [1, 2)
        big = m > ss.SQRT2_32
        m = m * _F(0.5) if big else m
        ef = _F(e) + (_F(1.0) if big else _F(0.0))
        s = (m - _F(1.0)) / (m + _F(1.0))
        z = s * s
        p = _F(1.0 / 9.0)
        p = _F(1.0 / 7.0) + z * p
        p = _F(1.0 / 5.0) + z * p
        p = _F(1.0 / 3.0) + z * p
        return ef * LN2_32 + _F(2.0) * s * (_F(1.0) + z * p)

    @njit(fastmath=ss.FAST, inline="always", cache=True, error_model="numpy")
    def exp32(t):  # pragma: no cover - compiled
        """``exp(t)`` of a float32 ``t <= 0`` in float32 (eight lanes a vector): ``2^n · e^r``
        with ``|r| <= ln 2 / 2`` (``e^r`` a degree-7 series, within about 2 roundings of the exact
        value; scaled by ``2^(n + 64)``, then by ``2^-64``: exact where the result is a normal
        number, and below float32's smallest one a subnormal as ``exp`` gives it, with no test);
        0 below :data:`EXP_ZERO` and for ``-inf`` or NaN."""
        u = max(t, EXP_ZERO)  # (NaN and -inf are selected out at the end)
        n = np.floor(u * LOG2E + _F(0.5))
        r = u - n * LN2_HI - n * LN2_LO
        p = _F(1.0 / 5040.0)
        p = _F(1.0 / 720.0) + r * p
        p = _F(1.0 / 120.0) + r * p
        p = _F(1.0 / 24.0) + r * p
        p = _F(1.0 / 6.0) + r * p
        p = _F(0.5) + r * p
        p = _F(1.0) + r * p
        p = _F(1.0) + r * p
        v = (p * f32((_I(n) + _I(127 + 64)) << 23)) * _F(2.0**-64)  # 2^(n + 64), then 2^-64: exact
        return v if t >= EXP_ZERO else _F(0.0)

    @njit(fastmath=ss.FAST, cache=True, nogil=True, error_model="numpy", _nrt=False)
    def softmax_row(x, keep, soft, pad):  # pragma: no cover - compiled
        """The softmax of the scores ``x`` (float32, ``-inf`` where a key is hidden), left as
        ``keep · e^(x − max)`` in ``x`` (``keep``: 1 on each key, 0 where its weight is dropped
        afterwards, a padding key), and ``soft`` = (1, ``1/Z``, ``Σ keep·e·(x − max)``, ``ln Z``)
        for :func:`read_row`, which scales the row by ``1/Z`` as it reads it (``Z = Σ e``). Then
        ``Σ a·ln a = Σ keep·e·(x − max)/Z − ln Z · Σ a``: the entropy needs no log of a weight. A
        row with no visible key is all zeros, as the caller of a softmax makes it; one with a NaN
        score all NaN, as torch's softmax makes it. ``pad`` ``[3, CH]`` float32: scratch for the
        row's last part (:func:`_exps_padded`)."""
        ss.wide()
        n = x.shape[0]
        m = f32(_order(_rowmax(x.view(np.int32))))
        soft[0], soft[1], soft[2], soft[3] = 1.0, 0.0, 0.0, 0.0
        if m == _F(-np.inf):  # every key hidden: all zeros, as the caller of a softmax makes it
            for j in range(n):  # (unless a score is NaN, which a NaN below -inf's order hides)
                if x[j] != x[j]:
                    x[:] = np.nan
                    soft[1], soft[2], soft[3] = np.nan, np.nan, np.nan
                    return
            x[:] = _F(0.0)
            return
        Z, ET, T = 0.0, 0.0, 0.0
        for c in range(n // CH):  # float32 sums of a chunk, added up in float64
            z, et, tt = _exps(x, m, keep, c * CH, c * CH + CH)
            Z, ET, T = Z + z, ET + et, T + tt
        j0 = n // CH * CH  # (a bound min(n, ...) above: LLVM left it scalar)
        if n - j0 >= PAD_MIN:
            z, et, tt = _exps_padded(x, m, keep, j0, pad)
        else:
            z, et, tt = _exps(x, m, keep, j0, n)
        Z, ET, T = Z + z, ET + et, T + tt
        if T != T:  # a NaN score (or +inf: inf − inf): every weight NaN, as torch's softmax gives
            x[:] = np.nan
            soft[1], soft[2], soft[3] = np.nan, np.nan, np.nan
            return
        soft[1], soft[2], soft[3] = 1.0 / Z, ET, math.log(Z)

    @njit(fastmath=ss.FAST, inline="always", cache=True, error_model="numpy")
    def _order(b):  # pragma: no cover - compiled
        """The float32 with bit pattern ``b`` as an int32 that orders as the floats do (negative
        ones' magnitude bits flipped; its own inverse): a max of these is vectorised, where
        float32's ``max`` (which must keep a NaN) left the loop scalar, three times slower."""
        return b ^ ((b >> 31) & _I(0x7FFFFFFF))

    @njit(fastmath=ss.FAST, inline="always", cache=True, error_model="numpy")
    def _rowmax(bits):  # pragma: no cover - compiled
        """The largest :func:`_order` of the bit patterns ``bits``: a NaN with the sign bit
        clear is above +inf, one with it set below -inf (the exp pass finds either)."""
        m = _I(-(2**31))
        for j in range(bits.shape[0]):
            m = max(m, _order(bits[j]))
        return m

    @njit(fastmath=ss.FAST, inline="always", cache=True, error_model="numpy")
    def _exps(x, m, keep, j0, j1):  # pragma: no cover - compiled
        """``x[j] = keep[j] · e^(x[j] − m)`` for ``j0 <= j < j1``; returns ``(Σ e, Σ keep·e·(x −
        m), Σ (x − m))`` in float32 (the last ``-inf`` where a key is hidden, NaN only where a
        score is NaN or ``m`` is ``+inf``: a check that costs one add, where a test of each score
        in the max's loop kept it scalar)."""
        z, et, tt = _F(0), _F(0), _F(0)
        for j in range(j0, j1):
            t = x[j] - m
            e = exp32(t)
            z += e
            tt += t
            k = e * keep[j]
            et += k * max(t, EXP_ZERO)  # finite: k is 0 where t is below EXP_ZERO
            x[j] = k
        return z, et, tt

    @njit(inline="always", cache=True, error_model="numpy")
    def _put(dst, src, s, L, fill):  # pragma: no cover - compiled
        """``dst`` (a chunk) = ``fill``, then ``dst[:L] = src[s:s + L]``: plain loops, one array
        each (a slice assignment took four times as long)."""
        for t in range(CH):
            dst[t] = fill
        for t in range(L):
            dst[t] = src[s + t]

    @njit(fastmath=ss.FAST, cache=True, nogil=True, error_model="numpy", _nrt=False)
    def _exps_padded(x, m, keep, j0, pad):  # pragma: no cover - compiled
        """:func:`_exps` over the row's last part ``x[j0:]`` (shorter than a chunk), copied into
        ``pad`` and padded to a whole chunk with scores ``-inf`` on keys ``keep`` drops (each adds
        0 to ``Σ e`` and ``Σ keep·e·(x − m)``, ``-inf`` to ``Σ (x − m)``, which only a NaN or
        ``+inf`` score turns NaN): LLVM vectorises a loop of a chunk's fixed count and left the
        part's own scalar (several times slower a weight)."""
        ss.wide()
        L = x.shape[0] - j0
        px, pk = pad[0], pad[1]
        _put(px, x, j0, L, _F(-np.inf))
        _put(pk, keep, j0, L, _F(0.0))
        got = _exps(px, m, pk, 0, CH)
        for t in range(L):
            x[j0 + t] = px[t]
        return got

    @njit(fastmath=ss.FAST, inline="always", cache=True, error_model="numpy")
    def _chunk(x, bits, base, c0, c1, c2, wt, part, logs):  # pragma: no cover - compiled
        """Pass 2 over the full chunk at ``base`` (``wt``: the distance weights ``j − s`` or
        ``e − j``): ``part`` = (Σ a·ln a if ``logs`` (a literal at each call), the three class
        masses, Σ wt·a), float32; returns the chunk's largest and smallest bit pattern."""
        L, A0, A1, A2, D = _F(0), _F(0), _F(0), _F(0), _F(0)
        mx, lo = _I(-1), _I(0x7FFFFFFF)
        for t in range(CH):  # a fixed trip count: LLVM keeps each sum in a vector register
            b = bits[base + t]
            v = x[base + t]
            if logs:
                L += v * ln32(max(b, _I(ss.TINY_BITS)))  # p · log max(p, tiny)
            A0 += v * c0[base + t]
            A1 += v * c1[base + t]
            A2 += v * c2[base + t]
            D += v * wt[t]
            mx = max(mx, b)
            lo = min(lo, b)
        part[0], part[1], part[2], part[3], part[4] = L, A0, A1, A2, D
        return mx, lo

    @njit(fastmath=ss.FAST, inline="always", cache=True, error_model="numpy")
    def _part(x, bits, s, e, i, c0, c1, c2):  # pragma: no cover - compiled
        """Pass 2 over keys ``s..e``, all on one side of the query ``i``, in float64: the three
        class masses, ``Σ |i − j|·a``, the largest and smallest bit pattern (a loop LLVM
        vectorises, where one that tests each key's side was left scalar)."""
        m0, m1, m2, bf = 0.0, 0.0, 0.0, 0.0
        mx, lo = _I(-1), _I(0x7FFFFFFF)
        for j in range(s, e + 1):
            b = bits[j]
            v = np.float64(x[j])
            m0, m1, m2 = m0 + v * c0[j], m1 + v * c1[j], m2 + v * c2[j]
            bf += abs(i - j) * v
            mx, lo = max(mx, b), min(lo, b)
        return m0, m1, m2, bf, mx, lo

    @njit(cache=True, error_model="numpy")
    def _edge(k):  # pragma: no cover - compiled
        """The smallest float32 value of first-level bin ``k`` (+inf past the last finite one),
        as a float64: ``v < _edge(k)`` is ``bits(v) >> SHIFT < k`` for non-negative ``v``."""
        return np.float64(f32(np.int32(min(k << ss.SHIFT, 0x7F800000))))

    @njit(fastmath=ss.FAST, inline="always", cache=True, error_model="numpy")
    def _sums(x, j0, j1, e0, e1, e2, scale, scaled):  # pragma: no cover - compiled
        """Pass 1 over keys ``j0:j1`` (first scaled by ``scale`` in place where ``scaled``, a
        literal at each call): their sum, then the mass and count below each edge, in float64."""
        S, s0, n0, s1, n1, s2, n2 = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
        for j in range(j0, j1):
            if scaled:
                x[j] = x[j] * scale
            v = np.float64(x[j])
            S += v
            s0 += v if v < e0 else 0.0
            n0 += 1.0 if v < e0 else 0.0
            s1 += v if v < e1 else 0.0
            n1 += 1.0 if v < e1 else 0.0
            s2 += v if v < e2 else 0.0
            n2 += 1.0 if v < e2 else 0.0
        return S, s0, n0, s1, n1, s2, n2

    @njit(fastmath=ss.FAST, cache=True, nogil=True, error_model="numpy", _nrt=False)
    def _sums_padded(x, j0, e0, e1, e2, scale, scaled, pad):  # pragma: no cover - compiled
        """:func:`_sums` over the row's last part ``x[j0:]`` (shorter than a chunk), copied into
        ``pad`` and padded to a whole chunk with zeros (see :func:`_exps_padded`): they add 0 to
        the masses, and the counts below an edge leave them out again."""
        ss.wide()
        L = x.shape[0] - j0
        px = pad[0]
        _put(px, x, j0, L, _F(0.0))
        if scaled:
            S, s0, n0, s1, n1, s2, n2 = _sums(px, 0, CH, e0, e1, e2, scale, True)
            for t in range(L):
                x[j0 + t] = px[t]
        else:
            S, s0, n0, s1, n1, s2, n2 = _sums(px, 0, CH, e0, e1, e2, scale, False)
        z, v = np.float64(CH - L), np.float64(px[CH - 1])  # a padded zero as scaled (NaN where scale is)
        n0, n1, n2 = n0 - (z if v < e0 else 0.0), n1 - (z if v < e1 else 0.0), n2 - (z if v < e2 else 0.0)
        return S, s0, n0, s1, n1, s2, n2

    @njit(fastmath=ss.FAST, cache=True, nogil=True, error_model="numpy", _nrt=False)
    def _exact(x, glo, w, acc, PS, sums, inv, pad):  # pragma: no cover - compiled
        """Pass 1: the chunk sums' running total ``PS``; the mass and count of the weights in the
        first-level bins below ``glo``, ``glo + 1`` and ``glo + 2`` into ``sums[6:12]``; and
        ``acc += w · x``; in float64. ``inv`` (not 1): each chunk is first scaled by it, in place
        (a softmax's ``1/Z``, :func:`softmax_row`). Whole chunks, then the last part: a chunk
        loop bounded by ``min(n, …)`` is left scalar by LLVM (about 1.5× slower here), and a last
        part of :data:`PAD_MIN` keys or more is read as a padded chunk (:func:`_sums_padded`)."""
        ss.wide()
        n = x.shape[0]
        e0, e1, e2 = _edge(glo), _edge(glo + 1), _edge(glo + 2)
        PS[0] = 0.0
        sums[6:12] = 0.0
        scale = _F(inv)
        for c in range((n + CH - 1) // CH):
            j0, j1 = c * CH, min(n, c * CH + CH)
            if j1 - j0 < CH and j1 - j0 >= PAD_MIN:  # the last part, as a padded chunk
                got = _sums_padded(x, j0, e0, e1, e2, scale, inv != 1.0, pad)
            elif j1 - j0 < CH:
                got = _sums(x, j0, j1, e0, e1, e2, scale, inv != 1.0)
            elif inv != 1.0:
                got = _sums(x, j0, j0 + CH, e0, e1, e2, scale, True)
            else:
                got = _sums(x, j0, j0 + CH, e0, e1, e2, scale, False)
            PS[c + 1] = PS[c] + got[0]
            for t in range(6):
                sums[6 + t] += got[1 + t]
        if w != 0.0:
            for j in range(n):
                acc[j] += w * np.float64(x[j])

    @njit(fastmath=ss.FAST, cache=True, nogil=True, error_model="numpy", _nrt=False)
    def read_row(x, i, cols, glo, w, acc, PS, M, sums, soft, pad):  # pragma: no cover - compiled
        """Every sum of row ``x`` (float32, query ``i``): ``PS``/``M`` each chunk's running sum and
        largest bit pattern, ``acc += w · x``, ``sums`` as :data:`SUMS` (float64;
        ``before``/``after_d``: ``Σ (i − j)·a`` over keys before the query and ``Σ (j − i)·a``
        after it; ``below<k>``/``n<k>``: the mass and count in the first-level bins below
        ``glo + k``, k = 0, 1, 2). ``soft[0]`` 1: ``x`` is :func:`softmax_row`'s (scaled here,
        ``Σ a·ln a`` from ``soft``); 0: weights (``Σ a·ln a`` from a log of each). ``pad``
        ``[3, CH]`` float32: scratch for the last part of pass 1 (:func:`_sums_padded`) and, in
        ``pad[2]``, pass 2's sums of a chunk (:func:`_chunk`). Returns
        the largest bit pattern, the smallest, the smallest at or before the query and the largest
        after it."""
        ss.wide()
        n = x.shape[0]
        bits = x.view(np.int32)
        logs = soft[0] == 0.0
        _exact(x, glo, w, acc, PS, sums, 1.0 if logs else soft[1], pad)
        c0, c1, c2 = cols[0], cols[1], cols[2]
        ent, m0, m1, m2, before, later = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
        top, low, low_seen, after = _I(-1), _I(0x7FFFFFFF), _I(0x7FFFFFFF), _I(0)
        part = pad[2]  # pass 2's five float32 sums of a chunk (see _chunk)
        for c in range((n + CH - 1) // CH):
            s, e = c * CH, min(n, c * CH + CH) - 1
            S = PS[c + 1] - PS[c]
            if e - s + 1 == CH and (e <= i or s > i):
                wt = _DOWN if e <= i else _UP
                if logs:
                    mx, lo = _chunk(x, bits, s, c0, c1, c2, wt, part, True)
                else:
                    mx, lo = _chunk(x, bits, s, c0, c1, c2, wt, part, False)
                ent += part[0]
                m0, m1, m2 = m0 + part[1], m1 + part[2], m2 + part[3]
                if e <= i:
                    before += (i - e) * S + part[4]
                    low_seen = min(low_seen, lo)
                else:
                    later += (s - i) * S + part[4]
                    after = max(after, mx)
            elif not logs:  # the query's chunk, or a partial one: its keys up to the query, then after
                mx, lo = _I(-1), _I(0x7FFFFFFF)
                if s <= i:
                    p0, p1, p2, d, mx, lo = _part(x, bits, s, min(e, i), i, c0, c1, c2)
                    m0, m1, m2, before = m0 + p0, m1 + p1, m2 + p2, before + d
                    low_seen = min(low_seen, lo)
                if e > i:
                    p0, p1, p2, d, hi, lw = _part(x, bits, max(s, i + 1), e, i, c0, c1, c2)
                    m0, m1, m2, later = m0 + p0, m1 + p1, m2 + p2, later + d
                    after = max(after, hi)
                    mx, lo = max(mx, hi), min(lo, lw)
            else:  # the query's chunk, or a partial one: weight by weight, in float64
                mx, lo = _I(-1), _I(0x7FFFFFFF)
                for j in range(s, e + 1):
                    b = bits[j]
                    v = np.float64(x[j])
                    if logs:
                        ent += v * ss.ln(max(b, _I(ss.TINY_BITS)))
                    m0, m1, m2 = m0 + v * c0[j], m1 + v * c1[j], m2 + v * c2[j]
                    if j <= i:
                        before += (i - j) * v
                        low_seen = min(low_seen, b)
                    else:
                        later += (j - i) * v
                        after = max(after, b)
                    mx, lo = max(mx, b), min(lo, b)
            M[c] = mx
            top, low = max(top, mx), min(low, lo)
        if not logs:  # Σ a·ln a of a softmax from its scores (see softmax_row)
            ent = soft[2] * soft[1] - soft[3] * PS[(n + CH - 1) // CH]
        sums[0], sums[1], sums[2], sums[3], sums[4], sums[5] = ent, m0, m1, m2, before, later
        return top, low, low_seen, after


__all__ = ["read_row", "softmax_row", "exp32", "ln32", "CH", "SUMS"]
