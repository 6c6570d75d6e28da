"""Compare a model before and after a change: which heads changed, and how.

Captures the zoo's ``minigpt`` ("before") and a changed copy ("after") on the same texts, saves
both caches, and compares them head by head with ``probe.compare``: how far each head's pattern
moved (total variation, Jensen-Shannon, max |Δ|) and how its focus statistics and role changed.
It writes the side-by-side report (both head explorers in step) to ``reports/compare/``.

The change, by default, silences the queries of layer 0, head 1 (its query weights set to zero,
so it attends uniformly to every visible token), the kind of edit a pruning or a fine-tuning
makes. Compare two checkpoints of the model instead with ``--after``:

    python examples/compare_checkpoints.py
    python examples/compare_checkpoints.py --after my-minigpt.safetensors  # a minigpt checkpoint
    probe diff before.safetensors after.safetensors --top 4                # the same from the shell
"""

from __future__ import annotations

import argparse
import copy

import torch

import models
import probe
from models import checkpoint

TEXTS = ["attention lets tokens read.", "graph networks pass notes."]


def changed_copy(model, after: str | None, layer: int = 0, head: int = 1):
    """``model`` with the weights of checkpoint ``after``, or with one head's queries zeroed."""
    twin = copy.deepcopy(model)
    if after is not None:
        state, _ = checkpoint.read(after)
        twin.load_state_dict(state)
        return twin
    with torch.no_grad():
        twin.blocks[layer].attn.heads[head].query.weight.zero_()
    return twin


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--after", default=None, help="a minigpt checkpoint to compare with (default: a head zeroed)"
    )
    args = p.parse_args()

    before = models.load("minigpt")
    after = changed_copy(before, args.after)
    probe.capture(before, TEXTS).save("before.safetensors")
    probe.capture(after, TEXTS).save("after.safetensors")

    c = probe.compare("before.safetensors", "after.safetensors")
    print(c.summary())
    print(c.top(4).select(["layer", "head", "tv", "js", "max_abs", "role_a", "role_b", "d_entropy"]))
    top = c.top(1)[0]
    rows = [r for r in c.stats if (r["layer"], r["head"]) == (top["layer"], top["head"])]
    print(f"layer {top['layer']} head {top['head']}, statistics before -> after:")
    for r in rows:
        if r["metric"] in ("entropy", "confidence", "first", "prev", "distance"):
            print(f"  {r['metric']:<10} {r['a']:.3f} -> {r['b']:.3f}")
    path = probe.report(["before.safetensors", "after.safetensors"], "reports/compare", progress=False)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
