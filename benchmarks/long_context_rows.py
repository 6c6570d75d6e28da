"""The CPU row loop alone, on real blocks of weights: nanoseconds per weight (issue 34).

Runs ``probe.head_stats`` on the Llama-shaped model at GPT-2-small width (``--layers`` layers, 2)
at ``--T`` tokens (4096), keeps two blocks of the last layer as the row loop saw them (the weights
filled in, the words, the key classes, each head's span bin from the block before), then times
``rowfused.row_terms`` on them again, already computed (no recompute), on one thread and on
``torch.get_num_threads()`` threads, alternating, the median of ``--repeats``. Where the loop
took each row's softmax itself (the CPU's SDPA blocks), the block is kept as the scores it was
handed and each run reads a fresh copy of them. ``--root`` imports
probe from another checkout (a ``git worktree`` of an older commit) to compare the loops on the same
blocks:

    python benchmarks/long_context_rows.py
    git worktree add /tmp/old 720bf21 && python benchmarks/long_context_rows.py --root /tmp/old
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--root", default=str(ROOT), help="the checkout to import probe from")
    a = ap.parse_args()
    sys.path.insert(0, a.root)
    import torch

    import probe
    from models.llama import VOCAB, build
    from probe.analysis.focus.backends.rowloop import rowfused

    if not rowfused.available():
        raise SystemExit("the row loop needs numba (pip install -e '.[fast]')")
    model = build(n_layers=a.layers, n_heads=12, d_model=768)
    ids = torch.randint(0, VOCAB, (1, a.T), generator=torch.Generator().manual_seed(0))
    real, kept, calls = rowfused.row_terms, [], [0]
    takes_guesses = "guesses" in real.__code__.co_varnames

    def keep(P, q0, K, cols, first, words=None, colw=None, fill=None, **kw):
        guesses = kw.get("guesses")
        before = None if guesses is None else guesses.copy()
        calls[0] += 1
        scores = torch.empty_like(P) if calls[0] in want and kw.get("keep") is not None else None
        if scores is not None:  # the parts as filled: the scores whose softmax the loop takes
            flat, part = scores.view(-1, *P.shape[-2:]), fill

            def fill(bh, a, b, **how):  # into the loop's buffer (``out``), or the block where older
                part(bh, a, b, **how)
                got = how.get("out", P.view(-1, *P.shape[-2:])[bh, a:b])
                flat[bh, a:b, : got.shape[-1]] = got
                if how.get("trim"):  # is_causal: the keys after each row's query were never masked
                    later = torch.arange(flat.shape[-1]) > torch.arange(q0 + a, q0 + b)[:, None]
                    flat[bh, a:b].masked_fill_(later, float("-inf"))

        got = real(P, q0, K, cols, first, words, colw, fill, **kw)
        if calls[0] in want:
            extra = {k: kw[k] for k in ("keep", "pairs") if kw.get(k) is not None}
            kept.append(
                (P.clone() if scores is None else scores, q0, K, cols, first, words, colw, before, extra)
            )
        return got

    want: tuple[int, ...] = ()
    probe.head_stats(model, ids[:, :64], progress=False)  # numba's compile
    rowfused.row_terms = keep
    probe.head_stats(model, ids, progress=False)  # counts the blocks
    total, calls[0] = calls[0], 0
    want = (total - total // (2 * a.layers), total)  # the middle and the end of the last layer
    probe.head_stats(model, ids, progress=False)
    rowfused.row_terms = real
    n = torch.get_num_threads()
    print(f"probe from {a.root}; T = {a.T}, {n} threads")
    for P, q0, K, cols, first, words, colw, guesses, more in kept:
        X = P.clone()  # the loop takes the softmax of scores in place: each run reads a fresh copy

        def run(X=X, q0=q0, K=K, cols=cols, first=first, words=words, colw=colw, guesses=guesses, more=more):
            extra = {"guesses": None if guesses is None else guesses.copy()} if takes_guesses else {}
            real(X, q0, K, cols, first, words, colw, None, **extra, **more)

        times: dict[int, list[float]] = {1: [], n: []}
        X.copy_(P)
        run()
        for _ in range(a.repeats):
            for k in times:
                torch.set_num_threads(k)
                X.copy_(P)
                t = time.perf_counter()
                run()
                times[k].append(time.perf_counter() - t)
        torch.set_num_threads(n)
        per = {k: statistics.median(v) / P.numel() * 1e9 for k, v in times.items()}
        print(
            f"block {tuple(P.shape)} at query {q0} ({'scores' if 'keep' in more else 'weights'}): "
            f"{per[1]:.2f} ns per weight on 1 thread, {per[n]:.2f} on {n} (wall)"
        )


if __name__ == "__main__":
    main()
