"""Benchmark: a long generation captured in bounded memory (issue 31).

The model is a Hugging Face ``LlamaForCausalLM`` with random weights from a small config (4 layers,
4 heads over 2 key/value heads, d_model 256, rotary positions), batch 1, its own ``generate``
with the dynamic KV cache, greedy, ``min_new_tokens`` forcing the full length. Modes:

* ``plain``: ``model.generate(...)`` alone;
* ``rows``: ``probe.generate(..., keep="rows")``: every step's row over every key kept
  (``[1, heads, N, T]`` per layer: the result itself, its size is the ``kept`` column);
* ``stats``: ``probe.generate(..., keep="stats")``: each head's statistics of the sequence read;
* ``topk``: ``probe.generate(..., keep={"topk": 8})``;
* ``eager``: what users do without probe: ``generate(output_attentions=True,
  return_dict_in_generate=True)`` on a twin of the model on eager attention (same weights);
* ``patterns`` (only when named in ``--modes``: ``T x T`` per head): ``probe.generate(...)``, whole patterns.

``--model smollm2``: SmolLM2-135M-Instruct (``models.load("smollm2")``, 30 layers, real weights)
instead of the random Llama.

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
MODES = ("plain", "rows", "topk", "stats", "eager")
ALL = (*MODES, "patterns")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def setup(prompt: int, new: int, device: str, model_name: str = "llama"):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if model_name == "smollm2":  # the real 30-layer model (9 heads over 3 key/value heads, 576 wide)
        import models

        model = models.load("smollm2").eval().to(device)
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(prompt)
        return model, torch.randint(2, vocab, (1, prompt), generator=gen).to(device)
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


def _eager(model):
    """A twin of ``model`` (same weights) on eager attention, made once."""
    import copy

    twin = getattr(model, "_bench_eager", None)
    if twin is None:
        twin = copy.deepcopy(model)
        twin.set_attn_implementation("eager")
        object.__setattr__(model, "_bench_eager", twin.eval())
    return twin


def run_mode(mode: str, model, ids, new: int):
    import torch

    import probe

    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}
    with torch.no_grad():
        if mode == "plain":
            return model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        if mode == "eager":
            out = _eager(model).generate(
                ids,
                attention_mask=torch.ones_like(ids),
                output_attentions=True,
                return_dict_in_generate=True,
                **kw,
            )
            return out
        keep = {"rows": "rows", "stats": "stats", "topk": {"topk": 8}, "patterns": None}[mode]
        return probe.generate(model, ids, keep=keep, **kw)


def _kept_bytes(out) -> int:
    steps = getattr(out, "attentions", None)
    if steps is not None:  # eager generate: one tuple of per-layer weights per step
        return sum(a.numel() * a.element_size() for step in steps for a in step)
    cache = getattr(out, "cache", None)
    if cache is None:
        return 0
    return sum(cache[k].numel() * cache[k].element_size() for k in cache.keys() if "attn" in k)


def child_memory(mode: str, prompt: int, new: int, device: str, model_name: str) -> dict:
    """One mode in this (fresh) process: its peak memory above the loaded, warmed-up model."""
    import torch

    model, ids = setup(prompt, new, device, model_name)
    if mode == "eager":
        _eager(model)  # the twin's weights are the model's, loaded before the baseline
    run_mode(mode, model, ids[:, :16], 8)  # warm-up: imports, kernels, allocator
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    out = run_mode(mode, model, ids, new)
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _status("VmHWM") - base
    return {"mode": mode, "peak": peak, "kept": _kept_bytes(out)}


def child_time(
    prompt: int, new: int, device: str, repeats: int, model_name: str, modes: list[str], clock: str
) -> dict:
    """Every mode, interleaved, ``repeats`` times: seconds per run (``clock``: ``wall``, or
    ``cpu``, this process's CPU seconds over all its threads: steadier on a shared machine)."""
    import torch

    now = time.perf_counter if clock == "wall" else time.process_time
    model, ids = setup(prompt, new, device, model_name)
    for mode in modes:
        run_mode(mode, model, ids[:, :16], 8)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(repeats):
        for mode in modes:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = now()
            out = run_mode(mode, model, ids, new)
            if device == "cuda":
                torch.cuda.synchronize()
            times[mode].append(now() - t0)
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
    p.add_argument(
        "--model", choices=("llama", "smollm2"), default="llama", help="the random Llama, or SmolLM2-135M"
    )
    p.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(ALL)} (plain first)"
    )
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time by the wall clock, or by the process CPU seconds (steadier on shared cores)",
    )
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = p.parse_args()
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if modes[:1] != ["plain"] or not set(modes) <= set(ALL):
        p.error(f"--modes: plain first, then any of {', '.join(ALL[1:])}")
    if a.child:
        kind, *rest = a.child
        if kind == "memory":
            print(json.dumps(child_memory(rest[0], a.prompt, a.new, a.device, a.model)))
        else:
            print(json.dumps(child_time(a.prompt, a.new, a.device, a.repeats, a.model, modes, a.clock)))
        return
    common = ["--prompt", str(a.prompt), "--new", str(a.new), "--device", a.device, "--model", a.model]
    common += ["--modes", ",".join(modes), "--clock", a.clock]
    mem = {m: _child(["memory", m, *common]) for m in modes}
    times = _child(["time", *common, "--repeats", str(a.repeats)])
    plain_t = statistics.median(times["plain"])
    print(
        f"{a.model}: prompt {a.prompt} tokens, {a.new} new tokens, {a.device}, "
        f"{a.repeats} interleaved repeats, {a.clock} clock"
    )
    print(f"{'mode':8} {'peak MiB':>9} {'above plain':>12} {'kept MiB':>9} {'seconds':>8} {'x plain':>8}")
    for m in modes:
        t = statistics.median(times[m])
        above = (mem[m]["peak"] - mem["plain"]["peak"]) / MiB
        print(
            f"{m:8} {mem[m]['peak'] / MiB:9.1f} {above:12.1f} {mem[m]['kept'] / MiB:9.1f} "
            f"{t:8.2f} {t / plain_t:8.2f}"
        )


if __name__ == "__main__":
    main()
