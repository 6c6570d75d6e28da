"""Align a translation model against gold word alignments.

The zoo's ``aligner`` is a small encoder-decoder trained on generated German-like -> English-like
pairs whose word alignments are known by construction (``models.aligner_data``): verb-second
inversion, verb-final clauses, compounds split into pieces, one word for two. This script
translates held-out pairs with teacher forcing, scores every decoder layer and head against the
gold links (alignment error rate, precision, recall) and writes the best alignment as Pharaoh
lines (``i-j``: source word i, target word j).

    python examples/align_against_gold.py [N_PAIRS]

For your own model: capture its sentence pairs (``probe.capture(model, sources, target=targets,
tokenizer=tok)``) and pass your gold file (``i-j`` sure, ``ipj`` possible) as ``gold=``.
"""

from __future__ import annotations

import sys

import models
import probe
from models import aligner_data


def main(n_pairs: int = 100) -> None:
    _, held_out = aligner_data.split()  # pairs the model never saw in training
    pairs = held_out[:n_pairs]
    model = models.load("aligner")
    cache = probe.capture(
        model,
        [" ".join(p.source) for p in pairs],
        target=["S " + " ".join(p.target) for p in pairs],  # S: the decoder's start token
    )
    gold = "\n".join(p.pharaoh() for p in pairs)  # one line of gold links per pair
    alignment = probe.align(cache, gold=gold)

    scores = alignment.scores.to_pandas()
    out = scores[scores.convention == "output"]  # target word j read where the decoder outputs it
    print("AER by decoder layer (rows) and head (columns), output convention:")
    print(out.pivot(index="layer", columns="head", values="aer").round(3).to_string())
    best = alignment.best
    print(
        f"best: layer {best['layer']}, head {best['head']}, {best['convention']} convention: "
        f"AER {best['aer']:.3f}, precision {best['precision']:.3f}, recall {best['recall']:.3f}"
    )
    first = pairs[0]
    print(f"pair 0: {' '.join(first.source)} -> {' '.join(first.target)}")
    print(f"  gold:  {first.pharaoh()}")
    print(f"  probe: {alignment.pharaoh().splitlines()[0]}")
    with open("alignment.talp", "w") as f:
        f.write(alignment.pharaoh())  # one line per pair
    print(f"wrote alignment.talp ({n_pairs} lines)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
