"""The per-text value of every focus metric for a block of heads, vectorised over heads and texts.

:func:`block_metrics` takes one pattern block ``[batch, heads, query, key]`` and returns
``[batch, heads, len(METRICS)]``: each metric averaged over the text's counted queries (NaN where
a metric is undefined for that text or kind). What does not depend on the heads (counted queries,
key masks, template pairs, word ranges) is computed once per layer shape in a :class:`Layout`.
Definitions and conventions are documented once, in :mod:`probe.analysis.focus`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property

import torch

from probe.analysis.focus.definitions.reach import BEYOND, pattern_distance_terms
from probe.analysis.focus.definitions.tokens import CLASS, IMAGE, REGISTER, Side
from probe.analysis.focus.whole.rows import BANDS, SPAN_MASS, _Rows

METRICS = (
    "entropy",
    "norm_entropy",
    "confidence",
    "first",
    "special",
    "punct",
    "content",
    "span",
    "prev",
    "self",
    "next",
    "local",
    "distance",
    "signed_distance",
    "pos_offset",
    "pos_frac",
    "word_prev",
    "word_self",
    "word_next",
    "prev_score",
    "dup_score",
    "induction_score",
    "dup_prefix",
    "induction_prefix",
    "dup_matches",
    "induction_matches",
    *(f"beyond_{d}" for d in BEYOND),
    "reach90",
    "distance_px",
    "on_class",
    "on_register",
    "on_image",
)
IDX = {m: i for i, m in enumerate(METRICS)}
LOCAL_WINDOW = 2  # local mass: keys with |i - j| <= this


def _mean(r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Mean of ``r`` ``[B, h, Q]`` over queries weighted by ``w`` (bool, broadcastable); NaN if none."""
    w = w.to(r.dtype).expand_as(r)
    n = w.sum(-1)
    return torch.where(n > 0, (torch.nan_to_num(r) * w).sum(-1) / n.clamp(min=1), float("nan"))


def _diag(P: torch.Tensor, d: int) -> torch.Tensor:
    """``out[..., i] = P[..., i, i + d]`` where that key exists, else 0; shape ``[B, h, Q]``."""
    Q, K = P.shape[-2:]
    out = P.new_zeros(P.shape[:-1])
    lo, hi = max(0, -d), min(Q, K - d)
    if hi > lo:
        out[..., lo:hi] = torch.diagonal(P, offset=d, dim1=-2, dim2=-1)[..., : hi - lo]
    return out


def is_causal(P: torch.Tensor, q: Side, k: Side) -> bool:
    """Whether every weight above the diagonal (between real tokens) is exactly zero."""
    Q, K = P.shape[-2:]
    if Q != K or Q < 2:
        return False
    padded = bool((~q.real).any() or (~k.real).any())
    real = q.real[:, None, :, None] & k.real[:, None, None, :] if padded else None
    step = max(1, -(-Q // BANDS))
    for q0 in range(0, Q, step):
        q1 = min(Q, q0 + step)
        above = P[..., q0:q1, q1:]  # wholly above the diagonal
        band = P[..., q0:q1, q0:q1].triu(1)
        if padded:
            above = torch.where(real[..., q0:q1, q1:], above, 0)
            band = torch.where(real[..., q0:q1, q0:q1], band, 0)
        # patterns are non-negative: a positive maximum is a weight above the diagonal
        if (above.numel() and bool(above.amax() != 0)) or (band.numel() and bool(band.amax() != 0)):
            return False
    return True


class Layout:
    """Everything about one layer's pattern that does not depend on the heads."""

    def __init__(self, q: Side, k: Side, Q: int, K: int, *, causal: bool) -> None:
        self.q, self.k, self.Q, self.K, self.causal = q, k, Q, K, causal
        B = q.real.shape[0]
        self.qi, self.kj = torch.arange(Q), torch.arange(K)
        n_vis = k.real.sum(-1)[:, None, None].expand(B, 1, Q)
        if causal:
            # real keys j <= i: a running count (O(T), not a [Q, K] mask)
            n_vis = k.real.long().cumsum(-1)[:, None, :Q]
        self.n_vis = n_vis
        self.counted = q.real[:, None, :] & (n_vis >= 2)  # [B, 1, Q]: queries that have a choice
        self.log_n = torch.log(n_vis.clamp(min=2).float())
        self.not_end = (self.qi[None, :] != q.end[:, None])[:, None, :]
        self.masks = torch.stack(
            [k.special, k.punct, k.real & ~k.special & (self.kj[None, :] != k.first[:, None])], -1
        ).float()[:, None]  # [B, 1, K, 3]
        self.any_pad = bool(k.real.logical_not().any())

    def key_ok(self, d: int) -> torch.Tensor:
        """``[B, 1, Q]``: whether key ``i + d`` exists, is real and visible to query ``i``."""
        i = self.qi + d
        inside = (i >= 0) & (i < self.K)
        ok = torch.zeros(self.k.real.shape[0], self.Q, dtype=torch.bool)
        ok[:, inside] = self.k.real[:, i[inside]]
        if d > 0 and self.causal:
            ok[:] = False
        return ok[:, None, :] & self.counted

    @cached_property
    def pixel_distances(self) -> torch.Tensor:
        """``[B, Q, K]``: ‖c_i − c_j‖ in input pixels between patch query i and patch key j of the
        same picture, 0 for every other pair (class, register and text positions, other pictures)."""
        q, k = self.q, self.k
        d = torch.cdist(torch.nan_to_num(q.centre), torch.nan_to_num(k.centre))
        same = (q.picture[:, :, None] == k.picture[:, None, :]) & (q.picture >= 0)[:, :, None]
        return torch.where(same, d, 0.0).float()

    @cached_property
    def kind_masks(self) -> torch.Tensor:
        """``[B, 1, K, 3]``: whether each key is a class token ([CLS], [DIST]), a register, or an
        image position (a patch, a vision-language model's image token); needs ``k.kind``."""
        kind = self.k.kind
        return torch.stack([kind == CLASS, kind == REGISTER, kind == IMAGE], -1).float()[:, None]

    @cached_property
    def image_queries(self) -> torch.Tensor:
        """``[B, 1, Q]``: the counted text queries that can see an image position (a causal layer's
        text before the first image token reads none and is left out)."""
        q, k = self.q, self.k
        img = (k.kind == IMAGE) & k.real
        if self.causal:
            sees = img.long().cumsum(-1)[:, : self.Q] > 0
        else:
            sees = img.any(-1, keepdim=True).expand(-1, self.Q)
        return self.counted & ((q.kind == 0) & sees)[:, None, :]

    @cached_property
    def words_split(self) -> bool:
        """Whether some word has more than one piece (else word metrics equal token metrics)."""
        return any(bool(((s.word.amax(-1) + 1) < s.real.sum(-1)).any()) for s in (self.q, self.k))

    @cached_property
    def word_ranges(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(start, end)`` ``[B, W]``: each word's first and last key position (-1 if none)."""
        B, W = self.k.real.shape[0], self.k.n_words
        w = self.k.word.clamp(min=0)
        big = torch.where(self.k.real, self.kj.expand(B, -1), self.K)
        start = torch.full((B, W), self.K, dtype=torch.long).scatter_reduce(1, w, big, "amin")
        small = torch.where(self.k.real, self.kj.expand(B, -1), -1)
        end = torch.full((B, W), -1, dtype=torch.long).scatter_reduce(1, w, small, "amax")
        return start, end

    @cached_property
    def templates(self) -> dict[str, tuple[torch.Tensor, ...]]:
        """Per template: the (text, query, key) index triples where D = 1 and the queries with a hit."""
        q, k = self.q, self.k
        qi, kj = self.qi[:, None], self.kj[None, :]
        real = q.real[:, :, None] & k.real[:, None, :]  # [B, Q, K]
        same = (q.ids[:, :, None] == k.ids[:, None, :]) & real
        prev_same = torch.zeros_like(same)  # ids[i] == ids[j - 1]
        prev_same[:, :, 1:] = same[:, :, :-1] & k.real[:, None, 1:]
        out = {}
        for name, D in (
            ("prev", real & (kj == qi - 1)),
            ("dup", same & (kj < qi)),
            ("induction", prev_same & (kj <= qi)),
        ):
            b, i, j = D.nonzero(as_tuple=True)
            hits = D.any(-1)  # [B, Q]
            out[name] = (b, i, j, hits)
        return out


@dataclass
class Terms:
    """Per-query quantities of one attention's pattern, each ``[B, h, Q]`` (``masks``
    ``[B, h, Q, 3]``: special, punct, content), from which :func:`reduce` computes every metric.

    Filled from a whole pattern (:func:`pattern_terms`) or row block by row block while a model
    runs (:mod:`probe.analysis.focus.streamed.reader`); self-attention only: ``diag`` (``d`` ->
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


def block_metrics(P: torch.Tensor, lay: Layout, *, self_attn: bool) -> torch.Tensor:
    """Every metric per text and head for the block ``P`` ``[B, h, Q, K]``; returns ``[B, h, M]``."""
    P = P.float()
    if lay.any_pad:  # weight on padding keys is not attention to the text
        P = torch.where(lay.k.real[:, None, None, :], P, 0)
    return reduce(pattern_terms(P, lay, self_attn=self_attn), lay, self_attn=self_attn)


def pattern_terms(P: torch.Tensor, lay: Layout, *, self_attn: bool) -> Terms:
    """The :class:`Terms` of a whole pattern ``P`` ``[B, h, Q, K]`` (padding keys already zero)."""
    B, h, Q, K = P.shape
    words = self_attn and lay.words_split
    rows = _Rows(P, lay, self_attn=self_attn, cumsum=words)
    first = P.gather(-1, lay.k.first.clamp(max=K - 1)[:, None, None, None].expand(B, h, Q, 1))[..., 0]
    t = Terms(rows.ent, rows.top, rows.arg, rows.total, rows.span, rows.masks, first)
    if not self_attn:
        return t
    t.diag = {d: _diag(P, d) for d in range(-LOCAL_WINDOW, LOCAL_WINDOW + 1)}
    t.signed = rows.signed
    t.beyond, t.reach = pattern_distance_terms(P)
    if not lay.causal:
        qf, kf = lay.qi.float(), lay.kj.float()
        t.dist = (P * (kf[None, :] - qf[:, None]).abs()).sum(-1)
    if lay.q.centre is not None and lay.k.centre is not None:
        t.dist_px = (P * lay.pixel_distances[:, None]).sum(-1)
    if lay.q.kind is not None and lay.k.kind is not None:
        t.kinds = P @ lay.kind_masks
    if words:
        t.word = word_masses(rows.cum, lay, lay.qi)
    if lay.q.ids is not None and lay.k.ids is not None:
        t.tmpl, t.hits = {}, {}
        for name, (b, i, j, hits) in lay.templates.items():
            picked = P[b, :, i, j]  # [n_pairs, h]
            per_query = torch.zeros(B, Q, h).index_put_((b, i), picked, accumulate=True)
            t.tmpl[name] = per_query.permute(0, 2, 1)
            t.hits[name] = hits
    return t


def reduce(t: Terms, lay: Layout, *, self_attn: bool) -> torch.Tensor:
    """Every metric per text and head from the per-query :class:`Terms`; returns ``[B, h, M]``."""
    B, h, Q = t.ent.shape
    K = lay.K
    out = torch.full((B, h, len(METRICS)), float("nan"))
    counted = lay.counted
    out[..., IDX["entropy"]] = _mean(t.ent, counted)
    out[..., IDX["norm_entropy"]] = _mean(t.ent / lay.log_n, counted)
    out[..., IDX["confidence"]] = _mean(t.top, counted & lay.not_end)
    out[..., IDX["first"]] = _mean(t.first, counted)
    for c, name in enumerate(("special", "punct", "content")):
        out[..., IDX[name]] = _mean(t.masks[..., c], counted)
    out[..., IDX["span"]] = _mean(t.span, counted)
    if not self_attn:
        return out

    for name, d in (("prev", -1), ("self", 0), ("next", 1)):
        out[..., IDX[name]] = _mean(t.diag[d], lay.key_ok(d))
    local = sum(t.diag[d] for d in range(-LOCAL_WINDOW, LOCAL_WINDOW + 1))
    out[..., IDX["local"]] = _mean(local, counted)
    signed = t.signed
    dist = -signed if lay.causal else t.dist
    out[..., IDX["distance"]] = _mean(dist, counted)
    out[..., IDX["signed_distance"]] = _mean(signed, counted)
    for D, v in t.beyond.items():
        out[..., IDX[f"beyond_{D}"]] = _mean(v, counted)
    out[..., IDX["reach90"]] = _mean(t.reach, counted)
    if t.dist_px is not None:  # over patch queries only
        out[..., IDX["distance_px"]] = _mean(
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
        out[..., IDX[name]] = _mean(mass[..., c], lay.counted & has)
    out[..., IDX["on_image"]] = _mean(mass[..., 2], lay.image_queries)


WORD_STEPS = (("word_prev", -1), ("word_self", 0), ("word_next", 1))


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
        out[..., IDX[name]] = _mean(per_word, word_ok[:, None, :])


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


__all__ = [
    "METRICS",
    "IDX",
    "SPAN_MASS",
    "LOCAL_WINDOW",
    "Layout",
    "Terms",
    "block_metrics",
    "pattern_terms",
    "reduce",
    "word_masses",
    "is_causal",
]
