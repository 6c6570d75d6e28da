"""Benchmark: ``probe serve`` page times, the per-text store's size, and a large store simulated.

Four steps, each its own command (the corpus runs take long on two CPU cores: run them first):

    python benchmarks/serve.py texts --model minigpt -n 10000 -o runs/minigpt.txt
    python benchmarks/serve.py texts --model smollm2 -n 2000 -o runs/smollm2.txt
    probe corpus --model minigpt --texts runs/minigpt.txt -o runs/minigpt -q
    probe corpus --model smollm2 --texts runs/smollm2.txt -o runs/smollm2 -q
    python benchmarks/serve.py sizes runs/smollm2            # bytes per text and head, per file kind
    python benchmarks/serve.py pages runs/smollm2            # every page kind over HTTP, ms
    python benchmarks/serve.py simulate -n 1000000 --layers 2 --heads 4 -o /tmp/sim   # a synthetic store

``texts`` writes local texts, one per line, made without a download: for minigpt, windows and
shuffles of its own training sentences (its 22 characters, at most 32 of them); for other models,
paragraphs of the docstrings of Python's standard library (read from its source files with
``ast``, nothing imported), cut to about 60 words, every fourth one a span said twice (the
repeated tokens an induction head reads).

``pages`` starts ``probe serve RUN --port 0`` as a subprocess and times GET requests from this
process (HTTP included, the server warmed by one pass): the grid for several statistics, head
pages of random heads for kept and not-kept statistics, text pages, searches; median, 95th
percentile and largest per kind, and the server's mean CPU time per page (from /proc: what the
page costs whatever else loads the machine). The target is every page under 200 ms.

``simulate`` writes a store of ``-n`` texts with random values in the layout a run writes (the
same schema and row groups, ``--shard-size`` texts per shard) and times the app's queries on it
in process (wall and CPU time), so the cost of a 1M-text run's queries can be read without
capturing a million texts; run again on the same ``-o`` with the same sizes, it only times.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import statistics
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


# -- texts -------------------------------------------------------------------------------------------
def minigpt_texts(n: int, seed: int = 0) -> list[str]:
    """Windows (12-32 characters) of minigpt's training sentences, and shuffles of their words."""
    sys.path.insert(0, str(ROOT))
    from models.minigpt import CORPUS

    rng = random.Random(seed)
    words = sorted(set(CORPUS.replace(".", " .").split()))
    out = []
    for i in range(n):
        if i % 3:
            a = rng.randrange(len(CORPUS) - 32)
            out.append(CORPUS[a : a + rng.randint(12, 32)].strip() or "attention")
        else:
            out.append(" ".join(rng.sample(words, 4))[:32].strip())
    return out


def docstring_texts(n: int, seed: int = 0, words: int = 60) -> list[str]:
    """Paragraphs of the standard library's docstrings (read with ``ast``), ~``words`` words each;
    every fourth text is a span of ~20 words said twice."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    paragraphs: list[str] = []
    for path in sorted(lib.glob("*.py")) + sorted(lib.glob("*/*.py")):
        if "test" in path.parts[-2:][0] or "site-packages" in str(path):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                for p in re.split(r"\n\s*\n", doc or ""):
                    p = " ".join(p.split())
                    if len(p.split()) >= 12 and not p.startswith(">>>"):
                        paragraphs.append(p)
        if len(paragraphs) > 4 * n:
            break
    rng = random.Random(seed)
    rng.shuffle(paragraphs)
    out = []
    for i, p in enumerate(paragraphs[:n]):
        w = p.split()
        if i % 4 == 3:
            span = w[:20]
            out.append(" ".join(span + span))
        else:
            out.append(" ".join(w[:words]))
    if len(out) < n:
        raise SystemExit(f"only {len(out)} paragraphs in the standard library's docstrings")
    return out


def cmd_texts(args) -> None:
    texts = minigpt_texts(args.n) if args.model == "minigpt" else docstring_texts(args.n)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("\n".join(texts) + "\n", encoding="utf-8")
    print(f"wrote {len(texts):,} texts to {args.output}")


# -- sizes -------------------------------------------------------------------------------------------
def cmd_sizes(args) -> None:
    run = Path(args.run)
    manifest = json.loads((run / "manifest.json").read_text())
    heads = len(json.loads((run / "head_stats.json").read_text())["rows"])
    n_ok, n = manifest["n_ok"], manifest["n_texts"]
    print(f"{run}: {n:,} texts ({n_ok:,} captured), {heads} heads, {manifest['n_shards']} shards")
    total = 0
    for kind, per in (("heads", n_ok * heads), ("texts", n), ("examples", heads)):
        size = sum(p.stat().st_size for p in run.glob(f"shards/*.{kind}.parquet"))
        total += size
        unit = {"heads": "per text and head", "texts": "per text", "examples": "per head"}[kind]
        print(f"  {kind:9s} {size / 2**20:8.1f} MiB  {size / max(per, 1):8.1f} B {unit}")
    records = sum(p.stat().st_size for p in run.glob("shards/*.json"))
    print(f"  store    {total / 2**20:8.1f} MiB ({total / max(n_ok, 1) / 1024:.1f} KiB per text); "
          f"shard records {records / 2**20:.1f} MiB")  # fmt: skip


# -- pages -------------------------------------------------------------------------------------------
def _urls(run: Path, rng: random.Random) -> dict[str, list[str]]:
    cfg = json.loads((run / "config.json").read_text())
    rows = json.loads((run / "head_stats.json").read_text())["rows"]
    heads = [(r["stack"], r["kind"], r["layer"], r["head"]) for r in rows]
    kept = (cfg.get("examples") or {}).get("stats") or ["first"]
    n = cfg["n_texts"]
    out: dict[str, list[str]] = {
        "grid": [f"/?stat={s}" for s in ("first", "induction_score", "entropy", "prev")]
    }
    out["head (kept examples)"] = [
        "/head/{}/{}/{}/{}?stat={}".format(*rng.choice(heads), rng.choice(kept)) for _ in range(8)
    ]
    out["head (other statistic)"] = [
        "/head/{}/{}/{}/{}?stat=reach90".format(*rng.choice(heads)) for _ in range(4)
    ]
    out["text"] = [f"/text/{rng.randrange(n)}?stat=first" for _ in range(8)]
    out["search"] = ["/search?q=the", "/search?q=L1H2", "/search?q=induction", "/search?q=attention"]
    return out


def _get(url: str) -> float:
    t = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as r:
        r.read()
        if r.status != 200:
            raise SystemExit(f"{url}: HTTP {r.status}")
    return (time.perf_counter() - t) * 1000


def _cpu_ms(pid: int) -> float:
    """CPU time (user + system, every thread) process ``pid`` has used, in ms (Linux /proc;
    NaN elsewhere): the server's own work per page, whatever else loads the machine."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def cmd_pages(args) -> None:
    run = Path(args.run)
    cmd = [sys.executable, "-m", "probe", "serve", str(run), "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        base = re.search(r"(http://\S+)/ ", proc.stdout.readline()).group(1)
        urls = _urls(run, random.Random(0))
        for u in (u for us in urls.values() for u in us):  # warm: each page once
            _get(base + u)
        print(f"{run}: ms per page over HTTP ({args.rounds} rounds; load average {os.getloadavg()[0]:.1f})")
        print(f"{'page':24s} {'median':>7s} {'p95':>7s} {'max':>7s} {'server CPU':>10s}")
        worst = 0.0
        for kind, us in urls.items():
            cpu = _cpu_ms(proc.pid)
            t = sorted(_get(base + u) for _ in range(args.rounds) for u in us)
            cpu = (_cpu_ms(proc.pid) - cpu) / len(t)  # mean per page (the clock ticks at 10 ms)
            p95 = t[min(len(t) - 1, int(0.95 * len(t)))]
            worst = max(worst, t[-1])
            print(f"{kind:24s} {statistics.median(t):7.1f} {p95:7.1f} {t[-1]:7.1f} {cpu:10.1f}")
        print(f"slowest page: {worst:.0f} ms ({'within' if worst < 200 else 'OVER'} 200 ms)")
    finally:
        proc.terminate()
        proc.wait()


# -- simulate ----------------------------------------------------------------------------------------
def cmd_simulate(args) -> None:
    sys.path.insert(0, str(ROOT))
    from simulate_store import simulate, time_queries  # benchmarks/simulate_store.py

    out = Path(args.output)
    t = time.perf_counter()
    m = out / "manifest.json"
    old = json.loads(m.read_text())["config"] if m.is_file() else None
    same = {"model": {"name": "simulated"}, "n_texts": args.n, "shard_size": args.shard_size}
    heads = len(json.loads((out / "head_stats.json").read_text())["rows"]) if old else 0
    reuse = bool(old) and all(old.get(k) == v for k, v in same.items()) and heads == args.layers * args.heads
    if reuse:
        print(f"{out} holds this simulated store: timing it again")
    else:
        simulate(out, args.n, args.layers, args.heads, args.shard_size, seed=0)
    size = sum(p.stat().st_size for p in out.glob("shards/*.parquet"))
    rows = args.n * args.layers * args.heads
    shards = -(-args.n // args.shard_size)
    took = "written before" if reuse else f"written in {time.perf_counter() - t:.0f} s"
    print(f"{args.n:,} texts x {args.layers * args.heads} heads ({rows:,} rows) in {shards:,} shards: "
          f"{size / 2**30:.2f} GiB, {size / rows:.1f} B per text and head ({took})")  # fmt: skip
    time_queries(out, args.rounds)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("texts", help="write the benchmark's texts")
    t.add_argument("--model", default="minigpt")
    t.add_argument("-n", type=int, default=10000)
    t.add_argument("-o", "--output", required=True)
    t.set_defaults(func=cmd_texts)
    s = sub.add_parser("sizes", help="the store's size per text and head")
    s.add_argument("run")
    s.set_defaults(func=cmd_sizes)
    g = sub.add_parser("pages", help="time every page kind of probe serve")
    g.add_argument("run")
    g.add_argument("--rounds", type=int, default=5)
    g.set_defaults(func=cmd_pages)
    m = sub.add_parser("simulate", help="a synthetic store of n texts, and its query times")
    m.add_argument("-n", type=int, default=1_000_000)
    m.add_argument("--layers", type=int, default=2)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--shard-size", type=int, default=4096)
    m.add_argument("--rounds", type=int, default=5)
    m.add_argument("-o", "--output", required=True)
    m.set_defaults(func=cmd_simulate)
    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
