"""A/B: the opt-in huge-page pattern arena on and off, interleaved in one process.

The HF ``GPT2LMHeadModel`` (GPT-2-small-shaped, random weights, LM head included) under glibc's
default allocator; each round times the plain sdpa forward, an in-memory capture with
``probe.capture.arena.ENABLED = True`` and one with it off, back to back. Prints the median of
the per-round ratios to the plain forward, and the RSS left right after ``del cache`` for each.

    python benchmarks/arena_ab.py            # T = 1024, 5 rounds (the README's numbers)
    python benchmarks/arena_ab.py --T 512 --repeats 3
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

arena = importlib.import_module("probe.capture.arena")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if not arena.AVAILABLE:
        raise SystemExit("this platform's mmap has no MADV_HUGEPAGE: nothing to compare")
    bench = speed.Bench("hf", peers=False)
    ids = bench.ids(args.T)
    for mode in ("plain", "memory"):
        bench.run(mode, ids)  # warm-up
    times: dict[str, list[float]] = {"plain": [], "arena": [], "no arena": []}
    for _ in range(args.repeats):
        for name in times:
            arena.ENABLED = name == "arena"
            t0 = time.perf_counter()
            bench.run("plain" if name == "plain" else "memory", ids)
            times[name].append(time.perf_counter() - t0)
    print(f"HF GPT-2, T = {args.T}, {args.repeats} interleaved rounds, default allocator")
    for name in ("arena", "no arena"):
        arena.ENABLED = name == "arena"
        ratios = [t / p for t, p in zip(times[name], times["plain"], strict=True)]
        left = bench.release(ids)  # MB
        print(
            f"{name:9} × plain {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})"
            f"  RSS after del cache {left:+.0f} MB"
        )
    arena.ENABLED = False


if __name__ == "__main__":
    main()
