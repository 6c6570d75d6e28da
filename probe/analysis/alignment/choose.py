"""Selections of (layer, head), the hard links of each, their gold scores, and the chosen one.

A *selection* is a ``(layer, head)`` pair where either may be :data:`MEAN` (averaged over heads, or
over layers and heads). :func:`align <probe.analysis.alignment.core.align>` runs these steps: every
selection's links and shape statistics (:func:`links_and_stats`), with gold their AER
(:func:`gold_scores`), then the selection it reports (:func:`choose`).
"""

from __future__ import annotations

from typing import Any

import torch

from probe.analysis.alignment.gold import Gold, Links
from probe.analysis.alignment.metrics import scores, shape_stats, symmetrize
from probe.analysis.alignment.words import Words
from probe.analysis.table import Table
from probe.errors import ProbeError

CONVENTIONS = ("input", "output")
MEAN = "mean"


def hard_links(M: torch.Tensor, method: str = "argmax", threshold: float = 0.1) -> Links:
    """Links ``(source word, target word)`` of one soft word matrix ``M`` [target, source]."""
    if M.numel() == 0:
        return set()
    if method == "argmax":
        best, sums = M.argmax(-1).tolist(), M.sum(-1).tolist()
        return {(i, j) for j, i in enumerate(best) if sums[j] > 0}  # a word with no row: no link
    if method == "threshold":
        return {(int(i), int(j)) for j, i in (M >= threshold).nonzero().tolist()}
    raise ProbeError(f"method {method!r} is unknown here; use argmax or threshold")


def select(soft: torch.Tensor, layer: Any, head: Any, layers: list[int]) -> torch.Tensor:
    """The [target, source] matrix of (layer, head) from [L, H, T, S]; MEAN averages."""
    x = soft.mean(0) if layer == MEAN else soft[layers.index(layer)]
    return x.mean(0) if head == MEAN else x[head]


def selections(layers: list[int], n_heads: int) -> list[tuple[Any, Any]]:
    """Every (layer, head) and (layer, MEAN), then (MEAN, MEAN)."""
    sel = [(layer, h) for layer in layers for h in [*range(n_heads), MEAN]]
    return sel + [(MEAN, MEAN)]


def links_of(
    soft: list[torch.Tensor],
    sel: tuple[Any, Any],
    layers: list[int],
    method: str,
    threshold: float,
    rev: tuple[list[int], list[torch.Tensor]] | None,
) -> list[Links]:
    """The hard links of selection ``sel`` for every pair (``soft[b]``: [L, H, T, S]).

    ``rev`` (reverse layers, reverse soft matrices) is needed by the symmetrizing methods; a
    selection the reverse model lacks falls back to its (MEAN, MEAN).
    """
    out = []
    for b, s in enumerate(soft):
        M = select(s, sel[0], sel[1], layers)
        if method in ("argmax", "threshold"):
            out.append(hard_links(M, method, threshold))
            continue
        r_layers, r_soft = rev
        fits = sel[0] in r_layers + [MEAN] and (sel[1] == MEAN or sel[1] < r_soft[b].shape[1])
        r_sel = sel if fits else (MEAN, MEAN)
        back = {(i, j) for j, i in hard_links(select(r_soft[b], *r_sel, r_layers), "argmax")}
        out.append(symmetrize(hard_links(M, "argmax"), back, method))
    return out


def links_and_stats(soft, layers, valid, method, threshold, rev, little):
    """``(all_links, stats)``: links per (convention, layer, head), and their shape statistics Table."""
    all_links: dict[tuple, list[Links]] = {}
    stat_rows = []
    for conv in CONVENTIONS:
        for sel in valid:
            all_links[(conv, *sel)] = L = links_of(soft[conv], sel, layers, method, threshold, rev)
            mats = [select(s, *sel, layers) for s in soft[conv]]
            stat_rows.append(
                {"convention": conv, "layer": sel[0], "head": sel[1], **shape_stats(L, mats, little=little)}
            )
    return all_links, Table(stat_rows, title="alignment shape per layer and head (no gold needed)")


def check_gold(gold: list[Gold], src: list[Words], tgt: list[Words]) -> None:
    """Raise a ProbeError if ``gold`` does not fit the pairs (line count, word indices)."""
    if len(gold) != len(src):
        raise ProbeError(f"the gold has {len(gold)} lines but the cache holds {len(src)} sentence pairs")
    for b, (g, s, t) in enumerate(zip(gold, src, tgt, strict=True)):
        for i, j in g.possible:
            if i >= len(s) or j >= len(t):
                raise ProbeError(
                    f"gold line {b + 1}: link {i}-{j} is outside the pair's {len(s)} source x "
                    f"{len(t)} target words (0-indexed; use --one-indexed / one_indexed=True if "
                    "the file counts from 1)"
                )


def gold_scores(golds: list[Gold], all_links, prefer: str) -> tuple[list[dict], Table, dict | None]:
    """``(rows, table, best)``: AER/precision/recall per selection, and the lowest-AER one
    (ties go to convention ``prefer``); ``best`` is None when no selection has an AER."""
    rows = [
        {"convention": c, "layer": lay, "head": hd, **scores(L, golds)}
        for (c, lay, hd), L in all_links.items()
    ]
    table = Table(rows, title="alignment error rate per layer and head")
    ranked = [r for r in rows if r["aer"] == r["aer"]]
    best = None
    if ranked:
        b = min(ranked, key=lambda r: (r["aer"], r["convention"] != prefer))
        best = {k: b[k] for k in ("convention", "layer", "head", "aer", "precision", "recall")}
    return rows, table, best


def choose(layer, head, convention, rows, best, layers, n_heads, valid) -> tuple[Any, Any, str]:
    """``(layer, head, convention)`` to report: the given ones, else the lowest AER (under
    ``convention`` if given), else the mean over heads of the penultimate layer."""
    chosen_conv = convention or "input"
    if layer is None and best is not None:
        want = convention or best["convention"]
        b = min((r for r in rows if r["convention"] == want and r["aer"] == r["aer"]), key=lambda r: r["aer"])
        layer, head, chosen_conv = b["layer"], b["head"], b["convention"]
    elif layer is None:
        layer, head = (layers[-2] if len(layers) > 1 else layers[0]), MEAN
    head = MEAN if head is None else head
    if (layer, head) not in valid:
        raise ProbeError(
            f"layer {layer!r} head {head!r} is not in the cache: decoder layers {layers}, heads "
            f"0..{n_heads - 1}, or 'mean'"
        )
    return layer, head, chosen_conv
