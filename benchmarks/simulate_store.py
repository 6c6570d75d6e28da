"""A synthetic corpus run's store, written by the store's own writer, and the app's page times on it.

Used by ``python benchmarks/serve.py simulate`` (see there). Each shard's rows go through
:class:`probe.corpus.store.ShardRows` and the merged statistics through a real
:class:`~probe.analysis.focus.accumulator.FocusAccumulator`, so the files have the layout, schema,
row groups and compression of a real run; only the values are random (uniform in [0, 1], a tenth
of them NaN) and each text is ten made-up tokens.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from probe.analysis.focus.accumulator import FocusAccumulator
from probe.analysis.focus.definitions.table import METRICS
from probe.corpus.store import ShardRows
from probe.files import write_text_atomic


def simulate(out: Path, n: int, layers: int, heads: int, shard_size: int, seed: int = 0) -> None:
    """Write a finished run of ``n`` texts through ``layers`` x ``heads`` heads into ``out``."""
    rng = np.random.default_rng(seed)
    (out / "shards").mkdir(parents=True, exist_ok=True)
    acc = FocusAccumulator()
    n_shards = -(-n // shard_size)
    cfg = {"model": {"name": "simulated"}, "n_texts": n, "keep": "stats", "stats": True, "batch_size": 8,
           "shard_size": shard_size, "dtype": None, "store": True, "examples": None}  # fmt: skip
    for s in range(n_shards):
        a, b = s * shard_size, min(n, (s + 1) * shard_size)
        rows = ShardRows(s, a, [f"text {i}: w{i % 97} w{i % 89} w{i % 83}" for i in range(a, b)])
        meta = {"tokens": [[f"w{(i * 7 + t) % 101}" for t in range(10)] for i in range(a, b)]}
        meta["ids"] = [[(i * 7 + t) % 101 for t in range(10)] for i in range(a, b)]
        folds = []
        for layer in range(layers):
            v = rng.random((b - a, heads, len(METRICS)), dtype=np.float32)
            v[rng.random(v.shape) < 0.1] = np.nan
            values = torch.from_numpy(v)
            acc.fold(f"decoder/{layer}/self", values, list(range(heads)), True)
            folds.append((f"decoder/{layer}/self", values, list(range(heads)), True))
        acc.add_texts(b - a)
        rows.add(folds, list(range(b - a)), meta, None)
        rows.write(out)
        rec = {
            "shard": s,
            "start": a,
            "texts": [{"shard": s, "file": None, "row": 0}] * (b - a),
            "files": 0,
            "stats": None,
        }
        write_text_atomic(out / "shards" / f"{s:05d}.json", json.dumps(rec))
    write_text_atomic(out / "config.json", json.dumps(cfg))
    write_text_atomic(out / "stats.json", json.dumps(acc.to_dict()))
    acc.result().to_json(out / "head_stats.json")
    manifest = {"format": "probe-corpus/1", "config": cfg, "n_texts": n, "n_ok": n, "n_failed": 0,
                "n_shards": n_shards, "files": [], "texts": []}  # fmt: skip
    write_text_atomic(out / "manifest.json", json.dumps(manifest))


def time_queries(out: Path, rounds: int) -> None:
    """Each page kind of the app on the store at ``out``, in process (no HTTP): ms per page."""
    from starlette.testclient import TestClient

    from probe.explore.app import create_app
    from probe.explore.data import Explorer

    t = time.perf_counter()
    ex = Explorer(out)
    print(f"opened (every shard's footer read): {(time.perf_counter() - t) * 1000:.0f} ms")
    client = TestClient(create_app(ex))
    rng = random.Random(0)
    heads = sorted(ex.heads)
    n = ex.corpus.manifest["n_texts"]
    pages = {
        "grid": lambda: "/?stat=first",
        "head": lambda: "/head/{}/{}/{}/{}?stat=induction_score".format(*rng.choice(heads)),
        "text": lambda: f"/text/{rng.randrange(n)}?stat=first",
        "search (heads)": lambda: "/search?q=L1H2",
        "search (texts)": lambda: f"/search?q=w{rng.randrange(97)}",
    }
    print(f"{'page':16s} {'median':>8s} {'max':>8s} {'CPU':>8s}  (ms, {rounds} rounds, first round included;")
    print(f"{'':16s} CPU: this process's, every thread, median; load average {os.getloadavg()[0]:.1f})")
    for kind, url in pages.items():
        times, cpu = [], []
        for _ in range(rounds):
            u = url()
            t, c = time.perf_counter(), time.process_time()
            r = client.get(u)
            times.append((time.perf_counter() - t) * 1000)
            cpu.append((time.process_time() - c) * 1000)
            assert r.status_code == 200, (u, r.text[-300:])
        print(f"{kind:16s} {statistics.median(times):8.1f} {max(times):8.1f} {statistics.median(cpu):8.1f}")


__all__ = ["simulate", "time_queries"]
