"""Benchmark: a long generation captured in bounded memory (issue 31).

The model is a Hugging Face ``LlamaForCausalLM`` with random weights from a small config (4 layers,
4 heads over 2 key/value heads, d_model 256, rotary positions), batch 1, its own ``generate``
with the dynamic KV cache, greedy, ``min_new_tokens`` forcing the full length. Modes:

* ``plain``: ``model.generate(...)`` alone;
* ``rows``: ``probe.generate(..., keep="rows")``: every step's row over every key kept
  (``[1, heads, N, T]`` per layer: the result itself, its size is the ``kept`` column);
* ``stats``: ``probe.generate(..., keep="stats")``: each head's statistics of the sequence read;
* ``topk``: ``probe.generate(..., keep={"topk": 8})``.

Peak memory: each mode runs in a fresh process (a warm-up generation of 8 tokens first), peak =
``VmHWM`` above the RSS after the model's load and the warm-up (on CUDA: ``max_memory_allocated``
above what was allocated before the run); the ``above plain`` column is a mode's peak less the
plain generation's. Time: another fresh process runs the modes interleaved (plain, rows, stats,
topk, plain, ...) ``--repeats`` times; the ratio is a mode's median over plain's.

Target (issue 31): 2,048+ new tokens from a long prompt, peak above plain < 1 GiB for rows and stats.

    python benchmarks/generation.py                            # prompt 2048, 2048 new tokens
    python benchmarks/generation.py --prompt 64 --new 64 --repeats 1   # a quick check
    python benchmarks/generation.py --device cuda
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
MODES = ("plain", "rows", "stats", "topk")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _setup(prompt: int, new: int, device: str):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=prompt + new + 16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().to(device)
    ids = torch.randint(2, 1000, (1, prompt), generator=torch.Generator().manual_seed(prompt)).to(device)
    return model, ids


def _run(mode: str, model, ids, new: int):
    import torch

    import probe

    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}
    with torch.no_grad():
        if mode == "plain":
            return model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        keep = {"rows": "rows", "stats": "stats", "topk": {"topk": 8}}[mode]
        return probe.generate(model, ids, keep=keep, **kw)


def _kept_bytes(out) -> int:
    cache = getattr(out, "cache", None)
    if cache is None:
        return 0
    return sum(cache[k].numel() * cache[k].element_size() for k in cache.keys() if "attn" in k)


def child_memory(mode: str, prompt: int, new: int, device: str) -> dict:
    """One mode in this (fresh) process: its peak memory above the loaded, warmed-up model."""
    import torch

    model, ids = _setup(prompt, new, device)
    _run(mode, model, ids[:, :16], 8)  # warm-up: imports, kernels, allocator
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    out = _run(mode, model, ids, new)
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _status("VmHWM") - base
    return {"mode": mode, "peak": peak, "kept": _kept_bytes(out)}


def child_time(prompt: int, new: int, device: str, repeats: int) -> dict:
    """Every mode, interleaved, ``repeats`` times: seconds per run."""
    import torch

    model, ids = _setup(prompt, new, device)
    for mode in MODES:
        _run(mode, model, ids[:, :16], 8)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(repeats):
        for mode in MODES:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = _run(mode, model, ids, new)
            if device == "cuda":
                torch.cuda.synchronize()
            times[mode].append(time.perf_counter() - t0)
            del out
            gc.collect()
    return times


def _child(args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    res = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env, cwd=ROOT
    )
    if res.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--new", type=int, default=2048)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        kind, *rest = a.child
        if kind == "memory":
            print(json.dumps(child_memory(rest[0], a.prompt, a.new, a.device)))
        else:
            print(json.dumps(child_time(a.prompt, a.new, a.device, a.repeats)))
        return
    common = ["--prompt", str(a.prompt), "--new", str(a.new), "--device", a.device]
    mem = {m: _child(["memory", m, *common]) for m in MODES}
    times = _child(["time", *common, "--repeats", str(a.repeats)])
    plain_t = statistics.median(times["plain"])
    print(f"prompt {a.prompt} tokens, {a.new} new tokens, {a.device}, {a.repeats} interleaved repeats")
    print(f"{'mode':6} {'peak MiB':>9} {'above plain':>12} {'kept MiB':>9} {'seconds':>8} {'x plain':>8}")
    for m in MODES:
        t = statistics.median(times[m])
        above = (mem[m]["peak"] - mem["plain"]["peak"]) / MiB
        print(
            f"{m:6} {mem[m]['peak'] / MiB:9.1f} {above:12.1f} {mem[m]['kept'] / MiB:9.1f} "
            f"{t:8.2f} {t / plain_t:8.2f}"
        )


if __name__ == "__main__":
    main()
