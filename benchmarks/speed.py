"""Benchmark: capture as users run it, against the plain forward and the peers, in one process.

What it runs (batch 1, random seeded weights, the torch thread count of the machine):

* models: the Hugging Face ``GPT2LMHeadModel`` (GPT-2-small-shaped, LM head included, default
  ``sdpa`` attention) and the bare GPT-2-small-shaped SDPA module (``gpt2_shaped.py``);
* modes: ``plain`` (the model's forward under ``torch.no_grad()``, the baseline), ``memory``
  (``probe.capture(model, ids)``), ``stream`` (``probe.capture(model, ids, out=path)`` on the
  local disk); for the HF model also the peers: ``hf-eager`` (a second object on eager,
  ``output_attentions=True``), ``tl`` (TransformerLens ``run_with_cache``) and ``nnsight``
  (nnsight tracing the eager model and saving every layer's attention weights);
* warm: every mode run once, then ``--repeats`` rounds that time all modes back to back in a
  rotating order; each row reports the median time, the median and spread (min-max) of the
  per-round ratio to ``plain``, the median minor page faults of one call, and the peak RSS of
  one call above the RSS before it (``VmHWM`` reset before each call);
* cold: the first capture in a fresh process (after one untimed plain forward, so only
  probe's first-call costs are counted), as a ratio to a plain forward timed in that process;
* allocators: glibc's default, and ``nofault`` (``MALLOC_MMAP_MAX_=0
  MALLOC_TRIM_THRESHOLD_=1000000000000``: freed memory is kept, so repeated captures do not
  page-fault): compute alone. Each setting runs in its own child process (glibc reads these
  variables at start-up);
* memory release: RSS right after ``del cache`` (no ``gc.collect()``) minus RSS before the
  capture, in MB;
* device: ``--device cuda`` (the default when a GPU is present) runs the models on the GPU,
  synchronizing before each clock read; peak and released memory are then the GPU's
  (``torch.cuda.max_memory_allocated`` / ``memory_allocated``), the fault counts the host's.

    python benchmarks/speed.py                                   # the README tables
    python benchmarks/speed.py --lengths 128 --repeats 2 --models bare --no-peers   # quick
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from capture import _reset_hwm  # noqa: E402
from capture import _vm_hwm as _hwm  # noqa: E402

NOFAULT = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "1000000000000"}
ALLOCATORS = {"default": {}, "nofault": NOFAULT}


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# -- what runs in a child ------------------------------------------------------------------------
class Bench:
    """The models and modes of one child process."""

    def __init__(self, model: str, peers: bool, device: str = "cpu") -> None:
        import torch

        self.torch = torch
        self.name = model
        self.device = torch.device(device)
        self.models: dict[str, object] = {}
        if model == "bare":
            import gpt2_shaped

            self.models["plain"] = gpt2_shaped.build(n_positions=2048).to(self.device)
            self.modes = ["plain", "memory", "stream"]
        else:
            import peers as p

            base = p.gpt2("sdpa", n_positions=2048).to(self.device)  # the peers share its weights
            self.models["plain"] = base
            self.modes = ["plain", "memory", "stream"]
            if peers:
                self.models["eager"] = p.build("eager", base)
                self.modes.append("hf-eager")
                if p.TransformerBridge is not None and self.device.type == "cpu":  # booted on the CPU
                    self.models["tl"] = p.build("tl", base)
                    self.modes.append("tl")
                try:
                    from nnsight import NNsight

                    self.models["nnsight"] = NNsight(p.gpt2("eager", like=base, n_positions=2048))
                    self.modes.append("nnsight")
                except ImportError:
                    pass
        self.tmp = Path(tempfile.mkdtemp(prefix="probe-speed-"))

    def ids(self, T: int):
        g = self.torch.Generator().manual_seed(T)
        return self.torch.randint(0, 50257, (1, T), generator=g).to(self.device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def reset_peak(self) -> int:
        """Reset the peak-memory counter; returns the memory in use now (bytes)."""
        if self.device.type == "cuda":
            self.torch.cuda.reset_peak_memory_stats()
            return self.torch.cuda.memory_allocated()
        _reset_hwm()
        return _rss()

    def peak(self) -> int:
        return self.torch.cuda.max_memory_allocated() if self.device.type == "cuda" else _hwm()

    def in_use(self) -> int:
        return self.torch.cuda.memory_allocated() if self.device.type == "cuda" else _rss()

    def run(self, mode: str, ids) -> None:
        import probe

        torch = self.torch
        base = self.models["plain"]
        with torch.no_grad():
            if mode == "plain":
                base(ids)
            elif mode == "memory":
                cache = probe.capture(base, ids)
                del cache
            elif mode == "stream":
                out = self.tmp / "c.safetensors"
                cache = probe.capture(base, ids, out=out)
                del cache
                out.unlink()
            elif mode == "hf-eager":
                self.models["eager"](input_ids=ids, output_attentions=True)
            elif mode == "tl":
                self.models["tl"].run_with_cache(ids)
            elif mode == "nnsight":
                from nnsight_run import saved_attention

                saved_attention(self.models["nnsight"], ids)

    def release(self, ids) -> float:
        """MB of RSS still held right after ``del cache`` (no gc.collect), vs before the capture."""
        import probe

        gc.collect()
        before = self.in_use()
        cache = probe.capture(self.models["plain"], ids)
        del cache
        return (self.in_use() - before) / 2**20


def child_warm(args: argparse.Namespace) -> None:
    bench = Bench(args.model, not args.no_peers, args.device)
    for T in args.lengths:
        ids = bench.ids(T)
        for mode in bench.modes:  # warm-up: lazy imports, first-call costs
            bench.run(mode, ids)
        times = {m: [] for m in bench.modes}
        faults = {m: [] for m in bench.modes}
        peaks = {m: [] for m in bench.modes}
        ratios = {m: [] for m in bench.modes}
        for r in range(args.repeats):
            k = r % len(bench.modes)
            order = bench.modes[k:] + bench.modes[:k]
            took = {}
            for mode in order:
                gc.collect()
                bench.sync()
                rss0, f0 = bench.reset_peak(), _minflt()
                t0 = time.perf_counter()
                bench.run(mode, ids)
                bench.sync()
                took[mode] = time.perf_counter() - t0
                faults[mode].append(_minflt() - f0)
                peaks[mode].append((bench.peak() - rss0) / 2**20)
            for mode in bench.modes:
                times[mode].append(took[mode])
                ratios[mode].append(took[mode] / took["plain"])
        released = bench.release(ids)
        for mode in bench.modes:
            row = {
                "model": args.model,
                "device": args.device,
                "alloc": args.alloc,
                "T": T,
                "mode": mode,
                "warm": True,
                "median_s": statistics.median(times[mode]),
                "ratio": statistics.median(ratios[mode]),
                "ratio_min": min(ratios[mode]),
                "ratio_max": max(ratios[mode]),
                "faults": statistics.median(faults[mode]),
                "peak_mb": statistics.median(peaks[mode]),
                "released_mb": released if mode == "memory" else None,
            }
            print(json.dumps(row), flush=True)


def child_cold(args: argparse.Namespace) -> None:
    bench = Bench(args.model, peers=False, device=args.device)
    T = args.lengths[0]
    ids = bench.ids(T)
    bench.run("plain", ids)  # the model's own first-call costs are not probe's
    bench.sync()
    t0 = time.perf_counter()
    bench.run("plain", ids)
    bench.sync()
    plain = time.perf_counter() - t0
    f0 = _minflt()
    t0 = time.perf_counter()
    bench.run(args.cold_mode, ids)
    bench.sync()
    took = time.perf_counter() - t0
    row = {
        "model": args.model,
        "device": args.device,
        "alloc": args.alloc,
        "T": T,
        "mode": args.cold_mode,
        "warm": False,
        "median_s": took,
        "ratio": took / plain,
        "faults": _minflt() - f0,
    }
    print(json.dumps(row), flush=True)


# -- the parent ----------------------------------------------------------------------------------
def spawn(args: argparse.Namespace, alloc: str, model: str, extra: list[str]) -> list[dict]:
    env = {**os.environ, **ALLOCATORS[alloc]}
    cmd = [sys.executable, __file__, "--child", "--alloc", alloc, "--model", model, "--device", args.device]
    cmd += extra
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"child {cmd} failed:\n{r.stderr[-3000:]}")
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def table(rows: list[dict]) -> str:
    out = [
        "| model | device | allocator | T | mode | median s | × plain (median, min-max) | minor faults | "
        "peak above start MB | memory after `del cache` MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        spread = f"{r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
        rel = "-" if r.get("released_mb") is None else f"{r['released_mb']:+.0f}"
        out.append(
            f"| {r['model']} | {r['device']} | {r['alloc']} | {r['T']} | {r['mode']} | {r['median_s']:.3f} | "
            f"{spread} | "
            f"{r['faults']:.0f} | {r['peak_mb']:.0f} | {rel} |"
        )
    return "\n".join(out)


def cold_table(rows: list[dict]) -> str:
    out = [
        "| model | device | allocator | T | mode | first call s | × plain | minor faults |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['device']} | {r['alloc']} | {r['T']} | {r['mode']} | {r['median_s']:.3f} | "
            f"{r['ratio']:.2f} | {r['faults']:.0f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=["hf", "bare"], choices=["hf", "bare"])
    ap.add_argument("--allocators", nargs="+", default=["default", "nofault"], choices=list(ALLOCATORS))
    ap.add_argument("--no-peers", action="store_true", help="skip HF eager, TransformerLens, nnsight")
    ap.add_argument("--no-cold", action="store_true", help="skip the first-capture-in-a-fresh-process rows")
    ap.add_argument(
        "--device", default="auto", help="cpu, cuda, or auto (cuda when a GPU is present; the default)"
    )
    ap.add_argument("--json", help="also write every row to this JSON file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--alloc", default="default", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="hf", help=argparse.SUPPRESS)
    ap.add_argument("--cold-mode", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        return child_cold(args) if args.cold_mode else child_warm(args)

    import probe

    print(
        f"torch {torch.__version__}, probe {probe.__version__}, device {args.device}, "
        f"{torch.get_num_threads()} threads, "
        f"{args.repeats} interleaved rounds; ratios are medians of per-round ratios to plain\n"
    )
    warm, cold = [], []
    for model in args.models:
        for alloc in args.allocators:
            lengths = [str(T) for T in args.lengths]
            if not lengths:
                continue
            extra = ["--lengths", *lengths, "--repeats", str(args.repeats)]
            if args.no_peers or alloc != "default":
                extra.append("--no-peers")
            rows = spawn(args, alloc, model, extra)
            warm += rows
            print(table(rows), "\n", flush=True)
            if not args.no_cold and alloc == "default":
                for T in lengths:
                    for mode in ("memory", "stream"):
                        cold += spawn(args, alloc, model, ["--lengths", T, "--cold-mode", mode])
    if cold:
        print("Cold: the first capture in a fresh process\n")
        print(cold_table(cold))
    if args.json:
        Path(args.json).write_text(json.dumps({"warm": warm, "cold": cold}, indent=1))


if __name__ == "__main__":
    main()
