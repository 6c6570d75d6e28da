"""A/B: one of probe's memory switches on and off, interleaved in one process.

``--switch arena``: the opt-in huge-page pattern arena (``probe.capture.arena.ENABLED``).
``--switch heap``: the heap trim when a capture's tensors are let go (``probe.cache.heap.ENABLED``,
on by default), which hands freed memory back to the system at the cost of faulting it in again.
``--switch direct``: direct I/O for streamed captures (``probe.cache.direct.ENABLED``, on by
default where the file system has it); its rounds stream to a file on the local disk instead.

The HF ``GPT2LMHeadModel`` (GPT-2-small-shaped, random weights, LM head included) under glibc's
default allocator; each round times the plain sdpa forward, a capture with the switch on and
one with it off, back to back in an order that rotates every round (each capture's cache is
dropped before the next step, as a research loop does). Prints the median of the per-round
ratios to the plain forward, and (in-memory switches) the RSS left right after ``del cache``.

    python benchmarks/switch_ab.py --switch arena     # T = 1024, 5 rounds (the README's numbers)
    python benchmarks/switch_ab.py --switch heap --T 512 --repeats 3
    python benchmarks/switch_ab.py --switch direct    # streamed: direct I/O vs the page cache
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import speed  # noqa: E402

SWITCHES = {"arena": "probe.capture.arena", "heap": "probe.cache.heap", "direct": "probe.cache.direct"}
MODES = {"arena": "memory", "heap": "memory", "direct": "stream"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", choices=sorted(SWITCHES), required=True)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    mod = importlib.import_module(SWITCHES[args.switch])
    default = mod.ENABLED
    if not getattr(mod, "AVAILABLE", True):
        raise SystemExit(f"{args.switch} is not available on this platform: nothing to compare")
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
            mod.ENABLED = name == on
            t0 = time.perf_counter()
            bench.run("plain" if name == "plain" else mode, ids)
            times[name].append(time.perf_counter() - t0)
    print(f"HF GPT-2, T = {args.T}, {args.repeats} interleaved rounds, default allocator, {mode}")
    print(f"plain      median {statistics.median(times['plain']):.3f} s")
    for name in (on, off):
        mod.ENABLED = name == on
        ratios = [t / p for t, p in zip(times[name], times["plain"], strict=True)]
        left = f"  RSS after del cache {bench.release(ids):+.0f} MB" if mode == "memory" else ""
        print(
            f"{name:9}  median {statistics.median(times[name]):.3f} s, × plain "
            f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}){left}"
        )
    mod.ENABLED = default


if __name__ == "__main__":
    main()
