"""Word alignment quality: the `aligner` zoo model's attention (per layer and head) vs eflomal.

    python benchmarks/alignment.py              # prints the README table (markdown)
    python benchmarks/alignment.py --pairs 100  # fewer held-out pairs

Both are scored on the same held-out pairs of models.aligner_data (gold links known by
construction), with the same AER code (probe.analysis.alignment.scores). The aligner is captured
through probe in batches and aligned by argmax per target word under both conventions. eflomal
(PyPI `eflomal`, a benchmark-only extra) is trained unsupervised, as statistical aligners are, on
the source/target text of train + held-out pairs, and scored on the held-out ones: forward,
reverse, intersection and grow-diag-final (probe's own symmetrization of its two directions).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time

from probe.analysis.alignment import Gold, parse_gold, scores, symmetrize
from probe.analysis.table import Table


def held_out_caches(pairs, batch: int = 100):
    """The aligner captured on `pairs` (teacher-forced on the gold target), `batch` pairs per cache."""
    import models
    import probe

    model = models.load("aligner")
    out = []
    for k in range(0, len(pairs), batch):
        chunk = pairs[k : k + batch]
        out.append(
            probe.capture(
                model,
                [" ".join(p.source) for p in chunk],
                target=["S " + " ".join(p.target) for p in chunk],
            )
        )
    return out


def aligner_table(pairs, gold) -> Table:
    import probe

    al = probe.align(held_out_caches(pairs), gold=gold)
    return al.scores, al


def eflomal_rows(train, pairs, gold) -> list[dict]:
    """eflomal on train + held-out text, scored on the held-out pairs; [] with a note if missing."""
    try:
        import eflomal
    except ImportError as err:
        print(f"eflomal is not installed ({err}); `pip install -c constraints.txt eflomal`", file=sys.stderr)
        return []
    corpus = pairs + train  # held-out first: its links are the first len(pairs) lines
    src = io.StringIO("\n".join(" ".join(p.source) for p in corpus) + "\n")
    tgt = io.StringIO("\n".join(" ".join(p.target) for p in corpus) + "\n")
    with tempfile.TemporaryDirectory() as d:
        fwd, rev = os.path.join(d, "fwd"), os.path.join(d, "rev")
        t0 = time.perf_counter()
        eflomal.Aligner().align(src, tgt, links_filename_fwd=fwd, links_filename_rev=rev, quiet=True)
        seconds = time.perf_counter() - t0
        f = [g.sure for g in parse_gold(open(fwd).read())[: len(pairs)]]
        r = [g.sure for g in parse_gold(open(rev).read())[: len(pairs)]]
    rows = []
    for name, links in (
        ("forward", f),
        ("reverse", r),
        ("intersect", [symmetrize(a, b, "intersect") for a, b in zip(f, r, strict=True)]),
        ("grow-diag-final", [symmetrize(a, b, "grow-diag-final") for a, b in zip(f, r, strict=True)]),
    ):
        rows.append({"aligner": f"eflomal {name}", **scores(links, gold), "seconds": seconds})
    return rows


def main(argv: list[str] | None = None) -> int:
    from models import aligner_data

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=300, help="held-out pairs to score (default 300)")
    args = ap.parse_args(argv)
    train, held = aligner_data.split()
    held = held[: args.pairs]
    gold = [Gold(p.sure, p.possible) for p in held]

    table, al = aligner_table(held, gold)
    by = {(r["convention"], r["layer"], r["head"]): r["aer"] for r in table}
    heads = list(range(al.n_heads)) + ["mean"]
    print(f"AER on {len(held)} held-out pairs (lower is better; argmax per target word)\n")
    print("| aligner convention | layer | " + " | ".join(f"head {h}" for h in heads) + " |")
    print("|---|---|" + "---|" * len(heads))
    for conv in ("input", "output"):
        for layer in al.layers:
            cells = " | ".join(f"{by[(conv, layer, h)]:.3f}" for h in heads)
            print(f"| {conv} | {layer} | {cells} |")
        print(
            f"| {conv} | mean | "
            + " | ".join([""] * (len(heads) - 1))
            + f" | {by[(conv, 'mean', 'mean')]:.3f} |"
        )
    b = al.best
    print(
        f"\nbest: {b['convention']} convention, layer {b['layer']}, head {b['head']}: AER {b['aer']:.3f} "
        f"(precision {b['precision']:.3f}, recall {b['recall']:.3f})"
    )
    rows = eflomal_rows(train, held, gold)
    if rows:
        print(f"\neflomal (unsupervised, trained on {len(train) + len(held)} pairs' text)\n")
        print("| eflomal | AER | precision | recall |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['aligner'][8:]} | {r['aer']:.3f} | {r['precision']:.3f} | {r['recall']:.3f} |")
        print(f"\n(eflomal took {rows[0]['seconds']:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
