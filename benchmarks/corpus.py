"""Benchmark: corpus throughput (texts/s) and peak memory, 1 vs 2 processes, 100 vs 1,000 texts.

A GPT-2-small-shaped SDPA decoder (12 layers × 12 heads, d 768, random weights) reads texts of
exactly ``T`` tokens (a word-per-token tokenizer: no tokenizer download) through
``probe.run_corpus`` in two modes:

* ``stats``: statistics only (nothing but shard JSON on disk);
* ``heads``: statistics plus the patterns of layers 0 and 5, heads 0-3, stored in shards.

Each configuration runs in fresh child processes (``torchrun --standalone --nproc_per_node=2``
for 2 processes); throughput is texts / seconds inside ``run_corpus`` (start-up and model build
excluded), peak memory is the largest ``ru_maxrss`` of any child. Memory must stay flat from 100
to 1,000 texts: only one batch of patterns is alive at a time.

    python benchmarks/corpus.py                         # the README rows (100 and 1,000 texts)
    python benchmarks/corpus.py --texts 16 --T 32       # a quick check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))


def _tokenizer(vocab: int = 50257):
    from probe.capture.tokenizers import Encoding, Tokenizer

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


def child(args: argparse.Namespace) -> None:
    import gpt2_shaped
    import torch

    import probe

    torch.manual_seed(0)
    model = gpt2_shaped.build()
    keep = "stats" if args.mode == "stats" else {"layers": [0, 5], "heads": [0, 1, 2, 3]}
    texts = make_texts(args.texts, args.T)
    t0 = time.perf_counter()
    probe.run_corpus(
        model, texts, args.out, tokenizer=_tokenizer(), batch_size=args.batch_size, keep=keep, progress=False
    )
    dt = time.perf_counter() - t0
    if os.environ.get("RANK", "0") == "0":
        Path(args.out, "bench.json").write_text(json.dumps({"seconds": dt}))


def measure(n: int, T: int, mode: str, procs: int, batch_size: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "run"
        me = [str(Path(__file__).resolve()), "--child", "--texts", str(n), "--T", str(T)]
        me += ["--mode", mode, "--out", str(out), "--batch-size", str(batch_size)]
        if procs == 1:
            cmd = [sys.executable, *me]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
            cmd += me
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        subprocess.run(cmd, check=True, env=env)
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
        seconds = json.loads((out / "bench.json").read_text())["seconds"]
        disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {
        "texts": n,
        "T": T,
        "mode": mode,
        "procs": procs,
        "texts_per_s": n / seconds,
        "peak_rss_mib": max(peak, before) / 1024,
        "peak_is_new": peak > before,
        "disk_mib": disk / 2**20,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--texts", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--T", type=int, default=128)
    p.add_argument("--modes", nargs="+", default=["stats", "heads"], choices=["stats", "heads"])
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="stats", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.texts = args.texts[0]
        child(args)
        return
    print(
        f"{'texts':>6} {'T':>5} {'mode':>6} {'procs':>5} {'texts/s':>9} {'peak RSS MiB':>13} {'disk MiB':>9}"
    )
    # ru_maxrss of children is a running maximum: measure the smallest configurations first and
    # read a row's peak as meaningful only when it rose (peak_is_new); fresh runs per row are exact
    for n in sorted(args.texts):
        for mode in args.modes:
            for procs in args.procs:
                r = measure(n, args.T, mode, procs, args.batch_size)
                flag = "" if r["peak_is_new"] else " (≤ an earlier row)"
                print(
                    f"{n:>6} {args.T:>5} {mode:>6} {procs:>5} {r['texts_per_s']:>9.2f} "
                    f"{r['peak_rss_mib']:>13.0f}{flag} {r['disk_mib']:>9.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
