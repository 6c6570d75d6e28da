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
``reach90`` (bisection over the distance), so those cost no further pass and no prefix sums.

Used by :mod:`probe.analysis.focus.streaming` when Triton is installed (it ships with CUDA builds of
PyTorch), the block is on a CUDA device and a row fits the registers (:data:`MAX_KEYS`); a block
holding a negative weight (only a model's own softmax variant can give one) falls back to the sort.
The tests check it against a sort written in the test (``tests/test_cuda.py``).
"""

from __future__ import annotations

import torch

from probe.analysis.focus.reach import BEYOND, REACH_MASS
from probe.analysis.focus.rows import SPAN_MASS

MAX_KEYS = 32768  # a row is held in registers: 32 float32 per thread at 32 warps

try:  # Triton ships with PyTorch's CUDA wheels; a CPU-only install has none, and needs none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


NAMES = ("total", "ent", "top", "span", "neg", "signed", "dist", "reach", *(f"beyond_{d}" for d in BEYOND))

if triton is not None:

    @triton.jit
    def _row_terms(
        P,
        out,
        arg_out,
        K,
        K_all,
        q0,
        r,
        rest_share,
        reach_share,
        D0,
        D1,
        D2,
        BLOCK: tl.constexpr,
        DISTANCES: tl.constexpr,
        N_OUT: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        inside = offs < K
        x = tl.load(P + row * K + offs, mask=inside, other=0.0)
        xd = x.to(tl.float64)
        total = tl.sum(xd, axis=0)
        top = tl.max(x, axis=0)
        arg = tl.argmax(x, axis=0, tie_break_left=True)
        ent = -tl.sum(x * tl.log(tl.maximum(x, 1.1754943508222875e-38)), axis=0)
        neg = tl.sum((x < 0).to(tl.int32), axis=0)
        # non-negative float32 order as their bit patterns do: bisect for the largest pattern
        # lo whose strictly smaller weights sum to at most rest (f(0) = 0 <= rest always)
        bits = x.to(tl.int32, bitcast=True)
        rest = rest_share * total
        lo = tl.zeros((), tl.int32)
        hi = tl.full((), 0x7F800001, tl.int32)  # one past +inf: every weight is below it
        for _ in range(31):
            mid = lo + (hi - lo) // 2
            f = tl.sum(tl.where(bits < mid, xd, 0.0), axis=0)
            ok = f <= rest
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        below = (bits < lo) & inside
        a = tl.sum(below.to(tl.int32), axis=0)
        m = tl.sum(tl.where(below, xd, 0.0), axis=0)
        e = tl.sum(((bits == lo) & inside).to(tl.int32), axis=0)
        v = lo.to(tl.float32, bitcast=True).to(tl.float64)
        # the weights equal to v come next in sorted order: as many as keep the sum within rest
        j = tl.where(v > 0, tl.floor((rest - m) / v), 0.0)
        j = tl.minimum(tl.maximum(j, 0.0), e.to(tl.float64))
        left = a + j.to(tl.int32)
        base = out + row * N_OUT
        tl.store(base + 0, total.to(tl.float32))
        tl.store(base + 1, ent)
        tl.store(base + 2, top)
        tl.store(base + 3, (K - left).to(tl.float32))
        tl.store(base + 4, neg.to(tl.float32))
        tl.store(arg_out + row, arg.to(tl.int64))
        if DISTANCES:  # self-attention: the query is key q0 + (row mod r)
            i = q0 + (row % r).to(tl.int32)
            dist = tl.abs(offs - i)
            tl.store(base + 5, tl.sum(xd * (offs - i).to(tl.float64), axis=0).to(tl.float32))
            tl.store(base + 6, tl.sum(xd * dist.to(tl.float64), axis=0).to(tl.float32))
            # reach: the smallest d with mass within distance d >= reach_share · total
            want = reach_share * total
            lo = tl.zeros((), tl.int32)
            hi = tl.zeros((), tl.int32) + (K_all - 1)
            for _ in range(16):
                mid = (lo + hi) // 2
                ok = tl.sum(tl.where(dist <= mid, xd, 0.0), axis=0) >= want
                go = lo < hi
                hi = tl.where(go & ok, mid, hi)
                lo = tl.where(go & (not ok), mid + 1, lo)
            tl.store(base + 7, hi.to(tl.float32))
            tl.store(
                base + 8, tl.where(D0 < K_all, total - tl.sum(tl.where(dist <= D0, xd, 0.0), axis=0), 0.0)
            )
            tl.store(
                base + 9, tl.where(D1 < K_all, total - tl.sum(tl.where(dist <= D1, xd, 0.0), axis=0), 0.0)
            )
            tl.store(
                base + 10, tl.where(D2 < K_all, total - tl.sum(tl.where(dist <= D2, xd, 0.0), axis=0), 0.0)
            )


def usable(P: torch.Tensor) -> bool:
    """Whether :func:`row_terms` can take the block ``P`` (CUDA, Triton, rows that fit)."""
    return (
        triton is not None
        and len(BEYOND) == 3
        and P.is_cuda
        and 0 < P.shape[-1] <= MAX_KEYS
        and P.is_contiguous()
    )


def row_terms(P: torch.Tensor, q0: int = 0, K: int | None = None) -> dict[str, torch.Tensor] | None:
    """``{total, ent, top, arg, span}`` each ``P.shape[:-1]`` for a contiguous float32 block
    ``[..., r, kend]`` of non-negative weights, or None when a row holds a negative weight (then
    sort instead). With ``K`` (the attention's key count; self-attention, rows ``q0:q0 + r``)
    also ``signed`` (Σ (j − i)·a), ``dist``, ``reach`` and ``beyond_<D>`` as
    :mod:`probe.analysis.focus.reach` defines them, summed in float64 without prefix sums."""
    kend, r = P.shape[-1], P.shape[-2]
    R = P.numel() // kend
    distances = K is not None
    n_out = len(NAMES) if distances else 5
    out = torch.empty(R, n_out, dtype=torch.float32, device=P.device)
    arg = torch.empty(R, dtype=torch.long, device=P.device)
    block = triton.next_power_of_2(kend)
    _row_terms[(R,)](
        P,
        out,
        arg,
        kend,
        K or kend,
        q0,
        r,
        1.0 - SPAN_MASS,
        REACH_MASS,
        *BEYOND,
        BLOCK=block,
        DISTANCES=distances,
        N_OUT=n_out,
        num_warps=max(4, min(32, block // 512)),
    )
    if bool(out[:, 4].any()):
        return None
    lead = P.shape[:-1]
    got = {n: out[:, c].reshape(lead) for c, n in enumerate(NAMES[:n_out]) if n != "neg"}
    got["arg"] = arg.reshape(lead)
    return got


__all__ = ["row_terms", "usable", "MAX_KEYS", "NAMES"]
