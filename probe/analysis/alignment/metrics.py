"""Alignment quality: against gold links (AER, precision, recall) and without gold (shape).

With gold, counts are summed over the corpus before dividing (the standard corpus-level AER of
Och & Ney 2003, with S ⊆ P)::

    precision = |A∩P| / |A|      recall = |A∩S| / |S|      AER = 1 − (|A∩S| + |A∩P|) / (|A| + |S|)

Without gold, :func:`shape_stats` describes the hard links A and the soft word matrix M
(rows: target words, columns: source words, entries: attention mass):

* diagonality: mean over links of 1 − |(i+½)/n_src − (j+½)/n_tgt| (1 = on the diagonal);
* monotonicity: Kendall τ-b between target and source positions of the links, per sentence,
  averaged over sentences with at least two distinct positions on both sides (1 = monotone);
* coverage: the share of source words with at least one link; ``low_mass``: the share of source
  words whose column of M sums to less than ``little`` (read by no target word: under-translation);
* entropy: mean over target words of the entropy (nats) of their row of M renormalised to 1;
* jumps: mean over consecutive target words of |Δ mean linked source position − 1|
  (0 for a word-by-word monotone alignment).
"""

from __future__ import annotations

import math

import torch

from probe.analysis.alignment.gold import Gold, Links

NEIGHBOURS = ((-1, 0), (0, -1), (1, 0), (0, 1), (-1, -1), (-1, 1), (1, -1), (1, 1))


def counts(links: list[Links], gold: list[Gold]) -> tuple[int, int, int, int]:
    """(|A|, |S|, |A∩S|, |A∩P|) summed over sentence pairs."""
    a = s = a_s = a_p = 0
    for A, g in zip(links, gold, strict=True):
        a += len(A)
        s += len(g.sure)
        a_s += len(A & g.sure)
        a_p += len(A & g.possible)
    return a, s, a_s, a_p


def scores(links: list[Links], gold: list[Gold]) -> dict[str, float]:
    """``{"aer", "precision", "recall"}`` of ``links`` against ``gold`` (corpus level; NaN if undefined)."""
    a, s, a_s, a_p = counts(links, gold)
    nan = float("nan")
    return {
        "aer": 1.0 - (a_s + a_p) / (a + s) if a + s else nan,
        "precision": a_p / a if a else nan,
        "recall": a_s / s if s else nan,
    }


def kendall_tau_b(x: list[float], y: list[float]) -> float:
    """Kendall's τ-b of two equally long sequences (NaN when either is constant)."""
    conc = disc = tx = ty = 0
    n = len(x)
    for a in range(n):
        for b in range(a + 1, n):
            dx, dy = x[a] - x[b], y[a] - y[b]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tx += 1
            elif dy == 0:
                ty += 1
            elif (dx > 0) == (dy > 0):
                conc += 1
            else:
                disc += 1
    denom = math.sqrt((conc + disc + tx) * (conc + disc + ty))
    return (conc - disc) / denom if denom else float("nan")


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def shape_stats(links: list[Links], soft: list[torch.Tensor], *, little: float = 0.1) -> dict[str, float]:
    """Gold-free statistics of ``links`` and soft word matrices ``soft`` (each (n_tgt, n_src))."""
    diag, mono, cov, low, ent, jumps = [], [], [], [], [], []
    for A, M in zip(links, soft, strict=True):
        n_tgt, n_src = M.shape
        if n_src == 0 or n_tgt == 0:
            continue
        diag += [1 - abs((i + 0.5) / n_src - (j + 0.5) / n_tgt) for i, j in A]
        if A:
            mono.append(kendall_tau_b([j for _, j in A], [i for i, _ in A]))
        cov.append(len({i for i, _ in A}) / n_src)
        low.append(float((M.sum(0) < little).float().mean()))
        P = M / M.sum(-1, keepdim=True).clamp(min=1e-12)
        ent += (-(P * P.clamp(min=1e-12).log()).sum(-1)).tolist()
        pos = [_mean([i for i, jj in A if jj == j]) for j in range(n_tgt)]
        pos = [p for p in pos if not math.isnan(p)]
        jumps += [abs(b - a - 1) for a, b in zip(pos, pos[1:], strict=False)]
    return {
        "diagonality": _mean(diag),
        "monotonicity": _mean(mono),
        "coverage": _mean(cov),
        "low_mass": _mean(low),
        "entropy": _mean(ent),
        "jumps": _mean(jumps),
    }


def symmetrize(forward: Links, backward: Links, method: str) -> Links:
    """Combine source→target ``forward`` and (already transposed) ``backward`` links by
    ``intersect``, ``union`` or ``grow-diag-final`` (Koehn et al. 2003)."""
    if method == "intersect":
        return forward & backward
    if method == "union":
        return forward | backward
    union = forward | backward
    A = forward & backward
    grew = True
    while grew:  # grow-diag: add union neighbours of links that align a still-unaligned word
        grew = False
        for i, j in sorted(A):
            for di, dj in NEIGHBOURS:
                cand = (i + di, j + dj)
                if cand in union and cand not in A:
                    src_free = all(a != cand[0] for a, _ in A)
                    tgt_free = all(b != cand[1] for _, b in A)
                    if src_free or tgt_free:
                        A.add(cand)
                        grew = True
    for direction in (forward, backward):  # final: any link of a direction that aligns a free word
        for i, j in sorted(direction):
            if all(a != i for a, _ in A) or all(b != j for _, b in A):
                A.add((i, j))
    return A
