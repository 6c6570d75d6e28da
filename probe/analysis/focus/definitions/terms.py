"""The per-query terms of one attention and the metrics they reduce to: :class:`Terms`, :func:`reduce`.

Every way of computing the statistics (the whole-pattern path of :mod:`probe.analysis.focus.whole`,
each backend of :mod:`probe.analysis.focus.backends` while a model runs) fills the same
per-query :class:`Terms`; :func:`reduce` turns them into ``[batch, heads, len(METRICS)]``: each
metric averaged over the text's counted queries (NaN where a metric is undefined for that text or
kind). Definitions and conventions are documented once, in :mod:`probe.analysis.focus`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from probe.analysis.focus.definitions.layout import Layout
from probe.analysis.focus.definitions.table import IDX, LOCAL_WINDOW, METRICS, WORD_STEPS
from probe.analysis.focus.definitions.tokens import CLASS, REGISTER


def query_mean(r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Mean of ``r`` ``[B, h, Q]`` over queries weighted by ``w`` (bool, broadcastable); NaN if none."""
    w = w.to(r.dtype).expand_as(r)
    n = w.sum(-1)
    return torch.where(n > 0, (torch.nan_to_num(r) * w).sum(-1) / n.clamp(min=1), float("nan"))


@dataclass
class Terms:
    """Per-query quantities of one attention's pattern, each ``[B, h, Q]`` (``masks``
    ``[B, h, Q, 3]``: special, punct, content), from which :func:`reduce` computes every metric.

    Filled from a whole pattern (:func:`~probe.analysis.focus.whole.pattern.pattern_terms`) or row
    block by row block while a model runs (:mod:`probe.analysis.focus.streamed.reader`, each block
    by one of :mod:`probe.analysis.focus.backends`); self-attention only: ``diag`` (``d`` ->
    ``a_i,i+d``, 0 where that key is missing, for ``|d| <= LOCAL_WINDOW``), ``signed``
    (Σ_j (j − i)·a_ij, summed so that no term near i·Σ a cancels: at 16k positions float32 loses
    three digits there), ``dist`` (Σ_j a_ij |i − j|; None when the layer is known causal), ``word``
    (word_prev/self/next -> mass on the target word), ``tmpl`` (prev/dup/induction -> Σ_j D_ij a_ij),
    ``hits`` (dup/induction -> ``[B, Q]`` whether a query has a match), ``beyond`` (D -> mass
    further than D tokens) and ``reach`` (the distance within which 90% of the mass lies).
    """

    ent: torch.Tensor
    top: torch.Tensor
    arg: torch.Tensor
    total: torch.Tensor
    span: torch.Tensor
    masks: torch.Tensor
    first: torch.Tensor
    diag: dict[int, torch.Tensor] = field(default_factory=dict)
    signed: torch.Tensor | None = None
    dist: torch.Tensor | None = None
    word: dict[str, torch.Tensor] | None = None
    tmpl: dict[str, torch.Tensor] | None = None
    hits: dict[str, torch.Tensor] | None = None
    beyond: dict[int, torch.Tensor] = field(default_factory=dict)
    reach: torch.Tensor | None = None
    dist_px: torch.Tensor | None = None  # Σ_j a_ij ‖c_i − c_j‖ over patch keys of i's picture
    kinds: torch.Tensor | None = None  # [B, h, Q, 3]: mass on class, register, image keys

    def to(self, device: torch.device | str) -> Terms:
        """These terms with every tensor on ``device`` (a new :class:`Terms`)."""

        def move(v):
            if isinstance(v, torch.Tensor):
                return v.to(device)
            if isinstance(v, dict):
                return {k: move(x) for k, x in v.items()}
            return v

        return Terms(**{f.name: move(getattr(self, f.name)) for f in fields(self)})


def reduce(t: Terms, lay: Layout, *, self_attn: bool) -> torch.Tensor:
    """Every metric per text and head from the per-query :class:`Terms`; returns ``[B, h, M]``."""
    B, h, Q = t.ent.shape
    K = lay.K
    out = torch.full((B, h, len(METRICS)), float("nan"))
    counted = lay.counted
    out[..., IDX["entropy"]] = query_mean(t.ent, counted)
    out[..., IDX["norm_entropy"]] = query_mean(t.ent / lay.log_n, counted)
    out[..., IDX["confidence"]] = query_mean(t.top, counted & lay.not_end)
    out[..., IDX["first"]] = query_mean(t.first, counted)
    for c, name in enumerate(("special", "punct", "content")):
        out[..., IDX[name]] = query_mean(t.masks[..., c], counted)
    out[..., IDX["span"]] = query_mean(t.span, counted)
    if not self_attn:
        return out

    for name, d in (("prev", -1), ("self", 0), ("next", 1)):
        out[..., IDX[name]] = query_mean(t.diag[d], lay.key_ok(d))
    local = sum(t.diag[d] for d in range(-LOCAL_WINDOW, LOCAL_WINDOW + 1))
    out[..., IDX["local"]] = query_mean(local, counted)
    signed = t.signed
    dist = -signed if lay.causal else t.dist
    out[..., IDX["distance"]] = query_mean(dist, counted)
    out[..., IDX["signed_distance"]] = query_mean(signed, counted)
    for D, v in t.beyond.items():
        out[..., IDX[f"beyond_{D}"]] = query_mean(v, counted)
    out[..., IDX["reach90"]] = query_mean(t.reach, counted)
    if t.dist_px is not None:  # over patch queries only
        out[..., IDX["distance_px"]] = query_mean(
            t.dist_px.to(t.ent.dtype), counted & (lay.q.picture >= 0)[:, None, :]
        )
    if t.kinds is not None:
        _kinds(t.kinds.to(t.ent.dtype), lay, out)

    # positional: the most common offset (argmax key - query) and the share of queries using it
    hist = torch.zeros(B, h, Q + K - 1)
    hist.scatter_add_(-1, t.arg - lay.qi + (K - 1), counted.float().expand(B, h, Q))
    best, mode = hist.max(-1)
    n_counted = counted.sum(-1).float()  # [B, 1]
    has = n_counted > 0
    out[..., IDX["pos_offset"]] = torch.where(has, (mode - (K - 1)).float(), float("nan"))
    out[..., IDX["pos_frac"]] = torch.where(has, best / n_counted.clamp(min=1), float("nan"))

    if t.word is not None:
        _words(t.word, lay, out)
    else:  # every word is one token: the word-level pattern is the token-level one
        for name in ("prev", "self", "next"):
            out[..., IDX[f"word_{name}"]] = out[..., IDX[name]]
    if t.tmpl is not None:
        _templates(t, lay, out)
    return out


def _kinds(mass: torch.Tensor, lay: Layout, out: torch.Tensor) -> None:
    """``on_class`` / ``on_register`` (over every counted query of a text that has such keys) and
    ``on_image`` (over the text queries that can see an image position) into ``out``."""
    real = lay.k.real
    for c, (name, code) in enumerate((("on_class", CLASS), ("on_register", REGISTER))):
        has = ((lay.k.kind == code) & real).any(-1)[:, None, None]  # [B, 1, 1]
        out[..., IDX[name]] = query_mean(mass[..., c], lay.counted & has)
    out[..., IDX["on_image"]] = query_mean(mass[..., 2], lay.image_queries)


def _word_targets(lay: Layout, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(start, end, ok)`` ``[B, Q]``: the key range of each query's target word (its own word +
    ``d``) and whether the query counts for that word-level mass."""
    q, W = lay.q, lay.word_ranges[0].shape[1]
    start, end = lay.word_ranges
    qw = q.word
    n_words = qw.amax(-1) + 1  # [B]
    t = qw + d
    ok = q.real & (qw >= 0) & (t >= 0) & (t < W)
    tc = t.clamp(0, W - 1)
    s, e = start.gather(1, tc), end.gather(1, tc)
    ok &= e >= 0
    if lay.causal:
        ok &= (qw > 0) & (d <= 0)  # the first word sees only itself; the next word is unseen
    else:
        ok &= (n_words >= 2)[:, None]
    return s, e, ok


def word_targets(lay: Layout) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{word_prev/self/next: (start, end)}`` ``[B, Q]``: each query's target word's key range."""
    return {name: _word_targets(lay, d)[:2] for name, d in WORD_STEPS}


def word_masses(
    C: torch.Tensor, lay: Layout, rows: torch.Tensor, targets: dict | None = None
) -> dict[str, torch.Tensor]:
    """Each query's mass on its previous/own/next word, from the cumulative row sums ``C``
    ``[B, h, r, K']`` of the queries ``rows`` (``K' <= K``: keys past ``K'`` add nothing).
    Words are contiguous, so the mass is a difference of ``C`` at the word's ends. ``targets``:
    :func:`word_targets` already taken at ``rows`` and on ``C``'s device (a streamed block)."""
    B, h, r, Kc = C.shape
    out = {}
    for name, d in WORD_STEPS:
        if targets is not None:
            s, e = targets[name]
        else:
            s, e, _ = _word_targets(lay, d)
            s, e = s[:, rows], e[:, rows]
        hi = C.gather(-1, e.clamp(0, Kc - 1)[:, None, :, None].expand(B, h, r, 1))[..., 0]
        lo = C.gather(-1, (s - 1).clamp(0, Kc - 1)[:, None, :, None].expand(B, h, r, 1))[..., 0]
        out[name] = torch.where((s > 0)[:, None, :], hi - lo, hi)  # [B, h, r]
    return out


def _words(masses: dict[str, torch.Tensor], lay: Layout, out: torch.Tensor) -> None:
    """Word-level previous/self/next masses: attention to a word summed over its pieces, from a
    word averaged over its pieces (Clark et al. 2019)."""
    B, h, Q = masses["word_self"].shape
    W = lay.word_ranges[0].shape[1]
    own = lay.q.word.clamp(min=0)
    for name, d in WORD_STEPS:
        _, _, ok = _word_targets(lay, d)
        mass = masses[name]
        # from a word: average its pieces' masses, then average over the counted words
        per_word = torch.zeros(B, h, W).scatter_add_(
            -1, own[:, None, :].expand(B, h, Q), torch.where(ok[:, None, :], mass, 0)
        )
        pieces = torch.zeros(B, W).scatter_add_(1, own, ok.float())
        word_ok = pieces > 0
        per_word = per_word / pieces.clamp(min=1)[:, None, :]
        out[..., IDX[name]] = query_mean(per_word, word_ok[:, None, :])


def _templates(t: Terms, lay: Layout, out: torch.Tensor) -> None:
    """Previous-token, duplicate-token and induction template scores (see the module docs)."""
    total = (t.total * lay.q.real[:, None, :]).sum(-1)  # [B, h]: ΣA over real queries and keys
    for name, per_query in t.tmpl.items():
        mass = per_query.sum(-1)  # [B, h]
        col = "prev_score" if name == "prev" else f"{name}_score"
        out[..., IDX[col]] = torch.where(total > 0, mass / total.clamp(min=1e-30), float("nan"))
        if name != "prev":
            hits = t.hits[name]
            n = hits.sum(-1, keepdim=True).float()  # [B, 1]
            prefix = (per_query * hits[:, None, :]).sum(-1) / n.clamp(min=1)
            out[..., IDX[f"{name}_prefix"]] = torch.where(n > 0, prefix, float("nan"))
            out[..., IDX[f"{name}_matches"]] = n


__all__ = ["Terms", "reduce", "query_mean", "word_targets", "word_masses"]
