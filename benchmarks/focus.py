"""Benchmark: every focus statistic from a cache on disk, against one plain read of that cache.

A GPT-2-small-shaped SDPA decoder (12 layers × 12 heads, random weights) is captured once at
T = 1024 into a safetensors cache on disk. Then, interleaved round-robin (the machine's speed
drifts, so every repeat times both back to back), it times

* ``read``: copy every layer's pattern from the lazily opened cache into memory (the baseline);
* ``stats``: ``probe.head_stats(path)``: all metrics, templates, roles and the rollout;

and reports medians and the ratio (target ≤ 2×). Peak memory is measured in a fresh child
process per mode as the peak *anonymous* resident memory (RssAnon, sampled every 2 ms) above
the level after start-up: the memory-mapped file's pages are the page cache, not the analysis's
memory. The target is ≤ 2 layers of patterns (2 × 12 × 1024² × 4 B = 96 MiB).

    python benchmarks/focus.py                  # the README row
    python benchmarks/focus.py --repeats 2 --T 256
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gpt2_shaped  # noqa: E402

import probe  # noqa: E402

MODES = ("read", "stats")


def make_cache(path: Path, T: int) -> Path:
    """Capture the GPT-2-shaped model on ``T`` random tokens straight to ``path``."""
    ids = torch.randint(0, 50257, (1, T), generator=torch.Generator().manual_seed(T))
    probe.capture(gpt2_shaped.build(), ids, out=path)
    return path


def run(mode: str, path: Path) -> None:
    cache = probe.load(path)
    if mode == "read":
        for s in cache.stacks:
            for layer in range(cache.n_layers(s)):
                p = cache.pattern(s, layer).clone()  # the bytes themselves, not a view of the map
                del p
    else:
        probe.head_stats(cache, progress=False)


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def peak_anon(fn) -> int:
    """Peak RssAnon growth (bytes) while ``fn()`` runs, sampled every 2 ms in a thread."""
    gc.collect()
    base = _rss_anon()
    peak = [base]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_anon())
            time.sleep(0.002)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    return max(peak[0], _rss_anon()) - base


def child_peak(mode: str, path: Path) -> int:
    code = (
        "import sys; sys.path.insert(0, %r); import focus as b, pathlib; p = pathlib.Path(%r);"
        "b.run(%r, p);"  # once first, so lazy imports and one-time set-up are not counted
        "print(b.peak_anon(lambda: b.run(%r, p)))"
    ) % (str(HERE), str(path), mode, mode)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=1024, help="sequence length (default 1024)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-memory child processes")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        path = make_cache(Path(d) / "gpt2_shaped.safetensors", args.T)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for m in MODES:
            run(m, path)  # warm: page cache, imports
        for _ in range(args.repeats):
            for m in MODES:
                t0 = time.perf_counter()
                run(m, path)
                times[m].append(time.perf_counter() - t0)
        med = {m: statistics.median(v) for m, v in times.items()}
        layer = 12 * args.T * args.T * 4
        print(f"cache: {path.stat().st_size / 2**20:.0f} MiB, 12 layers × 12 heads, T = {args.T}")
        print(f"{'mode':8} {'median s':>9} {'× read':>7} {'peak MiB':>9} {'layers':>7}")
        for m in MODES:
            peak = float("nan") if args.no_rss else child_peak(m, path)
            print(f"{m:8} {med[m]:9.3f} {med[m] / med['read']:7.2f} {peak / 2**20:9.1f} {peak / layer:7.2f}")


if __name__ == "__main__":
    main()
