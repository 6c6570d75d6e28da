"""The CPU row loop without a sort (probe/analysis/focus/backends/rowloop/rowfused.py): the effective
span by a histogram of the weights' bit patterns and an exact walk of the one bin that crosses the
threshold, and every other per-row term from one read of the row.

Oracles written here: a full sort with float64 running sums (the span), loops and plain torch
sums over the block (the other terms).
"""

from __future__ import annotations

import struct

import pytest
import torch

pytest.importorskip("numba")

from probe.analysis.focus.backends.rowloop import rowfused  # noqa: E402


def _sorted_span(P):
    """The fewest keys covering 90% of each row's mass, by a sort: ascending values, float64 running
    sums, the most smallest weights whose sum stays within the 10% rest are left out. Also whether
    a running sum lies within float64 rounding of the rest (where any summation order may decide
    either way: an exact tie of the threshold with a partial sum)."""
    vals = P.double().sort(-1).values
    c = vals.cumsum(-1)
    rest = 0.1 * c[..., -1:]
    span = P.shape[-1] - (c <= rest).sum(-1)
    ambiguous = ((c - rest).abs() <= 1e-12 * c[..., -1:]).any(-1) & (c[..., -1] > 0)
    return span, ambiguous


def _rows(K, seed):
    g = torch.Generator().manual_seed(seed)
    P = torch.softmax(torch.randn(3, 40, K, generator=g) * torch.linspace(0.1, 8, 40)[:, None], -1)
    P[0, 0] = 1.0 / K  # one value K times
    P[0, 1] = 0.0  # an all-masked row
    P[0, 2, : min(K, 3)] = 1.0 / min(K, 3)  # a few equal weights, zeros elsewhere
    P[0, 2, 3:] = 0
    P[1, :8] = torch.randint(0, 4, (8, K), generator=g).float() / 11  # many ties, not normalised
    P[2, :5, : K // 2] = 0  # rows with many zeros
    return P


@pytest.mark.parametrize("K", [1, 2, 3, 7, 64, 300, 4096, 20000])
def test_span_equals_the_sort(K):
    P = _rows(K, K)
    want, amb = _sorted_span(P)
    got = rowfused.spans(P)
    assert got.dtype == torch.float32 and got.shape == want.shape
    ok = got.long() == want
    assert bool((ok | amb).all()), (got[~ok], want[~ok])
    assert int(amb.sum()) <= 6  # the test still checks nearly every row exactly
    assert float(got[0, 1]) == 0  # a masked row spans nothing
    assert float(got[0, 2]) == min(K, 3) if K > 1 else True


def test_span_of_ties_crossing_the_threshold():
    """Equal weights straddling the threshold count one by one: 10 keys of 0.05, 10 of 0.011 and
    20 zeros; the rest (0.061) holds the zeros and five of the 0.011 (0.055), not a sixth (0.066):
    the span is 40 − 25 = 15 keys."""
    row = torch.zeros(1, 40)
    row[0, :10] = 0.05
    row[0, 10:20] = 0.011
    want, amb = _sorted_span(row)
    assert int(want) == 15 and not bool(amb.any())
    assert int(rowfused.spans(row)) == 15
    assert int(rowfused.spans(row[:, torch.randperm(40)])) == 15  # the order of keys does not matter


def _loop_terms(P, q0, K, cols, first):
    """Per-row terms by loops over one row at a time (float64), as metrics.py defines them."""
    B, h, r, n = P.shape
    out = {k: torch.zeros(B, h, r, dtype=torch.float64) for k in ("total", "ent", "signed", "dist", "reach")}
    out.update({f"beyond_{D}": torch.zeros(B, h, r, dtype=torch.float64) for D in (16, 128, 1024)})
    for b in range(B):
        for hh in range(h):
            for a in range(r):
                x = P[b, hh, a].double()
                i = q0 + a
                j = torch.arange(n, dtype=torch.float64)
                t = float(x.sum())
                out["total"][b, hh, a] = t
                out["ent"][b, hh, a] = -float((x * x.clamp_min(torch.finfo(torch.float32).tiny).log()).sum())
                out["signed"][b, hh, a] = float(((j - i) * x).sum())
                out["dist"][b, hh, a] = float(((j - i).abs() * x).sum())
                for D in (16, 128, 1024):
                    out[f"beyond_{D}"][b, hh, a] = float(x[(j - i).abs() > D].sum()) if D < K else 0.0
                d = 0
                while float(x[(j - i).abs() <= d].sum()) < 0.9 * t - 1e-12 and d < K - 1:
                    d += 1
                out["reach"][b, hh, a] = d
    return out


def test_row_terms_against_loops():
    g = torch.Generator().manual_seed(3)
    B, h, r, q0, n = 2, 2, 6, 140, 146
    P = torch.softmax(torch.randn(B, h, r, n, generator=g) * 3, -1)
    P = P.masked_fill(torch.arange(n)[None, :] > torch.arange(q0, q0 + r)[:, None], 0)  # causal rows
    P[1, 0, 2, 5:] = 0
    P[1, 0, 2, :5] = 0.2  # ties
    cols = (torch.rand(B, 3, n, generator=g) > 0.5).float()
    first = torch.tensor([0, 3])
    got = rowfused.row_terms(P, q0, n, cols, first)
    want = _loop_terms(P, q0, n, cols, first)
    for k, v in want.items():
        torch.testing.assert_close(got[k].double(), v, rtol=1e-5, atol=2e-5, msg=k)
    assert torch.equal(got["arg"], P.argmax(-1))
    span, amb = _sorted_span(P)  # causal rows: the zeros after the query are not binned
    assert bool(((got["span"].long() == span) | amb).all()) and not bool(amb.all())
    torch.testing.assert_close(got["top"], P.amax(-1))
    torch.testing.assert_close(got["special"].double(), (P.double() * cols[:, None, None, 0]).sum(-1))
    torch.testing.assert_close(got["first"], torch.stack([P[0, ..., 0], P[1, ..., 3]]))
    assert float(got["after"].max()) == 0  # nothing after the query
    P[0, 1, 0, q0 + 3] = 0.5
    assert float(rowfused.row_terms(P, q0, n, cols, first)["after"][0, 1, 0]) == 0.5
    assert rowfused.row_terms(-P, q0, n, cols, first) is None  # a negative weight: sort instead


def test_row_terms_into_a_sink_write_each_row_at_its_place():
    """With ``into`` (the attention's Sink) the loop writes a block's terms straight to the
    attention's rows ``q0:q0 + r`` (the rows around them untouched), the weights near the
    diagonal and the template sums too, and returns only the column sums: checked against the
    per-row loops written here, the argmax, and sums of the weights taken in the test."""
    import numpy as np

    from probe.analysis.focus.backends.rowloop.rowparts import Sink

    g = torch.Generator().manual_seed(4)
    B, h, Q, q0, r = 2, 3, 40, 29, 7
    n = q0 + r
    P = torch.softmax(torch.randn(B, h, r, n, generator=g) * 3, -1)
    P = P.masked_fill(torch.arange(n)[None, :] > torch.arange(q0, q0 + r)[:, None], 0)
    cols = (torch.rand(B, 3, n, generator=g) > 0.5).float()
    first = torch.tensor([0, 2])
    b_, i_, j_ = torch.tensor([0, 0, 1]), torch.tensor([1, 1, 6]), torch.tensor([3, 30, 0])
    pairs = {"dup": (b_, i_, j_, None), "induction": (b_[:1], i_[:1], j_[:1] + 1, None)}
    sl = slice(q0, q0 + r)
    sink = Sink(B, h, Q, 2, ("dup", "induction"))
    w = torch.rand(B, r, generator=g)
    got = rowfused.row_terms(P, q0, Q, cols, first, colw=w, pairs=pairs, into=sink)
    assert set(got) == {"recv"}  # the rest is in the sink
    torch.testing.assert_close(got["recv"], (w[:, None, :, None].double() * P.double()).sum(2))
    want = _loop_terms(P, q0, Q, cols, first)
    for k, v in want.items():
        torch.testing.assert_close(sink.term(k)[..., sl].double(), v, rtol=1e-5, atol=2e-5, msg=k)
    assert torch.equal(sink.args()[..., sl], P.argmax(-1))
    torch.testing.assert_close(sink.masks()[..., sl, :], torch.einsum("bhrk,bck->bhrc", P, cols))
    for d, v in sink.diag().items():
        at = torch.arange(q0, q0 + r) + d
        ok = (at >= 0) & (at < n)
        want_d = torch.where(ok, P.gather(-1, at.clamp(0, n - 1).expand(B, h, r)[..., None])[..., 0], 0)
        assert torch.equal(v[..., sl], want_d), d
    dup = torch.zeros(B, h, r)
    for b, i, j in zip(b_.tolist(), i_.tolist(), j_.tolist(), strict=True):
        dup[b, :, i] += P[b, :, i, j]
    torch.testing.assert_close(sink.pair("dup")[..., sl], dup)
    torch.testing.assert_close(sink.pair("induction")[0, :, q0 + 1], P[0, :, 1, 4])
    others = np.r_[0:q0, q0 + r : Q]  # the rows before and after the block: untouched
    assert not sink.terms.reshape(-1, B * h, Q)[:, :, others].any()
    assert (
        not sink.near.reshape(B * h, Q, -1)[:, others].any()
        and not sink.arg.reshape(B * h, Q)[:, others].any()
    )
    with pytest.raises(ValueError, match="not the sink's"):
        rowfused.row_terms(P, q0, Q, cols, first, pairs={"dup": pairs["dup"]}, into=sink)
    assert rowfused.row_terms(-P, q0, Q, cols, first, pairs=pairs, into=sink) is None


def test_log_of_bit_patterns():
    """spanselect.ln (the vectorised log of the row loop) against float64 math.log, over every
    binade, both sides of the sqrt(2) split, and the clamp at float32's smallest normal number."""
    import math

    import numpy as np
    from numba import njit

    from probe.analysis.focus.backends.rowloop import spanselect

    @njit
    def logs(bits, out):
        for j in range(bits.shape[0]):
            out[j] = spanselect.ln(max(bits[j], np.int32(spanselect.TINY_BITS)))

    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.rand(20000, generator=g) ** 12,
            torch.tensor(
                [1.0, 0.5, 2.0**-126, 1e-45, 0.0, 0.70710677, 0.70710683, 1.4142135, 1.4142137, 3e38]
            ),
        ]
    ).numpy()
    got = np.empty(x.size)
    logs(x.view(np.int32), got)
    tiny = float(np.finfo(np.float32).tiny)
    want = np.array([math.log(max(float(v), tiny)) for v in x])
    assert np.abs(got - want).max() <= 1e-7  # a float32 log would be off by up to 4e-6 here
    assert got[-10] == 0.0 and got[-6] == got[-7] == math.log(tiny)


def test_row_terms_column_sums_and_thread_split():
    """The column sums Σ_i w_i a_ij summed in the loop, and one head's rows split over threads,
    against float64 sums and the per-row loops written here."""
    g = torch.Generator().manual_seed(5)
    for B, h, r in ((1, 1, 37), (2, 3, 5)):
        n, q0 = 300, 263
        P = torch.softmax(torch.randn(B, h, r, n, generator=g) * 2, -1)
        cols = (torch.rand(B, 3, n, generator=g) > 0.3).float()
        first = torch.zeros(B, dtype=torch.long)
        w = (torch.rand(B, r, generator=g) > 0.2).float()
        got = rowfused.row_terms(P, q0, n, cols, first, colw=w)
        want = (P.double() * w.double()[:, None, :, None]).sum(2)
        torch.testing.assert_close(got["recv"], want, rtol=0, atol=1e-12)
        loops = _loop_terms(P, q0, n, cols, first)
        for k, v in loops.items():
            torch.testing.assert_close(got[k].double(), v, rtol=1e-5, atol=2e-5, msg=k)
        assert torch.equal(got["arg"], P.argmax(-1))


def test_span_of_a_crowded_bin():
    """Thousands of weights in the one bin that crosses the threshold (a near-uniform row), with
    ties among them: the second histogram narrows them, and the span still equals the sort's."""
    g = torch.Generator().manual_seed(11)
    K = 6000
    base = 1.0 + torch.randint(0, 40, (4, K), generator=g).float() / 4096  # many ties, one bin
    base[1] += torch.rand(K, generator=g) * 1e-3  # near-ties
    base[2, :100] = 50.0  # a few large weights, the crowded bin below them
    base[3] = 1.0  # every weight equal
    P = base / base.sum(-1, keepdim=True)
    want, amb = _sorted_span(P)
    got = rowfused.spans(P)
    assert bool(((got.long() == want) | amb).all()) and not bool(amb.all())


@pytest.mark.parametrize("causal", [True, False])
def test_span_from_the_previous_rows_bin(causal):
    """Neighbouring rows of a head mostly cross in the same bin, which the loop tries first: rows
    that change slowly (the guess holds), a row of another scale in between (it fails, the
    histogram decides, and the next row guesses from that one), ties and causal zeros after the
    query; every span equals the sort's."""
    g = torch.Generator().manual_seed(21)
    B, h, r, n = 1, 2, 40, 3000
    q0 = n - r if causal else 0
    logits = torch.randn(1, h, 1, n, generator=g) + 0.05 * torch.randn(B, h, r, n, generator=g)
    logits[:, :, 17] *= 6  # a peaked row among near-uniform ones
    logits[:, 1, 25:30, :1000] = 0.0  # equal logits: ties in the crossing bin
    if causal:
        logits = logits.masked_fill(torch.arange(n) > torch.arange(q0, q0 + r)[:, None], float("-inf"))
    P = torch.softmax(logits, -1)
    cols = torch.ones(B, 3, n)
    got = rowfused.row_terms(P, q0, n if causal else None, cols, torch.zeros(B, dtype=torch.long))
    want, amb = _sorted_span(P)
    assert bool(((got["span"].long() == want) | amb).all()) and int(amb.sum()) <= 2


@pytest.mark.parametrize("causal", [True, False])
def test_row_terms_over_chunks_on_both_sides_of_the_query(causal):
    """Rows of 1,000 keys read 256 at a time: chunks wholly before the query, wholly after it, the
    query's own chunk and a partial last one; a previous-token row (its mean distance is 1, and
    stays 1 to float32 precision wherever the query falls in its chunk) and a row on the query
    itself; against the loops written here."""
    g = torch.Generator().manual_seed(8)
    B, h, n = 1, 3, 1000
    q0, r = (n - 300, 300) if causal else (0, n)
    P = torch.softmax(torch.randn(B, h, r, n, generator=g) * torch.tensor([0.5, 2.0, 6.0])[:, None, None], -1)
    if causal:
        P = P.masked_fill(torch.arange(n) > torch.arange(q0, q0 + r)[:, None], 0)
        P = P / P.sum(-1, keepdim=True)
    rows = torch.arange(q0, q0 + r)
    P[0, 1] = 0
    P[0, 1, torch.arange(r), (rows - 1).clamp(min=0)] = 1.0  # previous token
    P[0, 1, 0, 0] = 1.0 if not causal else P[0, 1, 0, 0]
    cols = (torch.rand(B, 3, n, generator=g) > 0.5).float()
    first = torch.zeros(B, dtype=torch.long)
    pick = torch.tensor([0, 1, 255, 256, 257, 511, 512, 640, 767, 768, 999]) - q0
    pick = pick[(pick >= 0) & (pick < r)]
    sub = P[:, :, pick]
    got = rowfused.row_terms(P, q0, n, cols, first)
    want = {k: v for k, v in _loop_terms(sub, 0, n, cols, first).items() if k in ("total", "ent")}
    for a, i in enumerate((pick + q0).tolist()):  # the distance terms at each query's own position
        one = _loop_terms(sub[:, :, a : a + 1], i, n, cols, first)
        for k in ("signed", "dist", "reach", "beyond_16", "beyond_128", "beyond_1024"):
            want_k = one[k][..., 0]
            torch.testing.assert_close(got[k][:, :, pick[a]].double(), want_k, rtol=1e-6, atol=2e-6, msg=k)
    for k, v in want.items():
        torch.testing.assert_close(got[k][:, :, pick].double(), v, rtol=1e-6, atol=2e-6, msg=k)
    prev = got["dist"][0, 1, 1:] if not causal else got["dist"][0, 1]
    assert float((prev - 1).abs().max()) <= 1e-6  # a previous-token head reads 1 token back
    masses = torch.einsum("bhrn,bcn->bhrc", P.double(), cols.double())
    torch.testing.assert_close(got["special"].double(), masses[..., 0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got["content"].double(), masses[..., 2], rtol=1e-6, atol=1e-7)
    assert torch.equal(got["arg"], P.argmax(-1)) and torch.equal(got["top"], P.amax(-1))
    span, amb = _sorted_span(P)
    assert bool(((got["span"].long() == span) | amb).all())


def _packed():
    """Skip where the CPU (as numba compiles for it) has no AVX-512VL compress."""
    from probe.analysis.focus.backends.rowloop import compress

    if not compress.AVAILABLE:
        pytest.skip("the CPU has no AVX-512VL (the scalar compaction runs there)")


@pytest.mark.parametrize("way", ["scalar", "packed"])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 8, 9, 16, 255, 4097])
def test_collect_gathers_a_bins_weights(n, way):
    """spanselect.collect_scalar (the two halves compacted side by side) and collect_packed
    (eight a step, the CPU's compress instruction) against a mask written in the test: the bin's
    weights, each once and in the row's order (the selection's pivots depend on it), for bins
    holding none, some, all of them and the last, and the slots after them left as they were
    past the last step's eight."""
    import numpy as np

    from probe.analysis.focus.backends.rowloop import spanselect as ss

    if way == "packed":
        _packed()
    collect = ss.collect_scalar if way == "scalar" else ss.collect_packed
    g = torch.Generator().manual_seed(n)
    x = (torch.rand(n, generator=g) ** 4).numpy()
    bits = x.view(np.int32)
    bins = bits >> ss.SHIFT
    mid = int(np.median(bins)) if n else 5
    for k0, k1 in {(0, 1), (mid, mid + 1), (mid, mid + 2), (0, ss.BINS)}:
        if n >= 9:  # the patterns at both edges of the bins, and just outside them
            edges = [k0 << ss.SHIFT, (k0 << ss.SHIFT) - 1, (k1 << ss.SHIFT) - 1, k1 << ss.SHIFT]
            bits[1:9:2] = [min(max(e, 0), 0x7F7FFFFF) for e in edges]
            bins = bits >> ss.SHIFT
        cand = np.full(max(n, 1), -1.0, np.float32)
        m = collect(x, bits, k0, k1, cand)
        want = x[(bins >= k0) & (bins < k1)]
        assert m == len(want)
        np.testing.assert_array_equal(cand[:m], want)


@pytest.mark.parametrize("way", ["scalar", "packed"])
def test_keep_compacts_below_or_above_a_pivot(way):
    """spanselect's _keep_scalar and _keep_packed (the quickselect's compaction in place)
    against a mask written here: the values of ``vals[lo:hi]`` below (or above) the pivot, in
    order, from ``lo``; ``vals`` before ``lo`` untouched; on runs of every length to 40 with
    ties of the pivot, zeros and subnormals."""
    import numpy as np

    from probe.analysis.focus.backends.rowloop import spanselect as ss

    if way == "packed":
        _packed()
    keep = ss._keep_scalar if way == "scalar" else ss._keep_packed
    rng = np.random.default_rng(11)
    for length in range(41):
        for lo in (0, 3):
            base = rng.integers(0, 6, lo + length).astype(np.float32) / 5
            base[rng.random(lo + length) < 0.2] = np.float32(1e-40)  # subnormal
            for p in (np.float32(0.4), np.float32(0.0), np.float32(1e-40), np.float32(2.0)):
                for smaller in (True, False):
                    vals = base.copy()
                    part = base[lo:]
                    want = part[part < p] if smaller else part[part > p]
                    k = keep(vals, lo, lo + length, p, smaller)
                    assert k == lo + len(want), (length, lo, p, smaller)
                    np.testing.assert_array_equal(vals[lo:k], want)
                    np.testing.assert_array_equal(vals[:lo], base[:lo])


def test_compress_is_used_where_the_cpu_has_it():
    """compress.AVAILABLE against the CPU's own flags (/proc/cpuinfo, Linux): the packed loops
    run where the CPU has AVX-512VL and numba compiles for the host (``NUMBA_CPU_FEATURES``
    unset), and spanselect.collect is the packed loop exactly there."""
    import os
    from pathlib import Path

    from probe.analysis.focus.backends.rowloop import compress
    from probe.analysis.focus.backends.rowloop import spanselect as ss

    info = Path("/proc/cpuinfo")
    if not info.exists() or os.environ.get("NUMBA_CPU_FEATURES"):
        pytest.skip("needs Linux's /proc/cpuinfo and numba compiling for the host")
    flags = set()
    for line in info.read_text().splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    assert compress.AVAILABLE == ({"avx512f", "avx512vl"} <= flags)
    assert (ss.collect is ss.collect_packed) == compress.AVAILABLE
    assert (ss._keep is ss._keep_packed) == compress.AVAILABLE


def test_select_equals_a_sorted_walk():
    """spanselect.select (the quickselect that finds where the smallest weights stop fitting)
    against the ascending walk written here, on rows with ties, zeros, one value many times and
    orders that defeat a median-of-three pivot (sorted, reversed, organ pipe)."""
    import numpy as np

    from probe.analysis.focus.backends.rowloop import spanselect

    rng = np.random.default_rng(4)
    cases = [
        rng.random(500).astype(np.float32),
        np.sort(rng.random(3000).astype(np.float32)),
        np.sort(rng.random(3000).astype(np.float32))[::-1].copy(),
        np.concatenate([np.arange(1000), np.arange(1000)[::-1]]).astype(np.float32),
        rng.integers(0, 4, 800).astype(np.float32) / 7,
        np.full(300, 0.25, np.float32),
        np.zeros(50, np.float32),
        np.array([0.5], np.float32),
        np.array([], np.float32),
    ]
    for vals in cases:
        for cum, left, share in ((0.0, 0, 0.1), (0.3, 17, 0.5), (0.0, 3, 1.0), (0.0, 0, 0.0)):
            rest = cum + share * float(vals.astype(np.float64).sum())
            want_left, c, stop = left, cum, -1
            for v in np.sort(vals).astype(np.float64):
                if c + v > rest:
                    stop = int(np.float32(v).view(np.int32))
                    break
                c += v
                want_left += 1
            got = spanselect.select(vals.copy(), len(vals), cum, left, rest)
            assert (got[0], int(got[1])) == (want_left, stop), (len(vals), cum, share)


def _function_attributes(ir: str, name: str) -> str:
    """The attributes LLVM IR ``ir`` gives the (numba-mangled) function ``name`` itself, not its
    CPython or cfunc wrappers: those written on its ``define`` line and those of the attribute
    groups (``#N``) it names there."""
    import re

    lines = ir.splitlines()
    defines = [
        line
        for line in lines
        if line.startswith("define") and re.search(rf"@_ZN\w*{name}", line) and "cpython" not in line
    ]
    assert len(defines) == 1, defines
    group = re.compile(r"attributes #(\d+) = \{(.*)\}")
    groups = {m.group(1): m.group(2) for m in map(group.match, lines) if m}
    tail = defines[0].split(")")[-1]  # after the arguments: the function's own attributes
    return tail + " ".join(groups[n] for n in re.findall(r"#(\d+)", tail))


def test_wide_marks_a_function_for_512_bit_vectors():
    """spanselect.wide puts LLVM's prefer-vector-width=512 on the function that calls it (in its
    IR: on that function's own definition, where LLVM's vectoriser reads it), and on no function
    that does not call it; the marked function still computes what the unmarked one does. (Which
    registers LLVM then picks is the compiler's and the CPU's business: not asserted here.)"""
    import numpy as np
    import pytest

    numba = pytest.importorskip("numba")
    from probe.analysis.focus.backends.rowloop import spanselect

    def total(x):
        s = np.float32(0)
        for j in range(x.shape[0]):
            s += x[j] * x[j]
        return s

    body = numba.njit(fastmath=spanselect.FAST, inline="always")(total)  # (inlined: the same loop)

    def marked(x):
        spanselect.wide()
        return body(x)

    plain = numba.njit(fastmath=spanselect.FAST)(total)
    wide = numba.njit(fastmath=spanselect.FAST)(marked)
    x = np.arange(1000, dtype=np.float32) / 1000
    # float32 sums of 1000 terms in any order (fastmath reassociates): within 1e-5 of the float64 sum
    assert wide(x) == pytest.approx(float((x.astype(np.float64) ** 2).sum()), rel=1e-5)
    assert plain(x) == pytest.approx(float((x.astype(np.float64) ** 2).sum()), rel=1e-5)
    wide_ir = "".join(wide.inspect_llvm().values())
    assert '"prefer-vector-width"="512"' in _function_attributes(wide_ir, "marked")
    plain_ir = "".join(plain.inspect_llvm().values())
    assert '"prefer-vector-width"' not in _function_attributes(plain_ir, "total")
    assert '"prefer-vector-width"' not in plain_ir


def test_heapsort_sorts_a_range_in_place():
    """spanselect.heapsort (the allocation-free sort of a selection out of rounds) against
    np.sort, on ranges inside a longer array (values outside the range untouched) with ties,
    zeros, sorted and reversed orders, and the empty and one-value ranges."""
    import numpy as np

    from probe.analysis.focus.backends.rowloop import spanselect

    rng = np.random.default_rng(7)
    cases = [
        rng.random(1000).astype(np.float32),
        rng.integers(0, 5, 333).astype(np.float32),
        np.sort(rng.random(257).astype(np.float32)),
        np.sort(rng.random(256).astype(np.float32))[::-1].copy(),
        np.zeros(40, np.float32),
        np.array([0.25], np.float32),
        np.array([], np.float32),
    ]
    for vals in cases:
        for lo, hi in ((0, len(vals)), (len(vals) // 3, len(vals) - len(vals) // 4)):
            got = vals.copy()
            spanselect.heapsort(got, lo, hi)
            want = vals.copy()
            want[lo:hi] = np.sort(vals[lo:hi])
            assert np.array_equal(got, want), (len(vals), lo, hi)


def test_log32_of_bit_patterns():
    """rowpass.ln32 (the float32 log of the row loop's second pass) against float64 math.log:
    within a float32 rounding of the log, over every binade and both sides of the sqrt(2) split."""
    import math

    import numpy as np
    from numba import njit

    from probe.analysis.focus.backends.rowloop import rowpass, spanselect

    @njit
    def logs(bits, out):
        for j in range(bits.shape[0]):
            out[j] = rowpass.ln32(max(bits[j], np.int32(spanselect.TINY_BITS)))

    g = torch.Generator().manual_seed(1)
    edges = torch.tensor([1.0, 0.5, 2.0**-126, 0.70710677, 1.4142137])
    x = torch.cat([torch.rand(20000, generator=g) ** 12, edges])
    x = x.numpy()
    got = np.empty(x.size, np.float32)
    logs(x.view(np.int32), got)
    want = np.array([math.log(max(float(v), float(np.finfo(np.float32).tiny))) for v in x])
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= 1.2e-7 * np.maximum(np.abs(want), 1.0)).all(), err.max()


def test_exp32_against_float64():
    """rowpass.exp32 (the row loop's softmax) against float64 math.exp rounded to float32: within
    two float32 roundings where the result is normal, within one subnormal step below that (as a
    float32 exp gives it), 0 below -104 and for -inf and NaN."""
    import math

    import numpy as np
    from numba import njit

    from probe.analysis.focus.backends.rowloop import rowpass

    @njit
    def exps(t, out):
        for j in range(t.shape[0]):
            out[j] = rowpass.exp32(t[j])

    g = torch.Generator().manual_seed(2)
    t = torch.cat(
        [-torch.rand(20000, generator=g) * 110, torch.tensor([0.0, -0.0, -1e-30, -87.3, -87.4, -103.9])]
    )
    t = torch.cat([t, torch.tensor([-104.5, -200.0, float("-inf"), float("nan")])]).numpy()
    got = np.empty(t.size, np.float32)
    exps(t, got)
    want = np.array([math.exp(float(v)) if v == v else 0.0 for v in t])
    tiny = float(np.finfo(np.float32).tiny)
    normal = want >= tiny
    rel = np.abs(got[normal] - want[normal]) / want[normal]
    assert rel.max() <= 1.2e-7, rel.max()
    sub = (want < tiny) & (t >= -104)
    assert sub.sum() > 100 and (np.abs(got[sub] - want[sub]) <= 2.0**-149).all()
    assert (got[t < -104] == 0).all() and got[-1] == 0 and got[-2] == 0 and got[20000] == 1.0


@pytest.mark.parametrize("causal", [True, False])
def test_row_terms_take_the_softmax_of_scores(causal):
    """row_terms(scores, keep=...) takes each row's softmax in the loop (no log of a weight: the
    entropy from the scores), then drops the weights on keys where keep is 0: against the loops
    written here over the float64 softmax of the same scores, with hidden keys (-inf), a row that
    sees no key, keys kept out (padding), scores far apart (weights below float32's smallest
    normal number) and rows over several chunks; the block is left holding the weights."""
    g = torch.Generator().manual_seed(9)
    B, h, r, n = 2, 3, 40, 700
    q0 = n - r if causal else 0
    S = torch.randn(B, h, r, n, generator=g) * torch.tensor([0.3, 3.0, 40.0])[:, None, None]
    if causal:
        S = S.masked_fill(torch.arange(n) > torch.arange(q0, q0 + r)[:, None], float("-inf"))
    S[1, 0, 3] = float("-inf")  # a row that sees no key
    keep = torch.ones(B, n)
    keep[1, :9] = 0  # padding keys of the second text
    W = torch.softmax(S.double(), -1).nan_to_num(0.0) * keep[:, None, None].double()
    cols = (torch.rand(B, 3, n, generator=g) > 0.5).float()
    first = torch.tensor([0, 9])
    w = torch.ones(B, r)
    X = S.clone()
    got = rowfused.row_terms(X, q0, n, cols, first, colw=w, keep=keep)
    torch.testing.assert_close(X.double(), W, rtol=3e-6, atol=1e-12)  # the weights, in place
    want = _loop_terms(W, q0, n, cols, first)
    for k, v in want.items():
        torch.testing.assert_close(got[k].double(), v, rtol=1e-5, atol=2e-5, msg=k)
    span, amb = _sorted_span(W.float())
    assert bool(((got["span"].long() == span) | amb).all())
    assert torch.equal(got["arg"], W.argmax(-1)) and float(got["total"][1, 0, 3]) == 0
    torch.testing.assert_close(got["recv"], W.sum(2), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(got["first"].double(), torch.stack([W[0, ..., 0], W[1, ..., 9]]))
    assert float(got["after"].max()) == 0 if causal else float(got["after"].max()) > 0


@pytest.mark.parametrize("n", [31, 32, 33, 300, 544, 767])
def test_a_rows_last_part_padded_to_a_whole_chunk(n):
    """A row's last part, shorter than a chunk of 256 keys, is read as a whole chunk padded in
    scratch from rowpass.PAD_MIN (32) keys on: the softmax's exponentials with -inf scores, pass
    1's sums with zeros, whose counts below the span's bins are taken out again. Last parts of 31
    to 255 keys, a hidden key and keys kept out in them: the weights against torch's float64
    softmax, every term against the loops written here, and the span, each head starting from the
    bin its first row crosses in (so the counts below the guessed bins decide), against the sort."""
    import numpy as np

    from probe.analysis.focus.backends.rowloop import rowpass, spanselect

    assert rowpass.PAD_MIN == 32
    g = torch.Generator().manual_seed(n)
    B, h, r = 1, 2, 24
    q0 = n - r
    S = torch.randn(B, h, r, n, generator=g) * torch.tensor([0.5, 2.0])[:, None, None]
    S[..., n - 5] = float("-inf")  # a hidden key in the last part
    keep = torch.ones(B, n)
    keep[0, n - 9 : n - 7] = 0  # keys kept out (padding) in it
    W = torch.softmax(S.double(), -1) * keep[:, None, None].double()
    cols = (torch.rand(B, 3, n, generator=g) > 0.5).float()
    first = torch.zeros(B, dtype=torch.long)
    vals = W[0, :, 0].float().sort(-1).values  # each head's first row: where its span crosses
    c = vals.double().cumsum(-1)
    at = (c <= 0.1 * c[:, -1:]).sum(-1)
    cross = vals[torch.arange(h), at].numpy().view(np.int32) >> spanselect.SHIFT
    X = S.clone()
    got = rowfused.row_terms(X, q0, n, cols, first, keep=keep, guesses=cross.astype(np.int64))
    torch.testing.assert_close(X.double(), W, rtol=3e-6, atol=1e-12)  # the weights, in place
    for k, v in _loop_terms(W, q0, n, cols, first).items():
        torch.testing.assert_close(got[k].double(), v, rtol=1e-5, atol=2e-5, msg=k)
    span, amb = _sorted_span(W.float())
    assert bool(((got["span"].long() == span) | amb).all()) and not bool(amb.any())


def test_row_terms_sum_template_pairs():
    """Template pairs (b, i, j) summed in the row loop: each row's sum of its weights on its pairs'
    keys, against a loop over the pairs written here (rows with none, several, repeated keys)."""
    g = torch.Generator().manual_seed(11)
    B, h, r, n = 2, 3, 9, 50
    P = torch.softmax(torch.randn(B, h, r, n, generator=g), -1)
    pairs = {}
    for name, m in (("dup", 30), ("induction", 7)):
        b, i, j = (
            torch.randint(0, B, (m,), generator=g),
            torch.randint(0, r, (m,), generator=g),
            torch.randint(0, n, (m,), generator=g),
        )
        pairs[name] = (b, i, j, None)
    got = rowfused.row_terms(P, n - r, n, torch.ones(B, 3, n), torch.zeros(B, dtype=torch.long), pairs=pairs)
    for name, (b, i, j, _) in pairs.items():
        want = torch.zeros(B, h, r, dtype=torch.float64)
        for bb, ii, jj in zip(b.tolist(), i.tolist(), j.tolist(), strict=True):
            want[bb, :, ii] += P[bb, :, ii, jj].double()
        torch.testing.assert_close(got[name].double(), want, rtol=1e-6, atol=1e-7)
        assert bool((got[name] == 0).any())  # some rows have no pair


NEG_NAN = struct.unpack("<f", struct.pack("<I", 0xFFC00000))[0]  # a NaN with its sign bit set


@pytest.mark.parametrize("hidden", [False, True], ids=["seen", "hidden"])
@pytest.mark.parametrize("bad", [float("nan"), NEG_NAN, float("inf")], ids=["nan", "-nan", "inf"])
def test_softmax_of_a_nan_score_is_nan(bad, hidden):
    """A row whose scores hold a NaN (either sign: the row's max is taken over the bit patterns)
    or +inf (inf − inf) comes out NaN, as torch's softmax gives it, never as a softmax of the
    other keys, also where every other key is hidden; the other rows are untouched by it."""
    S = torch.randn(1, 1, 3, 20)
    if hidden:
        S[0, 0, 1] = float("-inf")
    S[0, 0, 1, 4] = bad
    X = S.clone()
    got = rowfused.row_terms(
        X, 0, None, torch.ones(1, 3, 20), torch.zeros(1, dtype=torch.long), keep=torch.ones(1, 20)
    )
    assert bool(torch.softmax(S[0, 0, 1], -1).isnan().all())  # the oracle: torch's own softmax
    assert bool(X[0, 0, 1].isnan().all()) and bool(got["total"][0, 0, 1].isnan())
    torch.testing.assert_close(X[0, 0, [0, 2]], torch.softmax(S[0, 0, [0, 2]], -1))


def test_softmax_row_max_over_negative_scores():
    """Rows whose scores are all negative, with -0.0 and +0.0, far apart or hidden (-inf): the
    max the loop takes over the bit patterns gives torch's softmax (the oracle)."""
    S = torch.stack(
        [
            -torch.rand(20) * 50 - 1,  # all negative
            torch.tensor([-0.0] * 10 + [-1e-30] * 10),  # -0.0 the max
            torch.tensor([-3.0] * 19 + [0.0]),  # +0.0 the max
            torch.where(torch.arange(20) < 7, -torch.rand(20) - 200, torch.tensor(float("-inf"))),
        ]
    ).view(1, 1, 4, 20)
    X = S.clone()
    rowfused.row_terms(
        X, 0, None, torch.ones(1, 3, 20), torch.zeros(1, dtype=torch.long), keep=torch.ones(1, 20)
    )
    torch.testing.assert_close(X, torch.softmax(S, -1), rtol=1e-6, atol=1e-45)


def test_reach_of_causal_rows_from_the_chunk_totals():
    """reach90 of rows with no weight after their query comes from the chunk totals (a binary
    search) and a walk through one chunk: every row of a 1,500-key block, sharp and broad heads,
    mass far back, on a chunk's edge and on the query itself, against a float64 cumsum written
    here (equal but where a sum is within rounding of 90% of the total)."""
    g = torch.Generator().manual_seed(11)
    B, h, n, r = 1, 4, 1500, 400
    q0 = n - r
    S = torch.randn(B, h, r, n, generator=g) * torch.tensor([0.3, 1.0, 3.0, 9.0])[:, None, None]
    rows = torch.arange(q0, q0 + r)
    S[0, 0, ::7, :300] += 6.0  # mass far back
    S[0, 1, 1::5, 255:257] += 12.0  # on a chunk's edge
    S[0, 2, 2::9] = -30.0
    S[0, 2, torch.arange(2, r, 9), rows[2::9]] = 0.0  # on the query itself
    S = S.masked_fill(torch.arange(n) > rows[:, None], float("-inf"))
    P = torch.softmax(S, -1)
    cols = torch.zeros(B, 3, n)
    got = rowfused.row_terms(P, q0, n, cols, torch.zeros(B, dtype=torch.long))["reach"].long()
    Pd = P.double()
    C = Pd.cumsum(-1)
    total = C[..., -1:]
    d = torch.arange(n)
    j = rows[:, None] - d[None, :] - 1  # [r, d]: the last key left out at each d
    left = torch.gather(C, -1, j.clamp(min=0).expand(B, h, r, n))  # C(j), 0 where j < 0
    within = total - torch.where(j >= 0, left, torch.zeros(()))
    ok = within >= 0.9 * total
    want = ok.float().argmax(-1)
    amb = ((within - 0.9 * total).abs() <= 1e-12 * total).any(-1)
    assert bool(((got == want) | amb).all()) and not bool(amb.all())
    assert int(want.max()) > 1000 and int(want.min()) == 0
