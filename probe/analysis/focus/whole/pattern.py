"""The per-query terms of whole patterns held in a cache, and the metrics of a block of heads.

:func:`block_metrics` takes one pattern block ``[batch, heads, query, key]`` and returns
``[batch, heads, len(METRICS)]``: :func:`pattern_terms` fills the
:class:`~probe.analysis.focus.definitions.terms.Terms` of every query at once (the band sweep of
:class:`~.rows.PatternRows`, the diagonals, the distance histogram, the template pairs), and
:func:`~probe.analysis.focus.definitions.terms.reduce` averages them over the counted queries. This
is the independent check of the streamed path in the tests: written as directly as the
definitions, over the whole pattern.
"""

from __future__ import annotations

import torch

from probe.analysis.focus.definitions.layout import Layout
from probe.analysis.focus.definitions.reach import distance_terms
from probe.analysis.focus.definitions.table import BEYOND, LOCAL_WINDOW
from probe.analysis.focus.definitions.terms import Terms, reduce, word_masses
from probe.analysis.focus.whole.rows import PatternRows

ROWS = 256  # query rows per pass of the distance histogram (bounds its memory)


def _diag(P: torch.Tensor, d: int) -> torch.Tensor:
    """``out[..., i] = P[..., i, i + d]`` where that key exists, else 0; shape ``[B, h, Q]``."""
    Q, K = P.shape[-2:]
    out = P.new_zeros(P.shape[:-1])
    lo, hi = max(0, -d), min(Q, K - d)
    if hi > lo:
        out[..., lo:hi] = torch.diagonal(P, offset=d, dim1=-2, dim2=-1)[..., : hi - lo]
    return out


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
    rows = PatternRows(P, lay, self_attn=self_attn, cumsum=words)
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


def row_distances(
    P: torch.Tensor, rows: torch.Tensor, K: int
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """``({D: beyond_D}, reach)``, each ``[B, h, r]``, for the rows ``P`` ``[B, h, r, kend]`` of the
    queries ``rows`` (``kend <= K`` keys; keys past ``kend`` are zero), from their distance
    histograms: :func:`~probe.analysis.focus.definitions.reach.distance_terms` of every ``W(d)``."""
    B, h, r, kend = P.shape
    d = torch.arange(K, device=P.device)
    left = rows[:, None] - d[None, :]  # [r, K]: key i - d
    right = rows[:, None] + d[None, :]
    hist = torch.where(left >= 0, P.gather(-1, left.clamp(0, kend - 1).expand(B, h, r, K)), 0)
    ok = (right < kend) & (d[None, :] > 0)
    hist += torch.where(ok, P.gather(-1, right.clamp(max=kend - 1).expand(B, h, r, K)), 0)
    W = hist.cumsum_(-1)
    return distance_terms(W[..., -1], K, running=W)


def pattern_distance_terms(P: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """:func:`row_distances` of a whole pattern ``[B, h, Q, K]``, :data:`ROWS` rows at a time."""
    B, h, Q, K = P.shape
    beyond = {D: P.new_empty(B, h, Q) for D in BEYOND}
    reach = P.new_empty(B, h, Q)
    for q0 in range(0, Q, ROWS):
        q1 = min(Q, q0 + ROWS)
        b, r = row_distances(P[..., q0:q1, :], torch.arange(q0, q1, device=P.device), K)
        for D in BEYOND:
            beyond[D][..., q0:q1] = b[D]
        reach[..., q0:q1] = r
    return beyond, reach


def received(P: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """The sink profile of a whole pattern ``[B, h, Q, K]``: the mean weight each key gets over the
    counted queries (``counted`` ``[B, 1, Q]`` bool), ``[B, h, K]`` float64; NaN for a text with
    no counted query."""
    w = counted[:, 0].to(P.dtype)  # [B, Q]
    s = torch.einsum("bhqk,bq->bhk", P, w).double()
    n = w.sum(-1)[:, None, None]
    return torch.where(n > 0, s / n.clamp(min=1), float("nan"))


__all__ = ["block_metrics", "pattern_terms", "pattern_distance_terms", "row_distances", "received"]
