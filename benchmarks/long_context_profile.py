"""Where the time of ``probe.head_stats(model, ids)`` goes: a cProfile split (issue 34).

One call on the Llama-shaped model at GPT-2-small width with ``--layers`` layers (2) at ``--T``
tokens (2048), profiled, split by the cumulative time of: the block recompute
(``probe/capture/patterns.py`` ``_Scores.blocks``, and where the CPU row loop computes each part
of a block on its own threads, ``_Scores.fill``'s thread-seconds over the threads), the
statistics (``RowTerms.rows`` less the column sums and those parts; with numba, the compiled row
loop's share of it, ``rowfused._tasks``, thread-seconds over the threads), the column sums
(``backends/reference.py`` ``received``, the sink profile) and the reduction with its host copies
(``RowTerms.values``, ``RowTerms.received``); the rest is the model's forward. ``--sort`` hides
numba, so the CPU sorts rows for the span as before the compiled row loop.

    python benchmarks/long_context_profile.py            # the compiled row loop (numba)
    python benchmarks/long_context_profile.py --sort     # the sort path
    python benchmarks/long_context_profile.py --top 20   # also cProfile's own-time listing
    python benchmarks/long_context_profile.py --T 16384 --block 84   # blocks of 84 query rows
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cum(stats: dict, file_end: str, func: str, first_only: bool = False) -> float:
    hits = sorted((line, v[3]) for (f, line, fn), v in stats.items() if f.endswith(file_end) and fn == func)
    if not hits:
        return 0.0
    return hits[0][1] if first_only else sum(v for _, v in hits)


def _time_calls(owner: object, name: str) -> list[float]:
    """Sum the thread-seconds of every call of ``owner.<name>`` on any thread (cProfile sees only
    the main thread): the parts a row loop thread computes (``_Scores.fill``), the compiled row
    loop (``rowfused._tasks``)."""
    spent, lock, fn = [0.0], threading.Lock(), getattr(owner, name)

    def timed(*a, **k):
        t = time.perf_counter()
        fn(*a, **k)
        with lock:
            spent[0] += time.perf_counter() - t

    setattr(owner, name, timed)
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sort", action="store_true", help="hide numba: the span by sorting rows")
    ap.add_argument("--block", type=int, default=None, help="query rows per block (head_stats' block=)")
    ap.add_argument("--top", type=int, default=0, help="print cProfile's own-time listing too")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    import probe
    from models.llama import VOCAB, build
    from probe.analysis.focus.backends.rowloop import rowfused
    from probe.analysis.focus.backends.rowloop.workers import threads

    if a.sort:
        rowfused.numba = None
    model = build(n_layers=a.layers, n_heads=12, d_model=768)
    ids = torch.randint(0, VOCAB, (1, a.T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # warm-up (and numba's compile) at 64 tokens
        model(ids[:, :64])
    probe.head_stats(model, ids[:, :64])
    from probe.capture import patterns

    filled = _time_calls(patterns._Scores, "fill")
    looped = _time_calls(rowfused, "_tasks") if rowfused.available() else [0.0]
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    probe.head_stats(model, ids, block=a.block)
    pr.disable()
    total = time.perf_counter() - t0
    st = pstats.Stats(pr).stats
    # blocks computed whole on the main thread, plus (the row loop filling each part on its own
    # threads, which cProfile does not see) the fills' thread-seconds over the threads
    rec = _cum(st, "capture/patterns.py", "blocks") + filled[0] / threads()
    rows = _cum(st, "focus/streamed/reader.py", "rows", first_only=True)  # RowTerms.rows, not _Candidates'
    rows -= filled[0] / threads()  # the parts' recompute inside the row loop
    col = _cum(st, "focus/backends/reference.py", "received")
    host = _cum(st, "focus/streamed/reader.py", "values") + _cum(st, "focus/streamed/reader.py", "received")
    if a.top:
        pstats.Stats(pr).sort_stats("tottime").print_stats(a.top)
    path = "sort" if a.sort else "row loop"
    print(
        f"{path}: total {total:.2f} s  recompute {rec:.2f}  statistics {rows - col:.2f}  "
        f"column sums {col:.2f}  reduce+host copies {host:.2f}  model forward and rest "
        f"{total - rec - rows - host:.2f}"
    )
    if looped[0]:
        k = threads()
        print(f"  of the statistics, the compiled row loop {looped[0] / k:.2f} s (thread-seconds / {k})")


if __name__ == "__main__":
    main()
