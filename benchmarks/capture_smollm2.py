"""Benchmark: what capturing SmolLM2-135M (30 layers, the zoo's ``smollm2``) costs against its forward.

    python benchmarks/capture_smollm2.py                      # 80 and 512 tokens, 15 rounds
    python benchmarks/capture_smollm2.py --lengths 80 --repeats 5 --modes plain capture

The model is ``models.load("smollm2")`` (transformers ``LlamaForCausalLM`` on its default sdpa
attention, real weights, float32, batch 1) and the input an English text cut to exactly T tokens.
Modes, each one call:

* ``plain``: ``model(ids)`` under ``torch.no_grad()`` on the text's token ids (the baseline);
* ``capture``: ``probe.capture(model, text)``, whole patterns and residual deltas kept in memory
  (the text tokenized inside, as users call it); after the warm-up's first two captures it runs
  with their plan (``probe/capture/engine/planned.py``), as every later capture of the model does,
  in the memory the previous capture's dropped cache handed on (``probe/cache/perf/pool.py``);
* ``full``: the same with plans off (``OPTIONS.planned_capture = False``): the full tracer, what a
  model's first capture on a kind of input costs;
* ``stats``: ``probe.capture(model, text, keep="stats")``.

``--clock cpu`` times each call by the process's CPU time instead of the wall clock (on a busy
machine the wall clock counts the time other processes ran; with ``--threads 1`` CPU time is
the one thread's work); ``--threads`` sets torch's thread count (default: torch's).

Every mode runs once to warm up, then ``--repeats`` rounds each time all modes back to back in a
rotating order (the machine's speed drifts); it prints each mode's median and the median (and
min-max) of the per-round ratio to ``plain``. The torch thread count is the machine's; say the
machine's load beside the numbers (the two-core test machine is shared).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import models  # noqa: E402
import probe  # noqa: E402
from probe.cache.perf import using  # noqa: E402

MODES = ("plain", "capture", "full", "stats")
SENTENCES = (
    "The river rose through the night, and by morning the old bridge at the edge of town was gone.",
    "Mary handed John the map, and John folded it into his coat before anyone could ask.",
    "Attention lets every token read the tokens before it, weighting each by how well they match.",
    "In the market the traders argued about the price of salt, wool and the new copper coins.",
    "She wrote the numbers twice, 4096 and 1024, then crossed out the second and began again.",
)


def text_of(tokenizer, T: int) -> str:
    """An English text whose encoding is exactly ``T`` tokens (sentences repeated, then cut)."""
    words: list[str] = []
    i = 0
    while len(tokenizer.encode(" ".join(words))) < T + 8:
        words.extend(SENTENCES[i % len(SENTENCES)].split())
        i += 1
    while len(tokenizer.encode(" ".join(words))) > T:
        words.pop()
    text = " ".join(words)
    pad = ["again", "and", "so", "on", "then", "a", "the"]
    while len(tokenizer.encode(text)) < T:  # words are whole, so top up with one-token words
        text += " " + pad[len(text) % len(pad)]
    if len(tokenizer.encode(text)) != T:
        raise SystemExit(f"could not make a text of exactly {T} tokens")
    return text


def run(mode: str, model, text: str, ids: torch.Tensor) -> None:
    if mode == "plain":
        with torch.no_grad():
            model(ids)
    elif mode == "full":
        with using(planned_capture=False):
            cache = probe.capture(model, text)
        del cache
    else:
        cache = probe.capture(model, text, keep="stats" if mode == "stats" else None)
        del cache


def bench(
    model, T: int, modes: tuple[str, ...], repeats: int, clock=time.perf_counter
) -> dict[str, tuple[float, float, float, float]]:
    """{mode: (median s, median ratio to plain, min ratio, max ratio)} over interleaved rounds."""
    text = text_of(model.tokenizer, T)
    ids = torch.tensor([model.tokenizer.encode(text)])
    for mode in modes:  # warm-up: lazy imports, first-call set-up, a capture's plan learnt (two captures)
        for _ in range(1 if mode == "plain" else 3):
            run(mode, model, text, ids)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(repeats):
        k = r % len(modes)
        for mode in modes[k:] + modes[:k]:
            gc.collect()
            t0 = clock()
            run(mode, model, text, ids)
            times[mode].append(clock() - t0)
    out = {}
    for m in modes:
        ratios = [a / b for a, b in zip(times[m], times["plain"], strict=True)]
        out[m] = (statistics.median(times[m]), statistics.median(ratios), min(ratios), max(ratios))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[80, 512])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    modes = tuple(dict.fromkeys(["plain", *args.modes]))
    model = models.load("smollm2")
    print(f"$ python benchmarks/capture_smollm2.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{os.getloadavg()[0]:.2f} at start, {args.repeats} interleaved rounds, {args.clock} clock, medians\n"
    )
    print("| T | mode | median s | × plain (median of rounds) | min-max |")
    print("|---|---|---|---|---|")
    for T in args.lengths:
        for m, (s, r, lo, hi) in bench(model, T, modes, args.repeats, clock).items():
            print(f"| {T} | {m} | {s:.4f} | {r:.3f} | {lo:.2f}-{hi:.2f} |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
