"""Benchmark: every head's statistics at long context in bounded memory (issue 21).

The model is ``models/llama.py`` at GPT-2-small width (12 layers, 12 heads, d_model 768, rotary
positions, random weights), batch 1. Two modes at each length T:

* ``plain``: the model's own forward (``torch.no_grad()``, SDPA), nothing else;
* ``stats``: ``probe.head_stats(model, ids)``: the same forward with every focus statistic
  computed block by block as the weights are recomputed (no T x T pattern is ever held).

Peak memory: each mode runs in a fresh process (a warm-up at T = 64 first), peak = ``VmHWM`` above
the RSS after the model's load and the warm-up (on CUDA: ``max_memory_allocated`` above what was
allocated before the run). Time: another fresh process per length runs the modes interleaved
(plain, stats, plain, stats, ...) ``--repeats`` times; the ratio is the median of ``stats`` over
the median of ``plain``. Where T <= ``--check-up-to`` (2048), a third process checks that the
statistics equal ``probe.head_stats(probe.capture(model, ids))`` and reports the largest
difference over every metric (relative above 1).

A third mode, ``weights``, runs the same forward recomputing every block of weights and computing
nothing from them: the floor of the block path, since SDPA returns no weights (the table's
``floor`` column, as a ratio to ``plain``). On CUDA a fourth, ``stats_fused``, times the fused kernel
(``PROBE_FUSED=1``: every statistic from tiles of q and k, the weights never written; see
``probe/analysis/focus/backends/kernels/qkkernel.py``) in the same loop, against ``stats``, the default block
path
(the ``fused`` column, as a ratio to ``plain``).

Targets (issue 21): at T = 16,384 peak <= plain + 1 GiB and time <= 1.5 x plain.

    python benchmarks/long_context.py                           # T = 1024, 4096, 16384
    python benchmarks/long_context.py --lengths 256 512 --repeats 1
    python benchmarks/long_context.py --device cuda --lengths 16384
    python benchmarks/long_context.py --device cuda --no-fused      # the default GPU path only
    python benchmarks/long_context.py --report 16384 /tmp/report16k   # the report of a 16k stats cache
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
WIDTH = {"n_layers": 12, "n_heads": 12, "d_model": 768}


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _setup(T: int, device: str, width: dict):
    import torch

    sys.path.insert(0, str(ROOT))
    from models.llama import VOCAB, build

    model = build(**width).to(device)
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(T)).to(device)
    return model, ids


def _run(mode: str, model, ids) -> None:
    import torch

    import probe

    with torch.no_grad():
        if mode == "plain":
            out = model(ids)
            del out
        elif mode == "weights":  # the floor: every block of weights recomputed, nothing computed from it
            from probe.forward import stream_attention

            stream_attention(model, ids, lambda meta, role, shape: _Drop())
        elif mode == "stats_fused":  # the fused kernel from q and k tiles (opt-in: PROBE_FUSED=1)
            os.environ["PROBE_FUSED"] = "1"
            try:
                probe.head_stats(model, ids)
            finally:
                os.environ.pop("PROBE_FUSED", None)
        else:
            probe.head_stats(model, ids)
    if ids.device.type == "cuda":
        torch.cuda.synchronize()


class _Drop:
    """A block reader that reads nothing (the ``weights`` mode)."""

    def rows(self, start, end, block) -> None:
        pass

    def close(self):
        return None


def child_peak(mode: str, T: int, device: str, width: dict) -> dict:
    import torch

    model, ids = _setup(T, device, width)
    _run(mode, model, ids[:, :64])
    gc.collect()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    _run(mode, model, ids)
    peak = torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")
    return {"mode": mode, "T": T, "peak_mib": (peak - base) / MiB}


def child_time(T: int, device: str, width: dict, repeats: int, fused: bool = True) -> dict:
    model, ids = _setup(T, device, width)
    # on a GPU the fused kernel (never writes the weights) and the previous block path, interleaved
    modes = (
        ("plain", "weights", "stats", "stats_fused")
        if device.startswith("cuda") and fused
        else ("plain", "weights", "stats")
    )
    for mode in modes:
        _run(mode, model, ids[:, :64])
    _run("plain", model, ids)  # the first full-length forward pays for cold memory: not timed
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(repeats):
        for mode in modes:
            t0 = time.perf_counter()
            _run(mode, model, ids)
            times[mode].append(time.perf_counter() - t0)
    return {"T": T, **{f"{m}_s": statistics.median(v) for m, v in times.items()}}


def child_check(T: int, device: str, width: dict) -> dict:
    import probe

    model, ids = _setup(T, device, width)
    streamed = probe.head_stats(model, ids)
    full = probe.head_stats(probe.capture(model, ids), progress=False)
    worst, where = 0.0, None
    for a, b in zip(streamed.table, full.table, strict=True):
        for c, v in a.items():
            w = b[c]
            if isinstance(v, float) and not (math.isnan(v) and math.isnan(w)):
                d = abs(v - w) / max(1.0, abs(w))
                if d > worst:
                    worst, where = d, c
    return {"T": T, "max_rel_diff": worst, "worst_column": where}


def child_report(T: int, device: str, width: dict, out: str) -> dict:
    """Capture ``keep="stats"`` at ``T`` tokens, write the report, open it in headless Chromium."""
    import probe

    model, ids = _setup(T, device, width)
    t0 = time.perf_counter()
    cache = probe.capture(model, ids, keep="stats")
    t1 = time.perf_counter()
    path = probe.report(cache, out, progress=False)
    t2 = time.perf_counter()
    row = {"T": T, "capture_s": t1 - t0, "report_s": t2 - t1, "html_mib": Path(path).stat().st_size / MiB}
    try:
        from probe.report.browser import browser, open_report
    except ImportError as e:  # playwright is an optional extra
        return {**row, "opened": f"not checked ({e})"}
    with browser() as b:
        page, log = open_report(b, path)
        problems = log.errors + [m for m in log.console if m[0] in ("error", "warning")]
        heads = page.locator("h2").all_text_contents()
    return {
        **row,
        "opened": "no errors" if not problems else f"{len(problems)} errors: {problems[:3]}",
        "sections": heads,
    }


def _child(*args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (same code path)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timing runs per mode")
    ap.add_argument(
        "--check-up-to", type=int, default=2048, help="compare with the full patterns up to this T"
    )
    ap.add_argument("--width", default=None, help=argparse.SUPPRESS)  # json: a smaller model, for smoke runs
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--no-fused", action="store_true", help="on CUDA, leave the opt-in fused kernel out")
    ap.add_argument(
        "--report",
        nargs=2,
        metavar=("T", "DIR"),
        help="instead: capture keep='stats' at T tokens, write the report to DIR and open it in Chromium",
    )
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    width = json.loads(a.width) if a.width else WIDTH
    if a.child:
        kind, T = a.child[0], int(a.child[1])
        if kind == "peak":
            row = child_peak(a.child[2], T, a.device, width)
        elif kind == "report":
            row = child_report(T, a.device, width, a.child[2])
        elif kind == "time":
            row = child_time(T, a.device, width, a.repeats, fused=not a.no_fused)
        else:
            row = child_check(T, a.device, width)
        print(json.dumps(row))
        return
    common = ["--device", a.device, "--repeats", str(a.repeats), "--width", json.dumps(width)]
    common += ["--no-fused"] if a.no_fused else []
    if a.report:
        print(json.dumps(_child("report", a.report[0], a.report[1], *common), indent=1))
        return
    rows = []
    for T in a.lengths:
        peaks = {m: _child("peak", str(T), m, *common)["peak_mib"] for m in ("plain", "stats")}
        t = _child("time", str(T), *common)
        row = {
            "T": T,
            "plain_s": t["plain_s"],
            "stats_s": t["stats_s"],
            "time_ratio": t["stats_s"] / t["plain_s"],
            "weights_ratio": t["weights_s"] / t["plain_s"],
            "fused_ratio": t["stats_fused_s"] / t["plain_s"] if "stats_fused_s" in t else None,
            "plain_peak_mib": peaks["plain"],
            "stats_peak_mib": peaks["stats"],
            "extra_mib": peaks["stats"] - peaks["plain"],
            "max_rel_diff": _child("check", str(T), *common)["max_rel_diff"] if T <= a.check_up_to else None,
        }
        row["meets_targets"] = row["time_ratio"] <= 1.5 and row["extra_mib"] <= 1024
        rows.append(row)
        if not a.json:
            _print_row(row, first=len(rows) == 1, device=a.device, width=width)
    if a.json:
        print(json.dumps(rows, indent=1))


def _print_row(r: dict, *, first: bool, device: str, width: dict) -> None:
    if first:
        print(
            f"Llama-shaped {WIDTH}, batch 1, {device}; targets: time <= 1.5x plain, peak <= plain + 1024 MiB"
        )
        print(
            f"{'T':>6} {'plain s':>9} {'stats s':>9} {'ratio':>6} {'floor':>6} {'fused':>6} "
            f"{'plain MiB':>10} {'stats MiB':>10} {'extra MiB':>10} {'max diff':>9} targets"
        )
    diff = "-" if r["max_rel_diff"] is None else f"{r['max_rel_diff']:.1e}"
    fused = "-" if r["fused_ratio"] is None else f"{r['fused_ratio']:.2f}"
    print(
        f"{r['T']:>6} {r['plain_s']:>9.2f} {r['stats_s']:>9.2f} {r['time_ratio']:>6.2f} "
        f"{r['weights_ratio']:>6.2f} {fused:>6} "
        f"{r['plain_peak_mib']:>10.0f} {r['stats_peak_mib']:>10.0f} {r['extra_mib']:>10.0f} "
        f"{diff:>9} {'met' if r['meets_targets'] else 'missed'}",
        flush=True,
    )


if __name__ == "__main__":
    main()
