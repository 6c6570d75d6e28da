"""``probe.align``: word alignments read from a cache's decoder cross-attention.

For every captured decoder layer and head, the cross-attention pattern ``[target token, source
token]`` of each sentence pair becomes a *soft word matrix* ``[target word, source word]``:
special tokens (BOS/EOS/pad) are left out, source pieces of one word are **summed** (a word gets
the mass of all its pieces) and target pieces of one word are **averaged**. Two conventions say
which decoder row stands for target word j:

* ``"input"`` (shifted): the rows where j's pieces are the decoder *input*; usually the better one
  (Chen et al. 2020's Shift-Att);
* ``"output"``: the rows that *predicted* j's pieces, one position earlier.

Hard links come from a soft matrix by ``argmax`` (each target word links to its heaviest source
word) or ``threshold`` (every cell ≥ threshold); with a second cache from the reverse direction
(``reverse=``) by ``intersect``, ``union`` or ``grow-diag-final``.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

import torch

from probe.analysis.alignment.choose import (
    CONVENTIONS,
    MEAN,
    check_gold,
    choose,
    gold_scores,
    hard_links,
    links_and_stats,
    select,
    selections,
)
from probe.analysis.alignment.gold import Gold, Links, as_gold, pharaoh
from probe.analysis.alignment.words import Words, group_words, special_positions
from probe.analysis.table import Table
from probe.cache.format import parse_key
from probe.errors import ProbeError

METHODS = ("argmax", "threshold", "intersect", "union", "grow-diag-final")
__all__ = [
    "Alignment",
    "align",
    "cross_layers",
    "hard_links",
    "soft_matrices",
    "CONVENTIONS",
    "METHODS",
    "MEAN",
]


def cross_layers(cache) -> list[int]:
    """Decoder layers whose cross-attention pattern is in ``cache`` (empty if none)."""
    out = set()
    for k in cache.keys():
        try:
            stack, layer, name = parse_key(k)
        except ValueError:
            continue
        if stack == "decoder" and name == "cross_attn.pattern":
            out.add(layer)
    return sorted(out)


def _many(cache) -> list:
    """A cache, or a list of caches of the same model captured in batches, as a list."""
    caches = list(cache) if isinstance(cache, (list, tuple)) else [cache]
    if not caches:
        raise ProbeError("no cache given; pass a probe.Cache (or a list of them)")
    return caches


def _words(cache) -> tuple[list[Words], list[Words]]:
    src, tgt = [], []
    for c in _many(cache):
        s, t = _words_one(c)
        src += s
        tgt += t
    return src, tgt


def _words_one(cache) -> tuple[list[Words], list[Words]]:
    meta = cache.metadata
    if not meta.get("target_tokens"):
        raise ProbeError("the cache has no target tokens; capture an encoder-decoder with text (and target=)")
    src, tgt = [], []
    for b in range(len(meta["tokens"])):
        src.append(group_words(meta["tokens"][b], special_positions(meta, "source", b)))
        tgt.append(group_words(meta["target_tokens"][b], special_positions(meta, "target", b)))
    return src, tgt


def _rows(pieces: list[int], convention: str) -> list[int]:
    return pieces if convention == "input" else [p - 1 for p in pieces if p >= 1]


def soft_matrices(cache, convention: str = "input") -> tuple[list[int], list[torch.Tensor]]:
    """(decoder layers, per sentence pair a float32 tensor [layer, head, target word, source word]).

    ``cache`` may be a list of caches (one corpus captured in batches): pairs are concatenated."""
    layers, out = None, []
    for c in _many(cache):
        got, mats = _soft_one(c, convention)
        if layers is not None and got != layers:
            raise ProbeError(
                f"the caches hold different decoder layers ({layers} vs {got}); capture them alike"
            )
        layers = got
        out += mats
    return layers, out


def _soft_one(cache, convention: str) -> tuple[list[int], list[torch.Tensor]]:
    if convention not in CONVENTIONS:
        raise ProbeError(f"convention {convention!r} is unknown; use 'input' (shifted) or 'output'")
    layers = cross_layers(cache)
    if not layers:
        raise ProbeError(
            "this cache has no cross-attention (no decoder cross_attn patterns); capture an "
            "encoder-decoder such as the translator or a BART/T5/Marian model"
        )
    captured = cache.metadata.get("heads_captured")
    if captured and list(captured) != list(range(len(captured))):
        # alignments name heads by their place on the pattern's head axis; here that is not the model's
        raise ProbeError(
            f"this cache holds heads {list(captured)} only, so alignment could not name them by the "
            "model's head index; capture without --heads (or with heads 0..k)"
        )
    src, tgt = _words_one(cache)
    P = torch.stack([cache.pattern("decoder", layer, "cross").float() for layer in layers])  # [L, B, H, T, S]
    B, T, S = P.shape[1], P.shape[3], P.shape[4]
    n_src = max([len(w) for w in src] + [1])
    n_tgt = max([len(w) for w in tgt] + [1])
    G = torch.zeros(B, S, n_src)  # source pieces -> words, summed
    R = torch.zeros(B, n_tgt, T)  # target words <- decoder rows, averaged
    for b in range(B):
        for w, ps in enumerate(src[b].pieces):
            G[b, ps, w] = 1.0
        for w, ps in enumerate(tgt[b].pieces):
            rows = _rows(ps, convention)
            if rows:
                R[b, w, rows] = 1.0 / len(rows)
    # one contraction for the whole batch: [L, B, H, target word, source word]
    W = torch.einsum("bwt,lbhts,bsv->blhwv", R, P, G)
    return layers, [W[b, :, :, : len(tgt[b]), : len(src[b])].contiguous() for b in range(B)]


@dataclass
class Alignment:
    """Word alignments of every sentence pair in a cache, with their scores.

    ``links[b]`` is the chosen hard alignment of pair b: a set of ``(source word, target word)``
    indices (0-based, special tokens left out); ``source[b].words`` / ``target[b].words`` spell
    them. ``soft[convention][b]`` is a tensor [layer, head, target word, source word] of attention
    mass. ``scores`` (a Table, only with gold) holds AER, precision and recall per convention,
    layer and head (``mean`` rows: averaged over heads, or over layers and heads); ``stats`` the
    gold-free shape statistics of the same selections; ``best`` the lowest-AER selection.
    """

    source: list[Words]
    target: list[Words]
    layers: list[int]
    n_heads: int
    soft: dict[str, list[torch.Tensor]]
    convention: str
    layer: Any
    head: Any
    method: str
    links: list[Links]
    gold: list[Gold] | None = None
    scores: Table | None = None
    stats: Table | None = None
    best: dict | None = None
    notes: list[str] = field(default_factory=list)

    def matrix(self, b: int = 0, layer: Any = None, head: Any = None, convention: str | None = None):
        """The soft word matrix [target word, source word] of pair ``b`` (default: the chosen selection)."""
        layer = self.layer if layer is None else layer
        head = self.head if head is None else head
        return select(self.soft[convention or self.convention][b], layer, head, self.layers)

    def pharaoh(self, *, one_indexed: bool = False) -> str:
        """The chosen links in Pharaoh form, one line per sentence pair."""
        return "\n".join(pharaoh(A, one_indexed=one_indexed) for A in self.links) + "\n"

    def selection(self) -> dict[str, Any]:
        return {"convention": self.convention, "layer": self.layer, "head": self.head, "method": self.method}

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready: the selection, per pair words and links, scores, stats and best."""
        pairs = [
            {
                "source": s.words,
                "target": t.words,
                "links": sorted([list(x) for x in A]),
                "pharaoh": pharaoh(A),
            }
            for s, t, A in zip(self.source, self.target, self.links, strict=True)
        ]
        return {
            "selection": self.selection(),
            "layers": self.layers,
            "heads": self.n_heads,
            "pairs": pairs,
            "scores": self.scores.to_dict() if self.scores is not None else None,
            "stats": self.stats.to_dict() if self.stats is not None else None,
            "best": self.best,
            "notes": list(self.notes),
        }

    def __repr__(self) -> str:
        sel = f"layer={self.layer!r} head={self.head!r} convention={self.convention!r} method={self.method!r}"
        extra = f" best={self.best}" if self.best else ""
        return f"<probe.Alignment pairs={len(self.links)} {sel}{extra}>"

    def _repr_html_(self) -> str:
        e = html.escape
        parts = [f"<div><b>{e(repr(self))}</b>"]
        for s, t, A in list(zip(self.source, self.target, self.links, strict=True))[:5]:
            cells = ", ".join(f"{e(s.words[i])}→{e(t.words[j])}" for i, j in sorted(A, key=lambda x: x[1]))
            parts.append(f"<p>{e(' '.join(s.words))} ‖ {e(' '.join(t.words))}<br><small>{cells}</small></p>")
        table = self.scores if self.scores is not None else self.stats
        if table is not None:
            by = "aer" if self.scores is not None else "diagonality"
            parts.append(table.top(by, 10, descending=by != "aer")._repr_html_())
        parts.append("</div>")
        return "".join(parts)


def align(
    cache,
    *,
    gold=None,
    layer: Any = None,
    head: Any = None,
    method: str = "argmax",
    convention: str | None = None,
    threshold: float = 0.1,
    reverse=None,
    one_indexed: bool = False,
    little: float = 0.1,
) -> Alignment:
    """Word alignments from the decoder cross-attention of ``cache`` (one per sentence pair; a
    list of caches captured in batches counts as one corpus).

    ``gold``: a Pharaoh/talp file path or text (``one_indexed`` if it counts from 1), or a list of
    :class:`Gold`; then AER/precision/recall are computed for every layer and head and, unless
    ``layer``/``head`` are given, the lowest-AER selection is chosen (under ``convention`` if
    given, else under either: ``"input"``, the shifted convention, or ``"output"``).
    Without gold the default is the mean over heads of the penultimate decoder layer (the layer
    attention alignments usually peak at). ``layer`` is a decoder layer index or ``"mean"``;
    ``head`` a head index or ``"mean"``. ``method``: ``argmax``, ``threshold`` (cells ≥
    ``threshold``), or ``intersect`` / ``union`` / ``grow-diag-final`` with ``reverse``, a cache
    of a model translating the other way on the same pairs. Returns an :class:`Alignment`.
    """
    _check_args(method, reverse, layer, head, convention)
    soft, layers = {}, []
    for conv in CONVENTIONS:
        layers, soft[conv] = soft_matrices(cache, conv)
    src, tgt = _words(cache)
    n_heads = soft["input"][0].shape[1] if soft["input"] else 0
    valid = selections(layers, n_heads)
    notes = []
    if any(p and p[0] == 0 for w in tgt for p in w.pieces):
        notes.append(
            "a target word sits at decoder position 0, so no row predicted it: under the output "
            "convention it has no link"
        )
    rev = None if reverse is None else _reverse(reverse, convention or "input", src, tgt)
    all_links, stats = links_and_stats(soft, layers, valid, method, threshold, rev, little)
    golds = table = best = None
    rows: list[dict] = []
    if gold is not None:
        golds = as_gold(gold, one_indexed=one_indexed)
        check_gold(golds, src, tgt)
        rows, table, best = gold_scores(golds, all_links, convention or "input")
    layer, head, chosen_conv = choose(layer, head, convention, rows, best, layers, n_heads, valid)
    return Alignment(
        source=src,
        target=tgt,
        layers=layers,
        n_heads=n_heads,
        soft=soft,
        convention=chosen_conv,
        layer=layer,
        head=head,
        method=method,
        links=all_links[(chosen_conv, layer, head)],
        gold=golds,
        scores=table,
        stats=stats,
        best=best,
        notes=notes,
    )


def _check_args(method: str, reverse, layer: Any, head: Any, convention: str | None) -> None:
    """Raise a ProbeError for an unknown method/convention, a missing reverse, or a head without layer."""
    if method not in METHODS:
        raise ProbeError(f"method {method!r} is unknown; use one of: {', '.join(METHODS)}")
    if method in METHODS[2:] and reverse is None:
        raise ProbeError(f"method {method!r} needs reverse=, a cache of the other translation direction")
    if head is not None and layer is None:
        raise ProbeError("a head needs its layer: pass layer= (an index or 'mean') with head=")
    if convention is not None and convention not in CONVENTIONS:
        raise ProbeError(f"convention {convention!r} is unknown; use 'input' (shifted) or 'output'")


def _reverse(reverse, conv: str, src: list[Words], tgt: list[Words]) -> tuple[list[int], list[torch.Tensor]]:
    """The reverse direction's (layers, soft matrices) under ``conv``, checked to hold the same pairs."""
    r_layers, r_soft = soft_matrices(reverse, conv)
    r_src, r_tgt = _words(reverse)
    if [w.words for w in r_src] != [w.words for w in tgt] or [w.words for w in r_tgt] != [
        w.words for w in src
    ]:
        raise ProbeError("reverse= must hold the same pairs the other way round (its source = our target)")
    return r_layers, r_soft
