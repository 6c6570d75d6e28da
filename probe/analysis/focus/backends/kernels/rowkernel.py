"""One GPU kernel for the per-row terms that otherwise need a sort: a Triton program per row.

On a CUDA device the streamed statistics spend most of their time sorting every row for the
effective span (``torch.sort`` of a 128 MiB block: about as long as 35 passes over it). The span
needs no sort: it is set by one threshold. This kernel loads a row once into registers and finds,
by bisection over the bit patterns of its (non-negative) float32 weights, the largest value ``v``
whose strictly smaller weights sum to at most the left-over mass ``(1 − SPAN_MASS) · total``; the
effective span is every key but those smaller weights and as many copies of ``v`` as still fit.
Masses are summed in float64, so the threshold is exact up to float64 rounding (the sort path sums
in float32). The same program gives each row's total, entropy, largest weight and its first
position and, for self-attention, the signed and absolute mean distance, ``beyond_<D>`` and
``reach90`` (bisection over the distance), the word masses and the largest weight after the
query (the causal audit), so those cost no further pass and no prefix sums.

The backend :mod:`probe.analysis.focus.backends.triton_rows` uses it when Triton is installed (it
ships with CUDA builds of PyTorch), the block is on a CUDA device and a row fits the registers
(:data:`MAX_KEYS`); a block holding a negative weight (only a model's own softmax variant can give
one) falls back to the sort; blocks probe recomputed with a softmax are not read back for that
check (``check=False``), so the host never waits for the device between blocks. The tests check it
against a sort written in the test (``tests/test_cuda.py``, and in Triton's interpreter
``tests/test_fused_stats.py``).
"""

from __future__ import annotations

import torch

from probe.analysis.focus.definitions.table import BEYOND, LOCAL_WINDOW, REACH_MASS, SPAN_MASS, WORD_STEPS

MAX_KEYS = 32768  # a row is held in registers: 64 float32 per thread at 16 warps
CPU = False  # the tests: CPU blocks too, run by Triton's interpreter (TRITON_INTERPRET=1)
# float arguments reach a compiled kernel as float32 (the interpreter keeps float64): the shares
# rounded to float32 here, so that both compute the same thresholds
_F32_REST = float(torch.tensor(1.0 - SPAN_MASS, dtype=torch.float32))
_F32_REACH = float(torch.tensor(REACH_MASS, dtype=torch.float32))

try:  # Triton ships with PyTorch's CUDA wheels; a CPU-only install has none, and needs none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


# the columns of the kernel's output, one row per query: every attention's, then self-attention's,
# then the word masses
BASE = ("total", "ent", "top", "span", "neg", "arg", "first")
SELF = (
    "signed",
    "dist",
    "reach",
    *(f"beyond_{d}" for d in BEYOND),
    "after",
    *(f"diag_{d}" for d in range(-LOCAL_WINDOW, LOCAL_WINDOW + 1)),
)
WORDS = tuple(name for name, _ in WORD_STEPS)  # word_prev, word_self, word_next

if triton is not None:

    @triton.jit
    def _bisect_bits(x, rest, WIDE: tl.constexpr):  # pragma: no cover - compiled
        """``(lo, hi)``, ``hi = lo + 1``: ``lo`` the largest bit pattern whose strictly smaller
        weights sum to at most ``rest`` (``f(0) = 0 <= rest`` always), summed in float64 if
        ``WIDE`` else float32. Non-negative float32 order as their bit patterns do, so each step
        compares the weights with the pattern read as a float (at most +inf): no array of bit
        patterns is held beside the row."""
        lo = tl.zeros((), tl.int32)
        hi = tl.full((), 0x7F800001, tl.int32)  # one past +inf: every weight is below it
        for _ in range(31):
            mid = lo + (hi - lo) // 2
            below = x < mid.to(tl.float32, bitcast=True)
            if WIDE:
                ok = tl.sum(tl.where(below, x.to(tl.float64), 0.0), axis=0) <= rest
            else:
                ok = tl.sum(tl.where(below, x, 0.0), axis=0) <= rest.to(tl.float32)
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        return lo, hi

    @triton.jit
    def _span_left(x, n_pad, total, rest_share):  # pragma: no cover - compiled
        """How many keys the effective span leaves out: the smallest weights summing to at most
        ``(1 − SPAN_MASS) · total``. Non-negative float32 order as their bit patterns do: bisect
        with float32 sums (a few times cheaper), then check with float64 sums that ``f(lo) <=
        rest < f(lo + 1)``; f is monotone, so that settles it (the pattern float64 throughout
        gives); where float32 rounding misled a step (a sum within rounding of rest), bisect in
        float64. The ``n_pad`` zeros past the row's last key (the load's padding to ``BLOCK``)
        are taken out of the counts."""
        rest = rest_share * total
        lo, hi = _bisect_bits(x, rest, False)
        m = _within(x, x < lo.to(tl.float32, bitcast=True))
        if (m > rest) | (_within(x, x < hi.to(tl.float32, bitcast=True)) <= rest):
            lo, hi = _bisect_bits(x, rest, True)
            m = _within(x, x < lo.to(tl.float32, bitcast=True))
        lo_f = lo.to(tl.float32, bitcast=True)
        a = tl.sum((x < lo_f).to(tl.int32), axis=0) - tl.where(lo_f > 0, n_pad, 0)
        e = tl.sum((x == lo_f).to(tl.int32), axis=0) - tl.where(lo_f == 0, n_pad, 0)
        v = lo_f.to(tl.float64)
        # the weights equal to v come next in sorted order: as many as keep the sum within rest
        j = tl.where(v > 0, tl.floor((rest - m) / v), 0.0)
        j = tl.minimum(tl.maximum(j, 0.0), e.to(tl.float64))
        return a + j.to(tl.int32)

    @triton.jit
    def _bisect_reach(x, offs, i, want, K_all, WIDE: tl.constexpr):  # pragma: no cover - compiled
        """The smallest ``d`` in ``[0, K_all)`` whose mass within distance ``d`` of key ``i`` is
        at least ``want`` (the last ``d`` if none), summed in float64 if ``WIDE`` else float32."""
        lo = tl.zeros((), tl.int32)
        hi = tl.zeros((), tl.int32) + (K_all - 1)
        for _ in range(16):
            mid = (lo + hi) // 2
            near = (offs >= i - mid) & (offs <= i + mid)
            if WIDE:
                ok = tl.sum(tl.where(near, x.to(tl.float64), 0.0), axis=0) >= want
            else:
                ok = tl.sum(tl.where(near, x, 0.0), axis=0) >= want.to(tl.float32)
            go = lo < hi
            hi = tl.where(go & ok, mid, hi)
            lo = tl.where(go & (not ok), mid + 1, lo)
        return hi

    @triton.jit
    def _reach(x, offs, i, want, K_all):  # pragma: no cover - compiled
        """:func:`_bisect_reach` in float32, checked in float64 as the span is."""
        hi = _bisect_reach(x, offs, i, want, K_all, False)
        w_hi = _within(x, (offs >= i - hi) & (offs <= i + hi))
        w_below = _within(x, (offs >= i - hi + 1) & (offs <= i + hi - 1))
        if ((w_hi < want) & (hi < K_all - 1)) | ((w_below >= want) & (hi > 0)):
            hi = _bisect_reach(x, offs, i, want, K_all, True)
        return hi

    @triton.jit
    def _within(x, mask):  # pragma: no cover - compiled
        return tl.sum(tl.where(mask, x.to(tl.float64), 0.0), axis=0)

    @triton.jit
    def _self_terms(
        x, line, offs, i, total, K, K_all, reach_share, D0, D1, D2, base, W: tl.constexpr
    ):  # pragma: no cover - compiled
        """Self-attention's terms of row ``x`` (query ``i``) into ``base[7:]``; distances come
        from ``offs`` each time (no array of them is held beside the row)."""
        tl.store(base + 7, tl.sum(x.to(tl.float64) * (offs - i).to(tl.float64), axis=0).to(tl.float32))
        tl.store(base + 8, tl.sum(x.to(tl.float64) * tl.abs(offs - i).to(tl.float64), axis=0).to(tl.float32))
        tl.store(base + 9, _reach(x, offs, i, reach_share * total, K_all).to(tl.float32))
        tl.store(
            base + 10, tl.where(D0 < K_all, total - _within(x, (offs >= i - D0) & (offs <= i + D0)), 0.0)
        )
        tl.store(
            base + 11, tl.where(D1 < K_all, total - _within(x, (offs >= i - D1) & (offs <= i + D1)), 0.0)
        )
        tl.store(
            base + 12, tl.where(D2 < K_all, total - _within(x, (offs >= i - D2) & (offs <= i + D2)), 0.0)
        )
        # the largest |weight| on a key after the query: the causal audit, without a pass of its own
        tl.store(base + 13, tl.max(tl.where(offs > i, tl.abs(x), 0.0), axis=0))
        for d in tl.static_range(2 * W + 1):  # a_i,i+d for |d| <= W, 0 where that key is missing
            k = i + d - W
            tl.store(base + 14 + d, tl.load(line + k, mask=(k >= 0) & (k < K), other=0.0))

    @triton.jit
    def _row_terms(
        P,
        out,
        K,
        K_all,
        q0,
        r,
        Q_out,
        o0,
        H,
        rest_share,
        reach_share,
        D0,
        D1,
        D2,
        FIRST,
        WR,
        BLOCK: tl.constexpr,
        DISTANCES: tl.constexpr,
        WORDED: tl.constexpr,
        W: tl.constexpr,
        N_OUT: tl.constexpr,
    ):  # pragma: no cover - compiled
        row = tl.program_id(0).to(tl.int64)  # (text, head, query) flattened over the block
        bh = row // r
        rr = row % r
        b = bh // H
        offs = tl.arange(0, BLOCK)
        inside = offs < K
        line = P + row * K
        x = tl.load(line + offs, mask=inside, other=0.0)
        total = tl.sum(x.to(tl.float64), axis=0)
        f = tl.load(FIRST + b)  # the text's first real key: its weight
        at_first = tl.load(line + tl.minimum(f, K - 1))
        base = out + (bh * Q_out + o0 + rr) * N_OUT
        tl.store(base + 0, total.to(tl.float32))
        tl.store(base + 1, -tl.sum(x * tl.log(tl.maximum(x, 1.1754943508222875e-38)), axis=0))
        tl.store(base + 2, tl.max(x, axis=0))
        tl.store(base + 3, (K - _span_left(x, BLOCK - K, total, rest_share)).to(tl.float32))
        tl.store(base + 4, tl.sum((x < 0).to(tl.int32), axis=0).to(tl.float32))
        tl.store(base + 5, tl.argmax(x, axis=0, tie_break_left=True).to(tl.float32))  # < 2^24 keys: exact
        tl.store(base + 6, tl.where(f < K, at_first, 0.0))
        if DISTANCES:  # self-attention: the query is key q0 + rr
            i = q0 + rr.to(tl.int32)
            _self_terms(x, line, offs, i, total, K, K_all, reach_share, D0, D1, D2, base, W)
            if WORDED:  # C(hi) − C(lo) per target word, C the row's running sum
                wr = WR + ((b * r + rr) * 6)
                for t in tl.static_range(3):
                    up = _within(x, offs <= tl.load(wr + 2 * t + 1))
                    down = _within(x, offs <= tl.load(wr + 2 * t))
                    tl.store(base + 15 + 2 * W + t, (up - down).to(tl.float32))


def usable(P: torch.Tensor) -> bool:
    """Whether :func:`launch` can take the block ``P`` (CUDA, Triton, rows that fit)."""
    return (
        triton is not None
        and len(BEYOND) == 3
        and (P.is_cuda or CPU)
        and 0 < P.shape[-1] <= MAX_KEYS
        and P.is_contiguous()
    )


def columns(self_attn: bool, worded: bool) -> tuple[str, ...]:
    """The names of the output's columns for an attention of this kind."""
    return (*BASE, *SELF, *WORDS) if self_attn and worded else (*BASE, *SELF) if self_attn else BASE


def launch(
    P: torch.Tensor,
    out: torch.Tensor,
    first: torch.Tensor,
    q0: int,
    K: int | None = None,
    words: torch.Tensor | None = None,
    at: int = 0,
) -> None:
    """Write the per-row terms of the contiguous float32 block ``P`` ``[B, H, r, kend]`` (query
    rows ``q0:q0 + r``) into ``out`` ``[B, H, Q', N]`` at rows ``at:at + r``, one column per name
    of :func:`columns`; ``first`` ``[B]``: each text's first real key. With ``K`` (the attention's
    key count: self-attention) the distance terms, ``after`` (each row's largest ``|weight|`` on a
    key after its query) and the diagonals ``a_i,i+d``; with ``words`` (:func:`word_ends` at these
    rows, ``[B, r, 3, 2]``) the word masses too. Masses are summed in float64. The span and
    ``reach`` assume non-negative weights: the ``neg`` column counts a row's negative ones."""
    B, H, r, kend = P.shape
    distances = K is not None
    worded = distances and words is not None
    n_out = len(columns(distances, worded))
    if out.shape[-1] != n_out or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"the row kernel writes a contiguous float32 [..., {n_out}] output")
    block = triton.next_power_of_2(kend)
    _row_terms[(P.numel() // kend,)](
        P,
        out,
        kend,
        K or kend,
        q0,
        r,
        out.shape[-2],
        at,
        H,
        _F32_REST,
        _F32_REACH,
        *BEYOND,
        first.to(torch.int32),
        words.contiguous() if worded else out,
        BLOCK=block,
        DISTANCES=distances,
        WORDED=worded,
        W=LOCAL_WINDOW,
        N_OUT=n_out,
        # 8 warps for 16,384 keys: a fifth faster than 32 on an H100 (fewer waits at each reduction)
        num_warps=max(4, min(16, block // 2048)),
    )


def row_terms(
    P: torch.Tensor,
    q0: int = 0,
    K: int | None = None,
    words: torch.Tensor | None = None,
    check: bool = True,
    first: torch.Tensor | None = None,
) -> dict[str, torch.Tensor] | None:
    """:func:`launch` into a fresh output: ``{name: P.shape[:-1]}`` for every column (``arg`` as
    integers), or None when ``check`` and a row holds a negative weight (then sort instead);
    ``check=False``: the caller knows every weight is non-negative (a softmax it computed), so
    the block is not read back (a wait for the device)."""
    lead = P.shape[:-1]
    if P.dim() != 4:  # [..., r, kend]: one head per leading index
        P = P.reshape(-1, 1, *P.shape[-2:])
    B, H, r, kend = P.shape
    names = columns(K is not None, K is not None and words is not None)
    out = torch.empty(B, H, r, len(names), dtype=torch.float32, device=P.device)
    first = torch.zeros(B, dtype=torch.long, device=P.device) if first is None else first
    launch(P, out, first, q0, K, words)
    if check and bool(out[..., 4].any()):
        return None
    got = {n: out[..., c].reshape(lead) for c, n in enumerate(names) if n != "neg"}
    got["arg"] = got["arg"].long()
    return got


def word_ends(words: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``[B, Q, 3, 2]`` int32 from :func:`~probe.analysis.focus.definitions.terms.word_targets`: each
    query's ``(lo, hi)`` per target word, its mass being ``C(hi) − C(lo)`` of the row's running
    sum ``C`` (``C(−1) = 0``). :func:`~probe.analysis.focus.definitions.terms.word_masses` clamps both ends
    to the block's keys; past the last key ``C`` is the row's total, so only ``hi`` below 0 needs
    the clamp here, and one table serves every block."""
    s = torch.stack([words[m][0] for m in WORDS], -1)  # [B, Q, 3]
    e = torch.stack([words[m][1] for m in WORDS], -1)
    lo = torch.where(s > 0, s - 1, -1)
    return torch.stack([lo, e.clamp(min=0)], -1).to(torch.int32).contiguous()


__all__ = ["launch", "row_terms", "columns", "word_ends", "usable", "MAX_KEYS", "WORDS"]
