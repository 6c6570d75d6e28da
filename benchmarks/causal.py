"""Benchmark: what the causal-mask audit costs against the plain forward pass, in one process.

On the GPT-2-small-shaped SDPA decoder (12 layers, 12 heads, d_model 768, random weights;
``benchmarks/gpt2_shaped.py``) at T = 256, batch 1, it times, interleaved round-robin (every
repeat times all modes back to back, so the machine's drift hits them alike):

* ``plain``: the model's forward under ``torch.no_grad()`` (the baseline);
* ``capture``: ``probe.capture(model, ids)`` (what the static checks read);
* ``static``: ``probe.check_causal(cache)`` on that cache (no model calls);
* ``full``: ``probe.check_causal(model, ids)``: capture, static checks and the functional checks
  (suffix perturbation, gradient; this model has no padding mask, KV cache or second backend).

It reports medians, ratios to ``plain`` and the audit's own count of forwards and backwards.

    python benchmarks/causal.py                  # the README table
    python benchmarks/causal.py --repeats 2 --length 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gpt2_shaped  # noqa: E402

import probe  # noqa: E402

MODES = ("plain", "capture", "static", "full")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=256, help="tokens (default 256)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per mode (default 5)")
    args = ap.parse_args(argv)
    model = gpt2_shaped.build()
    ids = torch.randint(0, 50257, (1, args.length), generator=torch.Generator().manual_seed(0))
    cache = probe.capture(model, ids)
    report = probe.check_causal(model, ids)  # warm-up, and the cost it states
    if not report.ok:
        print(report)
        raise SystemExit("the GPT-2-shaped model should audit clean")

    def run(mode: str) -> None:
        if mode == "plain":
            with torch.no_grad():
                model(ids)
        elif mode == "capture":
            probe.capture(model, ids)
        elif mode == "static":
            probe.check_causal(cache)
        else:
            probe.check_causal(model, ids)

    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            t = time.perf_counter()
            run(mode)
            times[mode].append(time.perf_counter() - t)
    base = statistics.median(times["plain"])
    fw, bw = report.cost()
    print(
        f"causal audit, GPT-2-small-shaped decoder, T = {args.length}, batch 1, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} repeats (median)"
    )
    print(f"{'mode':10} {'seconds':>9} {'x plain':>8}")
    for mode in MODES:
        med = statistics.median(times[mode])
        print(f"{mode:10} {med:9.3f} {med / base:8.1f}")
    print(f"full audit: {fw} forwards (the capture included) and {bw} backward; checks:")
    for c in report.checks:
        print(f"  {c['check']:9} {c['status']:8} {c['forwards']} fw {c['backwards']} bw  {c['detail']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
