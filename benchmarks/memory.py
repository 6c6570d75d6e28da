"""Benchmark: where an in-memory capture's memory goes, and what is left after ``del cache``.

Memory only (no timing, so it can run on a busy machine). Each model and mode runs in a fresh
process, as ``benchmarks/capture.py`` measures peaks: a tiny warm-up run, then one run at T with
``VmHWM`` reset before it. Reported per row: the peak above the RSS before the run, the RSS at
the end of each layer and before/after the LM head, and (memory mode) the live tensors before
the LM head counted with ``gc.get_objects()`` (the cache's patterns and residuals vs anything
else). A last row per model: RSS right after ``del cache`` (no ``gc.collect()``) vs before the
capture, after a plain forward, with probe's heap trim on and off.

    python benchmarks/memory.py                   # both models, T = 1024
    python benchmarks/memory.py --models bare --lengths 512
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
MiB = 2**20


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _build(name: str, T: int):
    import torch

    sys.path.insert(0, str(HERE))
    if name == "bare":
        import gpt2_shaped

        m = gpt2_shaped.build(n_positions=max(T, 1024))
        blocks, head = m.h, m.lm_head
    else:
        import peers

        m = peers.gpt2("sdpa", n_positions=max(T, 1024))
        blocks, head = m.transformer.h, m.lm_head
    ids = torch.randint(0, 50257, (1, T), generator=torch.Generator().manual_seed(T))
    return m, ids, blocks, head


def child_peak(name: str, mode: str, T: int) -> dict:
    import torch

    import probe

    m, ids, blocks, head = _build(name, T)
    puts: list[tuple[int, int, int]] = []  # (data_ptr, nbytes, dims) of what the sink received

    def run(x):
        with torch.no_grad():
            if mode == "plain":
                out = m(x)
                del out
            else:
                cache = probe.capture(m, x)
                puts.extend(
                    (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), t.dim())
                    for t in (cache[k] for k in cache.keys())
                )
                del cache

    run(ids[:, :8])
    puts.clear()
    gc.collect()
    marks: list[tuple[str, int]] = []
    live: dict[int, int] = {}

    def before_head(*_):
        marks.append(("before head", _status("VmRSS")))
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor) and not isinstance(o, torch.nn.Parameter):
                live[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()

    for i, blk in enumerate(blocks):
        blk.register_forward_hook(lambda *_, i=i: marks.append((f"L{i}", _status("VmRSS"))))
    head.register_forward_pre_hook(before_head)
    head.register_forward_hook(lambda *_: marks.append(("after head", _status("VmRSS"))))
    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    run(ids)
    row = {
        "model": name,
        "mode": mode,
        "T": T,
        "peak_mib": (_status("VmHWM") - base) / MiB,
        "after_mib": (_status("VmRSS") - base) / MiB,
        "marks": {k: round((v - base) / MiB) for k, v in marks},
    }
    if mode == "memory":
        stored = {p: (n, d) for p, n, d in puts}
        row["patterns_mib"] = sum(n for n, d in stored.values() if d == 4) / MiB
        row["residuals_mib"] = sum(n for n, d in stored.values() if d != 4) / MiB
        row["live_other_mib"] = sum(n for p, n in live.items() if p not in stored) / MiB
    return row


def child_release(name: str, T: int, trim: bool) -> dict:
    import torch

    import probe
    from probe.cache.perf import OPTIONS

    OPTIONS.heap_trim = trim
    m, ids, _, _ = _build(name, T)
    with torch.no_grad():
        probe.capture(m, ids)
        m(ids)
        gc.collect()
        gc.disable()
        before = _status("VmRSS")
        cache = probe.capture(m, ids)
        del cache
        after = _status("VmRSS")
        gc.enable()
    return {"model": name, "T": T, "trim": trim, "after_del_mib": (after - before) / MiB}


def _child(*args: str) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["bare", "hf"], choices=["bare", "hf"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024])
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, name, *rest = a.child
        if kind == "peak":
            row = child_peak(name, rest[0], int(rest[1]))
        else:
            row = child_release(name, int(rest[0]), rest[1] == "on")
        print(json.dumps(row))
        return
    for name in a.models:
        for T in a.lengths:
            plain, mem = (_child("peak", name, mode, str(T)) for mode in ("plain", "memory"))
            peaks = f"plain {plain['peak_mib']:.0f} MiB, memory {mem['peak_mib']:.0f} MiB"
            print(f"{name} T={T}: peak above start: {peaks}")
            print(
                f"  memory - plain = {mem['peak_mib'] - plain['peak_mib']:.0f} MiB; the cache: patterns "
                f"{mem['patterns_mib']:.0f} + residuals {mem['residuals_mib']:.0f} MiB; other live tensors "
                f"before the head {mem['live_other_mib']:.0f} MiB"
            )
            for row in (plain, mem):
                print(
                    f"  RSS above start, {row['mode']}: "
                    + ", ".join(f"{k} {v:+d}" for k, v in row["marks"].items())
                )
            for trim in ("on", "off"):
                r = _child("release", name, str(T), trim)
                print(f"  RSS right after del cache (trim {trim}): {r['after_del_mib']:+.0f} MiB")


if __name__ == "__main__":
    main()
