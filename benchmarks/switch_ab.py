"""A/B: one part of probe's performance machinery on and off, interleaved in one process.

The parts are the switches of ``probe.cache.perf.OPTIONS``:
``--switch heap``: the heap trim when a capture's tensors are let go (``heap_trim``, on by
default), which hands freed memory back to the system at the cost of faulting it in again.
``--switch direct``: direct I/O for streamed captures (``direct_io``, on by default where the
file system has it); its rounds stream to a file on the local disk instead.
``--switch thread``: the I/O thread that writes a streamed capture while the model computes
(``io_thread``, on by default); streamed rounds too.

The HF ``GPT2LMHeadModel`` (GPT-2-small-shaped, random weights, LM head included) under glibc's
default allocator; each round times the plain sdpa forward, a capture with the switch on and
one with it off, back to back in an order that rotates every round (each capture's cache is
dropped before the next step, as a research loop does). Prints the median of the per-round
ratios to the plain forward, and (in-memory switches) the RSS left right after ``del cache``.

    python benchmarks/switch_ab.py --switch heap      # T = 1024, 5 rounds
    python benchmarks/switch_ab.py --switch heap --T 512 --repeats 3
    python benchmarks/switch_ab.py --switch direct    # streamed: direct I/O vs the page cache
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import speed  # noqa: E402

from probe.cache.perf import OPTIONS  # noqa: E402

SWITCHES = {"heap": "heap_trim", "direct": "direct_io", "thread": "io_thread"}
MODES = {"heap": "memory", "direct": "stream", "thread": "stream"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", choices=sorted(SWITCHES), required=True)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    switch = SWITCHES[args.switch]
    default = getattr(OPTIONS, switch)
    on, off = f"{args.switch} on", f"{args.switch} off"
    bench = speed.Bench("hf", peers=False)
    ids = bench.ids(args.T)
    mode = MODES[args.switch]
    for m in ("plain", mode):
        bench.run(m, ids)  # warm-up
    times: dict[str, list[float]] = {"plain": [], on: [], off: []}
    names = list(times)
    for r in range(args.repeats):
        for name in names[r % 3 :] + names[: r % 3]:
            setattr(OPTIONS, switch, name == on)
            t0 = time.perf_counter()
            bench.run("plain" if name == "plain" else mode, ids)
            times[name].append(time.perf_counter() - t0)
    print(f"HF GPT-2, T = {args.T}, {args.repeats} interleaved rounds, default allocator, {mode}")
    print(f"plain      median {statistics.median(times['plain']):.3f} s")
    for name in (on, off):
        setattr(OPTIONS, switch, name == on)
        ratios = [t / p for t, p in zip(times[name], times["plain"], strict=True)]
        left = f"  RSS after del cache {bench.release(ids):+.0f} MB" if mode == "memory" else ""
        print(
            f"{name:9}  median {statistics.median(times[name]):.3f} s, × plain "
            f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}){left}"
        )
    setattr(OPTIONS, switch, default)


if __name__ == "__main__":
    main()
