"""Benchmark: the costs behind the speed tables, each measured on its own.

* ``disk``: 12 blocks of 48 MB (GPT-2 small's patterns at T = 1024) written durably by probe's
  streaming writer (``probe.cache.perf.direct.DataWriter``) with direct I/O, and through the page cache
  with the streaming sink's flush every 64 MB, interleaved; then each beside a 2-thread matmul
  loop, reporting how much the loop slows down (the CPU the writing takes from the model).
* ``pages``: first-touch faults of 576 MiB of fresh anonymous memory (one write per 4 KiB page)
  and unmapping it again: what a cache's fresh pattern memory costs under glibc's default
  allocator, and what dropping it costs.
* ``recompute``: the causal mask as ``masked_fill_`` of a broadcast boolean triangle against
  adding a float ``-inf`` triangle (``[12, 128, 128]``), and ``probe.capture.patterns.sdpa_weights``
  at T = 128 and 1024 into a preallocated output.
* ``dispatch``: trips through probe's torch-function mode in one HF GPT-2 capture at T = 128: the
  model's own ops, and probe's own tensor calls (zero since the hooks run off the mode stack).
* ``loop``: HF GPT-2 at T = 1024 under glibc's default allocator, round by round: a plain forward,
  then a capture and ``del cache``, each with its time and minor page faults.
* ``dtype``: HF GPT-2 at T = 1024, default allocator: a plain forward, ``probe.capture`` and
  ``probe.capture(dtype="float16")`` interleaved (medians of per-round ratios).

    python benchmarks/costs.py                 # all parts
    python benchmarks/costs.py --parts disk pages
    python benchmarks/costs.py --parts pages loop --repeats 6
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

BLOCK, BLOCKS = 48 << 20, 12


def _median_ms(f, n: int, warm: int = 3) -> float:
    for _ in range(warm):
        f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


# -- disk ------------------------------------------------------------------------------------------
def _write_blocks(folder: Path, direct_io: bool, bufs: list[torch.Tensor]) -> None:
    from probe.cache.perf import OPTIONS, direct, using

    path = folder / "blocks.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with using(direct_io=direct_io):
            os.write(fd, b"\0" * direct.ALIGN)
            w = direct.DataWriter(path, direct.ALIGN, fd)
        unsynced = 0
        for i in range(BLOCKS):
            w.write(bufs[i % 2])
            unsynced += BLOCK
            if not w.direct and unsynced >= OPTIONS.sync_every:  # as the streaming sink does
                getattr(os, "fdatasync", os.fsync)(fd)
                unsynced = 0
        w.close()
        os.fsync(fd)
    finally:
        os.close(fd)
        path.unlink()


def disk(repeats: int) -> None:
    from probe.cache.perf.direct import aligned_empty

    folder = Path(tempfile.mkdtemp(prefix="probe-costs-"))
    bufs = [aligned_empty((BLOCK,), torch.uint8, "cpu").fill_(i + 1) for i in range(2)]
    a, b = torch.randn(1024, 3072), torch.randn(3072, 768)

    def loop() -> None:
        for _ in range(60):
            a @ b

    modes = {"none": None, "direct": True, "page cache": False}
    alone = {m: [] for m in modes if modes[m] is not None}
    beside = {m: [] for m in modes}
    for r in range(repeats + 1):
        names = list(modes)[r % 3 :] + list(modes)[: r % 3]
        for m in names:
            if modes[m] is None:
                t0 = time.perf_counter()
                loop()
                took = time.perf_counter() - t0
            else:
                t0 = time.perf_counter()
                _write_blocks(folder, modes[m], bufs)
                w = time.perf_counter() - t0
                th = threading.Thread(target=_write_blocks, args=(folder, modes[m], bufs))
                t0 = time.perf_counter()
                th.start()
                loop()
                th.join()
                took = time.perf_counter() - t0
                if r:
                    alone[m].append(w)
            if r:  # round 0 warms up
                beside[m].append(took)
    base = statistics.median(beside["none"])
    print(f"disk: {BLOCKS} x {BLOCK >> 20} MB written durably, medians of {repeats} rounds")
    print(f"  2-thread matmul loop alone: {base:.3f} s")
    for m in alone:
        print(
            f"  {m:10}  write alone {statistics.median(alone[m]):.3f} s;"
            f"  beside the loop: loop + write {statistics.median(beside[m]):.3f} s"
            f" (+{statistics.median(beside[m]) - base:.3f} s)"
        )
    folder.rmdir()


# -- pages -----------------------------------------------------------------------------------------
_PRIVATE = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0)


def pages(repeats: int) -> None:
    size = BLOCKS * BLOCK
    fault, unmap = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = mmap.mmap(-1, size, flags=_PRIVATE)  # private and anonymous, as glibc maps large blocks
        t = torch.frombuffer(m, dtype=torch.uint8)
        t[::4096] = 1  # one write per page: a first-touch fault each
        t1 = time.perf_counter()
        del t
        m.close()
        t2 = time.perf_counter()
        fault.append(t1 - t0)
        unmap.append(t2 - t1)
    n = size // 4096
    f = statistics.median(fault)
    print(f"pages: {size >> 20} MiB of fresh anonymous memory ({n} pages of 4 KiB), medians of {repeats}")
    print(f"  first touch {f:.3f} s ({f / n * 1e6:.2f} us a page); unmap {statistics.median(unmap):.3f} s")


# -- recompute ---------------------------------------------------------------------------------------
def recompute(repeats: int) -> None:
    from probe.capture.patterns import sdpa_weights, upper_triangle

    s = torch.randn(12, 128, 128)
    tri = torch.ones(128, 128, dtype=torch.bool).triu_(1)
    add = upper_triangle(128, torch.device("cpu"))
    print(f"recompute: medians of {repeats * 20} calls")
    fill = _median_ms(lambda: s.masked_fill_(tri, float("-inf")), repeats * 20) * 1e3
    added = _median_ms(lambda: s.add_(add), repeats * 20) * 1e3
    print(f"  causal mask on [12, 128, 128]: masked_fill_ {fill:.1f} us, add -inf triangle {added:.1f} us")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for T in (128, 1024):
        q, k, v = (torch.randn(1, 12, T, 64) for _ in range(3))
        out = torch.empty(1, 12, T, T).fill_(1)
        kernel = _median_ms(lambda q=q, k=k, v=v: sdpa(q, k, v, is_causal=True), repeats * 4)
        ms = _median_ms(
            lambda q=q, k=k, v=v, o=out: sdpa_weights(q, k, v, is_causal=True, out=o), repeats * 4
        )
        print(f"  T = {T}: sdpa_weights {ms:.2f} ms per layer (the fused SDPA kernel itself {kernel:.2f} ms)")


# -- dispatch ----------------------------------------------------------------------------------------
def dispatch(repeats: int) -> None:
    import peers

    import probe
    from probe.capture.hooks import watch

    model = peers.gpt2("sdpa", n_positions=2048)
    ids = torch.randint(0, 50257, (1, 128), generator=torch.Generator().manual_seed(128))
    counts = {"model ops": 0, "probe's own calls": 0}
    real = watch._Mode.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        counts["probe's own calls" if self.quiet or not self.stack else "model ops"] += 1
        return real(self, func, types, args, kwargs)

    watch._Mode.__torch_function__ = counting
    try:
        probe.capture(model, ids)
    finally:
        watch._Mode.__torch_function__ = real
    print("dispatch: trips through the torch-function mode in one HF GPT-2 capture at T = 128")
    for k, v in counts.items():
        print(f"  {k}: {v}")


# -- loop --------------------------------------------------------------------------------------------
def loop(repeats: int) -> None:
    """A research loop under glibc's default allocator: each round a plain forward, then a capture
    and ``del cache``, each timed with the minor faults it took (to compare with ``pages``' cost a
    fault in a tight loop, and with ``speed.py``'s no-fault ratio)."""
    import resource

    import speed

    import probe

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    bench = speed.Bench("hf", peers=False)
    ids = bench.ids(1024)
    model = bench.models["plain"]
    print("loop: HF GPT-2 at T = 1024, glibc's default allocator; each round: plain forward, capture, del")
    with torch.no_grad():
        model(ids)
        del_cache = probe.capture(model, ids)
        del del_cache
        for _ in range(repeats):
            gc.collect()
            f0, t0 = faults(), time.perf_counter()
            model(ids)
            plain, fp = time.perf_counter() - t0, faults() - f0
            gc.collect()
            f0, t0 = faults(), time.perf_counter()
            cache = probe.capture(model, ids)
            took, fc = time.perf_counter() - t0, faults() - f0
            t1 = time.perf_counter()
            del cache
            gone = time.perf_counter() - t1
            print(
                f"  plain {plain:.3f} s ({fp} faults); capture {took:.3f} s ({fc} faults); "
                f"del cache {gone:.3f} s; capture + del = {(took + gone) / plain:.2f}x plain, "
                f"{fc - fp} more faults"
            )


# -- dtype -------------------------------------------------------------------------------------------
def dtype(repeats: int) -> None:
    import speed

    import probe

    bench = speed.Bench("hf", peers=False)
    ids = bench.ids(1024)
    model = bench.models["plain"]

    def run(which: str) -> None:
        with torch.no_grad():
            if which == "plain":
                model(ids)
            else:
                cache = probe.capture(model, ids, dtype=None if which == "float32" else "float16")
                del cache

    modes = ["plain", "float32", "float16"]
    for m in modes:
        run(m)
    ratios = {m: [] for m in modes[1:]}
    for r in range(repeats):
        took = {}
        for m in modes[r % 3 :] + modes[: r % 3]:
            gc.collect()
            t0 = time.perf_counter()
            run(m)
            took[m] = time.perf_counter() - t0
        for m in ratios:
            ratios[m].append(took[m] / took["plain"])
    print(f"dtype: HF GPT-2, T = 1024, default allocator, {repeats} interleaved rounds (x plain)")
    for m, rs in ratios.items():
        print(f"  capture {m:8} {statistics.median(rs):.2f} (min {min(rs):.2f}, max {max(rs):.2f})")


PARTS = {
    "disk": disk,
    "pages": pages,
    "recompute": recompute,
    "dispatch": dispatch,
    "loop": loop,
    "dtype": dtype,
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    for p in args.parts:
        PARTS[p](args.repeats)
        print()


if __name__ == "__main__":
    main()
