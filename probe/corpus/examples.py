"""What shows a head at work on one text without its whole pattern: the positions where a statistic is
decided, and the top attention of each.

A statistic of the table is an average over a text's queries (or, for the template scores, a sum
over the queries that have a match). For one text and head, :func:`head_examples` ranks those
queries by their own term (the value each adds to the average: its first-token mass, its
induction mass, its entropy ...) and keeps the ``positions`` that weigh most (``"top"``: the
largest terms; ``"bottom"``: the smallest, where the head does least of its thing). For each it
keeps the ``keys`` keys with the largest weights and, for a template statistic, the keys the
template names (the token after an earlier copy of the query's token for induction, the earlier
copies for duplicate-token, the previous token for the previous-token score): the repeated
tokens the head reads there. Positions are those of the text's own tokens (padding left out).

Bytes per (head, text, statistic): at most ``positions`` x (2 + 2 x ``keys``) numbers of 4 bytes
(8 positions of 6 keys: 448 bytes before compression).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from probe.analysis.focus.definitions.layout import Layout
from probe.analysis.focus.definitions.table import BEYOND
from probe.analysis.focus.definitions.terms import Terms
from probe.analysis.focus.definitions.tokens import side
from probe.analysis.focus.whole.pattern import pattern_terms
from probe.analysis.focus.whole.rows import is_causal
from probe.errors import ProbeError

POSITIONS = 8  # positions kept per (head, text, statistic)
KEYS = 6  # keys kept per position
MASKS = {"special": 0, "punct": 1, "content": 2}
KINDS = {"on_class": 0, "on_register": 1, "on_image": 2}
# the template each template statistic sums over (prev_score: the previous token)
TEMPLATES = {
    "prev_score": "prev",
    "dup_score": "dup",
    "dup_prefix": "dup",
    "dup_matches": "dup",
    "induction_score": "induction",
    "induction_prefix": "induction",
    "induction_matches": "induction",
}


@dataclass
class Example:
    """One head on one text for one statistic: the chosen ``positions`` (token indices), each
    position's ``term``, its top ``keys`` with their ``weights``, and the template's ``targets``."""

    positions: list[int]
    terms: list[float]
    keys: list[list[int]]
    weights: list[list[float]]
    targets: list[list[int]]


def query_terms(stat: str, t: Terms, lay: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(terms [B, h, Q], counted [B, 1 or h, Q])``: each query's term of ``stat`` and the queries
    the statistic is taken over (see the module docstring). ProbeError for a statistic that has
    no per-query term here (a cross-attention's positional statistics, an image metric without
    an image)."""
    counted = lay.counted
    simple = {
        "entropy": lambda: t.ent,
        "norm_entropy": lambda: t.ent / lay.log_n,
        "first": lambda: t.first,
        "span": lambda: t.span,
        "signed_distance": lambda: t.signed,
        "reach90": lambda: t.reach,
        "distance": lambda: -t.signed if lay.causal else t.dist,
        "local": lambda: sum(t.diag[d] for d in t.diag) if t.diag else None,
        "distance_px": lambda: t.dist_px,
        **{f"beyond_{d}": (lambda d=d: t.beyond.get(d)) for d in BEYOND},
        **{m: (lambda c=c: t.masks[..., c]) for m, c in MASKS.items()},
        **{m: (lambda c=c: None if t.kinds is None else t.kinds[..., c]) for m, c in KINDS.items()},
    }
    steps = {"prev": -1, "self": 0, "next": 1}
    if stat == "confidence":
        return t.top, counted & lay.not_end
    if stat in steps or stat.startswith("word_"):
        name = stat.removeprefix("word_")
        if stat.startswith("word_") and t.word is not None:
            return t.word[stat], counted
        if steps[name] in t.diag:
            return t.diag[steps[name]], lay.key_ok(steps[name])
    elif stat in ("pos_offset", "pos_frac"):
        return _on_mode(t, lay), counted
    elif stat in TEMPLATES:
        name = TEMPLATES[stat]
        if t.tmpl is not None and name in t.tmpl:
            hits = lay.q.real if name == "prev" else t.hits[name]
            return t.tmpl[name], hits[:, None, :] & lay.q.real[:, None, :]
    elif stat in simple:
        v = simple[stat]()
        if v is not None:
            return v, counted
    raise ProbeError(f"{stat!r} has no per-query term for this attention; choose another statistic")


def _on_mode(t: Terms, lay: Layout) -> torch.Tensor:
    """1 where a query's strongest key is at the text's most common offset, else 0."""
    B, h, Q = t.arg.shape
    off = t.arg - lay.qi
    K = lay.K
    hist = torch.zeros(B, h, Q + K - 1).scatter_add_(-1, off + (K - 1), lay.counted.float().expand(B, h, Q))
    mode = hist.argmax(-1, keepdim=True) - (K - 1)
    return (off == mode).float()


def _targets(lay: Layout, stat: str) -> dict[tuple[int, int], list[int]]:
    """``(text, query) -> [key, ...]``: the keys the template of ``stat`` names for each query."""
    if stat not in TEMPLATES or lay.q.ids is None or lay.k.ids is None:
        return {}
    b, i, j, _ = lay.templates[TEMPLATES[stat]]
    out: dict[tuple[int, int], list[int]] = {}
    for bb, ii, jj in zip(b.tolist(), i.tolist(), j.tolist(), strict=True):
        out.setdefault((bb, ii), []).append(jj)
    return out


class LayerExamples:
    """The per-query terms of one layer of a cache with whole patterns, from which
    :meth:`example` picks positions for any head, text and statistic."""

    def __init__(self, cache: Any, stack: str, layer: int, kind: str = "self") -> None:
        meta = cache.metadata
        P = cache.pattern(stack, layer, kind).float()  # [B, H, Q, K]
        B, H, Q, K = P.shape
        qs = side(meta, stack, "own", B, Q)
        ks = qs if kind == "self" else side(meta, stack, "source", B, K)
        causal = kind == "self" and is_causal(P, qs, ks)
        self.lay = Layout(qs, ks, Q, K, causal=causal)
        P = torch.where(ks.real[:, None, None, :], P, 0)
        self.P = P
        self.terms = pattern_terms(P, self.lay, self_attn=kind == "self")
        self.heads = [int(h) for h in (meta.get("heads_captured") or range(H))]
        # padded position -> index among the text's own tokens, per text of the batch
        self.q_index = [_real_index(qs.real[b]) for b in range(B)]
        self.k_index = [_real_index(ks.real[b]) for b in range(B)]
        self._stat: dict[str, tuple] = {}

    def example(
        self,
        row: int,
        head: int,
        stat: str,
        direction: str = "top",
        positions: int = POSITIONS,
        keys: int = KEYS,
    ) -> Example:
        """Head ``head`` (the model's index) on text ``row`` of the batch, for ``stat``: see the module."""
        if head not in self.heads:
            raise ProbeError(f"head {head} was not captured here; captured: {self.heads}")
        if stat not in self._stat:
            terms, counted = query_terms(stat, self.terms, self.lay)
            self._stat[stat] = (terms, counted, _targets(self.lay, stat))
        terms, counted, targets = self._stat[stat]
        h = self.heads.index(head)
        r = terms[row, h].double()
        ok = counted[row, min(h, counted.shape[1] - 1)] & torch.isfinite(r)
        idx = ok.nonzero().flatten()
        if direction not in ("top", "bottom"):
            raise ProbeError(f"direction={direction!r}: use 'top' or 'bottom'")
        vals = r[idx]
        order = torch.argsort(-vals if direction == "top" else vals, stable=True)[:positions]
        chosen = idx[order].tolist()
        out = Example([], [], [], [], [])
        qmap, kmap = self.q_index[row], self.k_index[row]
        for q in chosen:
            w = self.P[row, h, q]
            top = torch.topk(w, min(keys, int((w > 0).sum()) or 1))
            out.positions.append(qmap[q])
            out.terms.append(float(r[q]))
            pairs = zip(top.values.tolist(), top.indices.tolist(), strict=True)
            pairs = [(kmap[j], float(v)) for v, j in pairs if j in kmap]
            out.keys.append([j for j, _ in pairs])
            out.weights.append([v for _, v in pairs])
            named = sorted((j for j in targets.get((row, q), []) if j in kmap), key=lambda j: -float(w[j]))
            out.targets.append([kmap[j] for j in named[:keys]])
        return out


def _real_index(real: torch.Tensor) -> dict[int, int]:
    """Padded position -> its index among the real positions (``real`` ``[T]`` bool)."""
    return {int(p): n for n, p in enumerate(real.nonzero().flatten().tolist())}


__all__ = ["Example", "KEYS", "LayerExamples", "POSITIONS", "TEMPLATES", "query_terms"]
