"""Benchmark: what capture costs against the plain forward pass, in one process.

For ``minigpt`` (T = 32, its context) and a GPT-2-small-shaped SDPA decoder (12 layers, 12
heads, d_model 768, random weights) at T = 128, 512, 1024, batch 1, it times

* ``plain``: the model's forward under ``torch.no_grad()`` (the baseline);
* ``memory``: ``probe.capture(model, ids)``, the cache kept in memory;
* ``stream``: ``probe.capture(model, ids, out=path)``, streamed to disk layer by layer;

interleaved round-robin (the machine's speed drifts, so every repeat times all three back to
back) and reports medians, ratios to ``plain``, write MB/s and the peak RSS of each mode, the
last measured in a fresh child process per mode so that one mode's memory does not hide
another's. Finally it opens a multi-GB cache lazily and reads one head.

    python benchmarks/capture.py                 # the README table
    python benchmarks/capture.py --repeats 3 --lengths 128
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gpt2_shaped  # noqa: E402

import probe  # noqa: E402

MODES = ("plain", "memory", "stream")


def build(name: str):
    if name == "minigpt":
        import models

        return models.load("minigpt")
    return gpt2_shaped.build()


def inputs(name: str, T: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(T)
    vocab = 22 if name == "minigpt" else 50257
    return torch.randint(0, vocab, (1, T), generator=g)


def run(mode: str, model, ids, out: Path) -> int:
    """Run one mode once; returns bytes written (stream) or 0."""
    if mode == "plain":
        with torch.no_grad():
            model(ids)
        return 0
    if mode == "memory":
        cache = probe.capture(model, ids)
        del cache
        return 0
    cache = probe.capture(model, ids, out=out)
    size = out.stat().st_size
    del cache
    out.unlink()
    return size


def pattern_layer_bytes(name: str, T: int) -> int:
    heads = 4 if name == "minigpt" else 12
    return heads * T * T * 4


def _vm_hwm() -> int:
    """This process's peak resident set (VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def child_peak_rss(name: str, T: int, mode: str) -> int:
    """Peak RSS (bytes) while a fresh process runs ``mode`` once on an already built model."""
    code = (
        "import sys; sys.path.insert(0, %r); import capture as b, tempfile, pathlib, gc;"
        "m = b.build(%r); ids = b.inputs(%r, %d); d = pathlib.Path(tempfile.mkdtemp());"
        # a tiny run first, so lazy imports and one-time set-up are not counted
        "b.run(%r, m, b.inputs(%r, 8), d / 'w.safetensors'); gc.collect();"
        "b._reset_hwm(); b.run(%r, m, ids, d / 'c.safetensors');"
        "print(b._vm_hwm())"
    ) % (str(HERE), name, name, T, mode, name, mode)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(r.stdout.strip().splitlines()[-1])


def lazy_read(path: Path) -> tuple[float, float, float]:
    """(seconds to open, seconds to read one head, RSS growth in MB) measured in a child."""
    code = (
        "import sys, time; sys.path.insert(0, %r); import capture as b, probe;"
        "b._reset_hwm(); r0 = b._vm_hwm();"
        "t0 = time.perf_counter(); c = probe.load(%r); t1 = time.perf_counter();"
        "h = c.pattern('decoder', 6, head=3, batch=1); t2 = time.perf_counter();"
        "assert h.shape[0] == h.shape[1];"
        "print(t1 - t0, t2 - t1, (b._vm_hwm() - r0) / 2**20)"
    ) % (str(HERE), str(path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    a, b, c = r.stdout.split()
    return float(a), float(b), float(c)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS child processes")
    ap.add_argument("--no-lazy", action="store_true", help="skip the multi-GB lazy-read check")
    args = ap.parse_args(argv)

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{args.repeats} interleaved repeats, medians\n"
    )
    header = (
        "| model | T | plain s | memory s | × plain | stream s | × plain | write MB/s "
        "| peak RSS during run: plain / memory / stream MB | stream extra ÷ one layer of patterns |"
    )
    print(header)
    print("|" + "---|" * 10)
    tmp = Path(tempfile.mkdtemp())
    cases = [("minigpt", 32)] + [("gpt2-small-shaped", T) for T in args.lengths]
    for name, T in cases:
        model, ids = build(name), inputs(name, T)
        out = tmp / "c.safetensors"
        for mode in MODES:  # warm-up
            run(mode, model, ids, out)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        written = 0
        for r in range(args.repeats):
            order = MODES[r % 3 :] + MODES[: r % 3]
            for mode in order:
                gc.collect()
                t0 = time.perf_counter()
                n = run(mode, model, ids, out)
                times[mode].append(time.perf_counter() - t0)
                written = n or written
        med = {m: statistics.median(v) for m, v in times.items()}
        mbps = written / 2**20 / med["stream"]
        if args.no_rss:
            rss_cell, extra_cell = "-", "-"
        else:
            rss = {m: child_peak_rss(name, T, m) for m in MODES}
            rss_cell = " / ".join(f"{rss[m] / 2**20:.0f}" for m in MODES)
            extra = rss["stream"] - rss["plain"]
            extra_cell = f"{extra / 2**20:.0f} MB = {extra / pattern_layer_bytes(name, T):.2f}"
        print(
            f"| {name} | {T} | {med['plain']:.3f} | {med['memory']:.3f} | "
            f"{med['memory'] / med['plain']:.2f} | {med['stream']:.3f} | "
            f"{med['stream'] / med['plain']:.2f} | {mbps:.0f} | {rss_cell} | {extra_cell} |",
            flush=True,
        )
        del model

    if not args.no_lazy:
        model = gpt2_shaped.build()
        ids = torch.randint(0, 50257, (4, 1024), generator=torch.Generator().manual_seed(0))
        path = tmp / "big.safetensors"
        probe.capture(model, ids, out=path)
        size = path.stat().st_size
        opened, read, grew = lazy_read(path)
        print(
            f"\nlazy read: opened a {size / 2**30:.2f} GB cache in {opened * 1000:.1f} ms and "
            f"read one head [1024 x 1024] in {read * 1000:.1f} ms; peak RSS grew {grew:.1f} MB"
        )
        path.unlink()
    os.rmdir(tmp)


if __name__ == "__main__":
    main()
