"""Measurement: how far capture is from independent oracles on every architecture of the matrix.

For each family in ``tests/arch_fixtures.py`` (tiny random configs, float32) and each hand-written
shape in ``tests/arch_toys.py`` it captures one forward and prints, as a Markdown table, the max
|deviation| of

* **patterns** against the weights each eager attention module returns (an eager twin with the
  same weights, hooked) or that the toy's attention module kept;
* **deltas** against the sublayer modules' own outputs (forward hooks) for pre-norm, parallel and
  sandwich blocks, or the stream the model itself hands on around a post-norm sublayer;
* **the chain**, ``resid_pre + Σ deltas`` against the layer's own output (its hook).

The comparisons are the test suite's (``tests/test_architectures.py``: ``measure`` and
``toy_deviation``), which asserts them within 1e-5 (patterns) and 1e-6 (deltas, chain). A second
table lists the shapes probe refuses, with the first words of each error. This is a measurement,
not a test: it prints what it finds and fails only if an oracle cannot be computed.

    python benchmarks/architectures.py              # both tables (the README's)
    python benchmarks/architectures.py --only bloom mpt
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import arch_fixtures as A  # noqa: E402
import arch_toys as toys  # noqa: E402
import test_architectures as T  # noqa: E402
import torch  # noqa: E402

import probe  # noqa: E402
from probe.errors import ProbeError  # noqa: E402

TOYS = {
    "baddbmm": ("hand-written `baddbmm`", "scores `[b·h, t, t]`, softmax in float32", toys.baddbmm_lm),
    "moe": (
        "hand-written MoE",
        "router softmax `[b, t, n_experts]`, einsum experts, shared expert",
        toys.moe_lm,
    ),
    "hybrid": (
        "hand-written hybrid",
        "gated-conv mixer layers between attention layers (softmax, SDPA)",
        toys.hybrid_lm,
    ),
}


def _refused() -> dict[str, tuple[str, object]]:
    """Shapes probe refuses: name -> (what it is, a function that captures it)."""

    def toy(build):
        return lambda: probe.capture(build(), torch.tensor([[1, 2, 3, 4, 5]]))

    def hf(model, name):
        return lambda: probe.capture(model(), A.inputs(name, None)["input_ids"])

    return {
        "MoE router, no attention": ("softmax over `[b, t, n_experts]`", toy(toys.router_lm)),
        "MLP LM returning probabilities": ("softmax over the vocabulary", toy(toys.probs_lm)),
        "ALBERT": ("one layer module run for every layer", hf(A.albert, "albert")),
        "Longformer": ("local attention over sliding-window chunks", hf(A.longformer, "longformer")),
    }


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    mantissa, exp = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exp)}"  # 1.5e-8, as the README writes it


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--only", nargs="+", metavar="NAME", help=f"entries to measure (of: {', '.join([*A.ARCHS, *TOYS])})"
    )
    ap.add_argument("--no-errors", action="store_true", help="skip the table of refused shapes")
    args = ap.parse_args(argv)
    names = args.only or [*A.ARCHS, *TOYS]
    unknown = [n for n in names if n not in A.ARCHS and n not in TOYS]
    if unknown:
        ap.error(f"unknown entries {unknown}; choose from {', '.join([*A.ARCHS, *TOYS])}")
    torch.set_grad_enabled(False)
    print("| architecture | what it exercises | patterns | deltas | `pre + Σδ − post` |")
    print("|---|---|---|---|---|")
    worst = {"pattern": 0.0, "delta": 0.0, "resid_pre+deltas-resid_post": 0.0}
    for n in names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if n in TOYS:
                label, about, build = TOYS[n]
                dev = T.toy_deviation(build)
            else:
                label, about = A.ABOUT.get(n, (n, ""))
                dev = T.measure(n)
        worst = {k: max(v, dev[k]) for k, v in worst.items()}
        cells = [_fmt(dev[k]) for k in ("pattern", "delta", "resid_pre+deltas-resid_post")]
        print(f"| {label} | {about} | " + " | ".join(cells) + " |", flush=True)
    print(f"\n{len(names)} entries; max over all: " + ", ".join(f"{k} {_fmt(v)}" for k, v in worst.items()))
    if args.no_errors or args.only:
        return
    print("\n| refused | why | error (first words) |\n|---|---|---|")
    for name, (why, run) in _refused().items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                run()
                msg = "**captured: no error**"
            except ProbeError as e:
                msg = "`" + str(e)[:90] + "…`"
        print(f"| {name} | {why} | {msg} |", flush=True)


if __name__ == "__main__":
    main()
