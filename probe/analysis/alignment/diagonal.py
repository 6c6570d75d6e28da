"""Without gold links, which single heads to look at: the most diagonal alignments, with their links.

The gold-free default of :func:`probe.align` (the mean over the heads of the second-to-last
decoder layer) is a heuristic that can be wrong for a given model; the candidates here let a
reader compare it with the heads whose alignment lies closest to the diagonal. A diagonal
alignment is itself only a hint (word order differs between languages), so this ranks, it does
not choose.
"""

from __future__ import annotations

import math
from typing import Any

from probe.analysis.alignment.core import MEAN, Alignment, hard_links

RANK_BY = ("diagonality", "monotonicity", "coverage")


def candidates(al: Alignment, n: int = 5, pair: int = 0) -> list[dict[str, Any]]:
    """The ``n`` single heads (either convention, every layer) whose alignment is the most
    diagonal over all pairs, ties broken by monotonicity then coverage (a NaN ranks last).

    Each is ``{"convention", "layer", "head", "diagonality", "monotonicity", "coverage",
    "links", "text"}``: ``links`` the argmax links ``(source word, target word)`` of pair ``pair``
    in target order, ``text`` them spelled ``"ich→i, mochte→want"``; ``chosen`` says whether it
    is the alignment's own selection."""
    rows = [r for r in al.stats if r["head"] != MEAN and r["layer"] != MEAN]

    def rank(r: dict) -> tuple:
        return tuple(-(r[k] if not math.isnan(r[k]) else -math.inf) for k in RANK_BY)

    src, tgt = al.source[pair].words, al.target[pair].words
    out = []
    for r in sorted(rows, key=rank)[:n]:
        M = al.matrix(pair, r["layer"], r["head"], r["convention"])
        links = sorted(hard_links(M, "argmax"), key=lambda x: x[1])
        out.append(
            {
                **{k: r[k] for k in ("convention", "layer", "head", *RANK_BY)},
                "links": links,
                "text": ", ".join(f"{src[i]}→{tgt[j]}" for i, j in links),
                "chosen": (r["convention"], r["layer"], r["head"]) == (al.convention, al.layer, al.head),
            }
        )
    return out


HEURISTIC = (
    "without gold links this layer and head are a heuristic, not a measurement: the mean over the "
    "heads of the second-to-last decoder layer, where attention alignments usually peak in trained "
    "translation models; it can be wrong for a given model"
)

__all__ = ["candidates", "HEURISTIC", "RANK_BY"]
