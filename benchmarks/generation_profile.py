"""Where a captured generation's time goes, per step (issue 58).

Runs benchmarks/generation.py's model (or ``--model smollm2``) once plain and once through
``probe.generate(keep=...)`` in this process, torch on one thread, timed by the process's CPU
seconds (steadier than the wall clock when other work shares the cores), and splits probe's extra
time among its parts by wrapping them with timers: the stepped capture's begin and end of each
forward (a full step's naming, the assembly of every step), the lean steps' hooks
(:mod:`probe.capture.engine.lean`) and their row (``decode_row``), a full step's hooks, the rows
and top-k consumers' recompute, the heap trim. Parts nest (the assembly is inside a step's end);
what no part holds is the hooks' dispatch by torch, the torch-function modes and the model's own
variation.

    python benchmarks/generation_profile.py --prompt 2048 --new 512 --keep rows
    python benchmarks/generation_profile.py --model smollm2 --prompt 256 --new 64
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from generation import run_mode, setup

from probe.cache.perf import heap
from probe.capture.consumers import rows as consumers
from probe.capture.engine import assemble, deferred, lean, steps
from probe.capture.hooks import watch

PARTS = [
    (steps.StepTrace, "_begin", "step begin (a full step: a fresh tracer)"),
    (steps.StepTrace, "_end", "step end (a full step: naming; every step: assembly)"),
    (assemble.Assembler, "add", "  of it: the assembly"),
    (watch.Watcher, "_pre", "full step: module pre-hooks"),
    (watch.Watcher, "_post", "full step: module post-hooks"),
    (consumers.KeepRows, "sdpa", "full step: rows recomputed from SDPA"),
    (consumers.KeepTopK, "sdpa", "full step: top-k recomputed from SDPA"),
    (lean.LeanStep, "pre", "lean step: pre-hooks"),
    (lean.LeanStep, "post", "lean step: post-hooks (the fields)"),
    (lean, "decode_row", "lean step: the row from q and cached K (a row that cannot wait)"),
    (deferred.Deferred, "flush", "lean steps: waiting rows computed (every 64 steps)"),
    (heap, "trim", "heap trim (whole patterns kept apart: every 16 steps)"),
]


def _timed(spent: collections.Counter, owner, name: str, label: str) -> None:
    f = getattr(owner, name)

    def wrapper(*a, **k):
        t0 = time.process_time()
        try:
            return f(*a, **k)
        finally:
            spent[label] += time.process_time() - t0

    setattr(owner, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--keep", choices=("rows", "topk", "patterns"), default="rows")
    p.add_argument("--model", choices=("llama", "smollm2"), default="llama")
    a = p.parse_args()
    torch.set_num_threads(1)
    model, ids = setup(a.prompt, a.new, "cpu", a.model)
    for mode in ("plain", a.keep):
        run_mode(mode, model, ids[:, :16], 8)  # warm-up
    spent: collections.Counter = collections.Counter()
    for owner, name, label in PARTS:
        _timed(spent, owner, name, label)
    t0 = time.process_time()
    run_mode("plain", model, ids, a.new)
    plain = time.process_time() - t0
    spent.clear()
    t0 = time.process_time()
    out = run_mode(a.keep, model, ids, a.new)
    took = time.process_time() - t0
    lean_steps = out.cache.metadata["steps"].get("lean", 0)
    n = a.new
    print(f"{a.model}, prompt {a.prompt}, {n} new tokens, keep={a.keep}, one torch thread, CPU seconds")
    print(f"plain {plain:.2f} s ({plain / n * 1e3:.2f} ms a step); probe {took:.2f} s: {took / plain:.2f}x")
    print(f"lean steps {lean_steps} of {out.cache.metadata['steps']['forwards']} forwards")
    print(f"probe's extra {(took - plain) / n * 1e3:.2f} ms a step, of it:")
    for label, s in spent.most_common():
        print(f"  {label:52} {s:7.2f} s {s / n * 1e3:7.3f} ms a step")


if __name__ == "__main__":
    main()
