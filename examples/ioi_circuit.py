"""The indirect-object circuit of a real LLM: SmolLM2-135M's faithfulness curve.

"When Mary and John went to the store, John gave a drink to" -> " Mary" (Wang et al. 2022). This
script makes IOI prompts with ``ioi_prompts`` (names, places, objects and templates varied; the
corrupted prompt has the two names swapped), scores every edge of the zoo's ``smollm2`` with
``probe.circuit`` (EAP-IG by default), and runs the model with each greedy circuit, every edge
outside it corrupted: the share of the clean logit difference each size keeps. Then the heads of
the smallest circuit that keeps ``--target`` of it, by their edge to the logits. Minutes on a CPU.

    python examples/ioi_circuit.py                          # 64 prompts, EAP-IG
    python examples/ioi_circuit.py --prompts 16 --method eap --sizes 100,1000 --json ioi.json

For your own model: ``probe.circuit(model, clean, corrupted, answers=...)`` takes any decoder whose
residual stream is the sum of its parts (see docs/circuits.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import models
import probe
from probe.intervene.circuit import ioi_prompts


def curve(c: probe.Circuit, sizes: list[int]):
    """The faithfulness curve of the greedy circuits of ``sizes`` edges, printed."""
    got = c.evaluate(sizes)
    ref = got.references
    print(f"clean logit difference {ref['clean']:.3f}, corrupted {ref['corrupted']:.3f}")
    for r in got.table:
        print(
            f"{r['edges']:6d} edges ({r['share']:6.2%}): kept {r['kept']:.3f} of the clean logit "
            f"difference, faithfulness {r['faithfulness']:.3f}"
        )
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64, help="IOI prompts (default 64)")
    parser.add_argument("--method", default="eap-ig", choices=["eap", "eap-ig"])
    parser.add_argument("--sizes", help="circuit sizes, comma-separated (default: 100 to 10%% of the edges)")
    parser.add_argument("--target", type=float, default=0.8, help="share of the clean logit difference")
    parser.add_argument("--json", help="write the scored graph here (Circuit.from_json reads it)")
    args = parser.parse_args()

    smol = models.load("smollm2")
    ioi = ioi_prompts(args.prompts, smol.tokenizer, seed=0)
    c = probe.circuit(smol, ioi.clean, ioi.corrupted, answers=ioi.answers, method=args.method)
    print(c.summary())
    if args.json:
        Path(args.json).write_text(c.to_json())
    total = c.graph.n_edges
    sizes = (
        [int(s) for s in args.sizes.split(",")] if args.sizes else [100, 300, 1000, total // 20, total // 10]
    )
    got = curve(c, sizes)
    enough = [r["edges"] for r in got.table if r["kept"] >= args.target]
    if not enough:
        print(f"no circuit of these sizes keeps {args.target:.0%} of the clean logit difference")
        return
    sel = c.greedy(min(enough))
    heads = [r for r in sel.table.rows if r["target"] == "logits" and ".H" in r["source"]]
    print(f"the {len(sel)}-edge circuit: {sum('.H' in n for n in sel.nodes)} heads; into the logits:")
    print(", ".join(f"{r['source']} {r['score']:+.2f}" for r in heads[:8]))


if __name__ == "__main__":
    main()
