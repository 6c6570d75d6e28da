"""Benchmark: corpus throughput (texts/s) and per-run peak memory, 100 vs 1,000 texts, 1 vs 2 processes.

A GPT-2-small-shaped SDPA decoder (12 layers × 12 heads, d 768, random weights) reads texts of
exactly ``T`` tokens (a word-per-token tokenizer: no tokenizer download) through
``probe.run_corpus`` in two modes:

* ``stats``: statistics only (nothing but shard JSON on disk);
* ``heads``: statistics plus the patterns of layers 0 and 5, heads 0-3, stored in shards.

Every row is its own fresh child process (``torchrun --standalone --nproc_per_node=2`` for 2
processes). Each process reports its own numbers from ``/proc/self/status``: ``VmRSS`` after the
model is built and the texts are made (the baseline; the high-water mark is reset there, so the
build's transient peak does not count) and ``VmHWM`` (its high-water mark) when ``run_corpus``
returns (the peak); with 2 processes a row shows the largest of the ranks' own
numbers. "growth" is peak − baseline, the memory the run itself added: it must stay flat from 100
to 1,000 texts (one batch of patterns is alive at a time). Throughput is texts / seconds inside
``run_corpus`` (start-up and model build excluded; with 2 processes, the slowest rank).

    python benchmarks/corpus.py                         # the README rows (100 and 1,000 texts, T 128)
    python benchmarks/corpus.py --texts 8 16 --T 32     # a quick check that it runs

Output: a Markdown table, one row per run, printed as each run ends.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

KEEP_HEADS = {"layers": [0, 5], "heads": [0, 1, 2, 3]}
LABEL = {"stats": "statistics only", "heads": "heads kept"}


def _tokenizer(vocab: int = 50257):
    from probe.capture.inputs.tokenizers import Encoding, Tokenizer

    class Words(Tokenizer):
        """One token per space-separated word; a word is its id (``w123``)."""

        def encode(self, text: str) -> Encoding:
            ids = [int(w[1:]) % vocab for w in text.split()]
            return Encoding(ids, [f"w{i}" for i in ids], [False] * len(ids))

        def tokens_of(self, ids):
            return [f"w{i}" for i in ids]

        def decode(self, ids):
            return " ".join(f"w{i}" for i in ids)

    return Words()


def make_texts(n: int, T: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(50257)}" for _ in range(T)) for _ in range(n)]


def proc_status_mib() -> dict[str, float]:
    """This process's ``VmRSS`` (now) and ``VmHWM`` (peak so far) in MiB, from /proc/self/status."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) / 1024  # the kernel reports kB (KiB)
    return out


def reset_peak() -> None:
    """Start ``VmHWM`` over at the current RSS (Linux ≥ 4.0), so the peak is the run's, not the
    model build's transient one."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as e:
        raise SystemExit(f"cannot reset the peak RSS (/proc/self/clear_refs: {e}); needs Linux 4.0+") from e


def child(args: argparse.Namespace) -> None:
    import gpt2_shaped
    import torch

    import probe

    torch.manual_seed(0)
    model = gpt2_shaped.build()
    keep = "stats" if args.mode == "stats" else KEEP_HEADS
    texts = make_texts(args.texts, args.T)
    reset_peak()
    base = proc_status_mib()["VmRSS"]
    t0 = time.perf_counter()
    probe.run_corpus(
        model, texts, args.out, tokenizer=_tokenizer(), batch_size=args.batch_size, keep=keep, progress=False
    )
    dt = time.perf_counter() - t0
    peak = proc_status_mib()["VmHWM"]
    rank = os.environ.get("RANK", "0")
    rec = {"seconds": dt, "baseline_mib": base, "peak_mib": peak}
    Path(args.report, f"rank{rank}.json").write_text(json.dumps(rec))


def measure(n: int, T: int, mode: str, procs: int, batch_size: int) -> dict:
    """One fresh run (``procs`` processes); its throughput, memory (max over ranks) and disk."""
    with tempfile.TemporaryDirectory() as d:
        out, report = Path(d) / "run", Path(d) / "report"
        report.mkdir()
        me = [str(Path(__file__).resolve()), "--child", "--texts", str(n), "--T", str(T)]
        me += ["--mode", mode, "--out", str(out), "--report", str(report), "--batch-size", str(batch_size)]
        if procs == 1:
            cmd = [sys.executable, *me]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
            cmd += me
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        if procs > 1:  # what torchrun sets anyway (one thread per rank), said here so it prints no banner
            env["OMP_NUM_THREADS"] = "1"
        subprocess.run(cmd, check=True, env=env)
        ranks = [json.loads(p.read_text()) for p in sorted(report.glob("rank*.json"))]
        if len(ranks) != procs:
            raise RuntimeError(f"expected {procs} rank reports, got {len(ranks)}")
        disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {
        "texts": n,
        "T": T,
        "mode": mode,
        "procs": procs,
        "texts_per_s": n / max(r["seconds"] for r in ranks),
        "baseline_mib": max(r["baseline_mib"] for r in ranks),
        "peak_mib": max(r["peak_mib"] for r in ranks),
        "growth_mib": max(r["peak_mib"] - r["baseline_mib"] for r in ranks),
        "disk_mib": disk / 2**20,
    }


HEADER = (
    "| T | texts | kept | processes | texts/s | RSS after model load MiB | peak RSS MiB | growth MiB "
    "| disk MiB |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def row(r: dict) -> str:
    return (
        f"| {r['T']} | {r['texts']:,} | {LABEL[r['mode']]} | {r['procs']} | {r['texts_per_s']:.2f} | "
        f"{r['baseline_mib']:.0f} | {r['peak_mib']:.0f} | {r['growth_mib']:.0f} | {r['disk_mib']:.1f} |"
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--texts", type=int, nargs="+", default=[100, 1000], help="text counts (default 100 1000)")
    p.add_argument("--T", type=int, nargs="+", default=[128], help="tokens per text (default 128)")
    p.add_argument("--modes", nargs="+", default=["stats", "heads"], choices=["stats", "heads"])
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="processes per run (default 1 2)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--json", default=None, help="also write every row to this JSON file")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="stats", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--report", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.texts, args.T = args.texts[0], args.T[0]
        child(args)
        return
    print(HEADER, flush=True)
    rows = []
    # rows of one mode and process count sit next to each other, 100 then 1,000 texts: flat or not
    # reads straight down the growth column
    for T in args.T:
        for mode in args.modes:
            for procs in args.procs:
                for n in sorted(args.texts):
                    rows.append(measure(n, T, mode, procs, args.batch_size))
                    print(row(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
