"""The sink profile of a long context: how much attention each key position receives.

Attention sinks (Xiao et al. 2024) are the first few positions of a long text soaking up a large
share of every query's attention. This script runs the Llama-shaped model of ``models/llama.py``
(rotary positions, so any length) on T random tokens and computes every head's statistics with
``probe.head_stats(model, ids)``: one forward, the weights recomputed a block of query rows at a
time and dropped, so no T x T pattern is ever held. It prints, per layer, the attention the first
key receives (averaged over queries and heads) against a key in the middle, how far the heads read
(``reach90``: 90% of a query's mass lies within that many tokens), and plots the profile.

    python examples/sink_profile.py                    # T = 4096, a 4-layer model: ~10 s on 2 cores
    python examples/sink_profile.py --length 16384 --layers 12 --heads 12 --width 768

The weights are random, so the profile is what causal averaging alone gives (a query at i spreads
over i + 1 keys, so early keys are seen by more queries); a trained model's sinks stand far above
it. Swap in your own model: any model ``probe.capture`` reads works with ``probe.head_stats``.
"""

from __future__ import annotations

import argparse

import torch

import probe
from models.llama import VOCAB, build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=4096, help="tokens in the context (T)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--width", type=int, default=256, help="d_model")
    ap.add_argument("--out", default="sink_profile.png", help="where the plot goes")
    a = ap.parse_args()

    model = build(n_layers=a.layers, n_heads=a.heads, d_model=a.width, seed=0)
    ids = torch.randint(0, VOCAB, (1, a.length), generator=torch.Generator().manual_seed(0))
    stats = probe.head_stats(model, ids)

    mid = a.length // 2
    print(f"T = {a.length}: attention each key receives, mean over queries and heads")
    for layer in range(a.layers):
        profile = stats.sink_profile(layer)  # [heads, T]
        reach = stats.map("reach90")[layer].mean()
        first, middle = profile[:, 0].mean(), profile[:, mid].mean()
        print(
            f"layer {layer}: key 0 receives {first:.5f}, key {mid} {middle:.5f}"
            f"; 90% of the mass within {reach:.0f} tokens"
        )
    first = stats.map("first")
    layer, head = divmod(int(first.argmax()), first.shape[1])
    print(f"strongest sink head: layer {layer} head {head} (first-token mass {first.max():.4f})")
    print(f"not computed: {', '.join(stats.not_computed)}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for layer in range(a.layers):
        ax.loglog(range(1, a.length + 1), stats.sink_profile(layer).mean(0), label=f"layer {layer}")
    ax.set_xlabel("key position + 1")
    ax.set_ylabel("mean attention received")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=100)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
