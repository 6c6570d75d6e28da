"""Benchmark: the GPU row kernel on one 128 MiB block of 16,384-key rows, beside its parts.

CUDA only (Triton). Times, with CUDA events (median of 10 after a warm-up), on a block
``[1, 12, 170, 16384]`` of softmax rows: one read of the block (``P.sum(-1)``) and a copy, the row
kernel (``probe/analysis/focus/backends/kernels/rowkernel.py``, every per-row term written into a table), and
scratch kernels that isolate its costs: one read in Triton, and the span's 31-step bisection alone
with float32 and with float64 sums, each at 4, 8, 16 and 32 warps; then the block's torch
operations of the block path (the key-class masses, the column sums, the recompute's product and
softmax). docs/long-context.md quotes its numbers.

    python benchmarks/gpu_row_kernel.py
"""

from __future__ import annotations

import statistics
import sys

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    sys.exit("needs Triton (it ships with PyTorch's CUDA wheels)")

from probe.analysis.focus.backends.kernels import rowkernel

dev = "cuda"


def ev_time(fn, n=10):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


@triton.jit
def _variant(P, out, K, rest_share, BLOCK: tl.constexpr, MODE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inside = offs < K
    x = tl.load(P + row * K + offs, mask=inside, other=0.0)
    if MODE == 0:  # one read: total only
        tl.store(out + row, tl.sum(x, axis=0))
    else:
        bits = x.to(tl.int32, bitcast=True)
        if MODE == 1:  # the span's bisection with float32 sums
            xs = x
        else:  # with float64 sums
            xs = x.to(tl.float64)
        rest = rest_share * tl.sum(xs, axis=0)
        lo = tl.zeros((), tl.int32)
        hi = tl.full((), 0x7F800001, tl.int32)
        for _ in range(31):
            mid = lo + (hi - lo) // 2
            ok = tl.sum(tl.where(bits < mid, xs, 0.0), axis=0) <= rest
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        tl.store(out + row, lo.to(tl.float32))


def main() -> None:
    K = 16384
    r = (128 * 2**20) // (4 * 12 * K)
    g = torch.Generator(device=dev).manual_seed(0)
    P = torch.softmax(torch.randn(1, 12, r, K, device=dev, generator=g) * 3, -1).contiguous()
    R = P.numel() // K
    print(f"block {tuple(P.shape)} = {P.numel() * 4 / 2**20:.0f} MiB, rows {R}")
    print(f"  P.sum(-1)            {ev_time(lambda: P.sum(-1)):.3f} ms")
    print(f"  P.clone()            {ev_time(lambda: P.clone()):.3f} ms")
    table = torch.zeros(1, 12, r, len(rowkernel.columns(True, False)), device=dev)
    first = torch.zeros(1, dtype=torch.int32, device=dev)
    t = ev_time(lambda: rowkernel.launch(P, table, first, K - r, K))
    print(f"  the row kernel       {t:.3f} ms  (every per-row term, into a table)")
    out = torch.empty(R, device=dev)
    for mode, name in ((0, "one read"), (1, "bisect f32"), (2, "bisect f64")):
        for w in (4, 8, 16, 32):
            try:
                t = ev_time(lambda m=mode, w=w: _variant[(R,)](P, out, K, 0.1, BLOCK=K, MODE=m, num_warps=w))
                print(f"  variant {name:<10} warps {w:>2}: {t:.3f} ms")
            except Exception as e:  # noqa: BLE001
                print(f"  variant {name} warps {w}: {type(e).__name__} {str(e)[:200]}")
    cols = torch.rand(1, 3, K, device=dev)
    qreal = torch.ones(1, r, dtype=torch.bool, device=dev)
    print(f"  einsum masks         {ev_time(lambda: torch.einsum('bhrk,bck->bhrc', P, cols)):.3f} ms")
    t = ev_time(lambda: (qreal[:, None, None, :].float() @ P)[..., 0, :])
    print(f"  received (vec @ P)   {t:.3f} ms")
    q = torch.randn(1, 12, r, 64, device=dev)
    k = torch.randn(1, 12, K, 64, device=dev)
    print(f"  recompute q@kT       {ev_time(lambda: q @ k.transpose(-1, -2)):.3f} ms")
    print(f"  softmax              {ev_time(lambda: torch.softmax(P, -1)):.3f} ms")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
    main()
