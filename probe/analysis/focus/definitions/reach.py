"""How far each head reads: the long-context terms of a block of pattern rows.

For query ``i`` the *distance histogram* is ``h_d = a_i,i−d + a_i,i+d`` (``h_0 = a_ii``): the mass
the row puts at distance ``d``. From its running sum ``W(d) = Σ_{d' ≤ d} h_d'`` (the mass within
distance ``d``):

* ``beyond_<D>`` = ``W(T − 1) − W(D)``: the mass further than ``D`` tokens away (:data:`BEYOND`);
* ``reach90`` = the smallest ``d`` with ``W(d) ≥ 0.9 · W(T − 1)``: the distance within which 90%
  of the row's mass lies (:data:`REACH_MASS`).

The column statistic ``received`` (the *sink profile*) is the attention each key position gets,
averaged over the counted queries. Both are computed from any block of query rows, so the
streamed path (``head_stats(model, ...)``) and the cache path give the same numbers.
Definitions are in the metric table of :mod:`probe.analysis.focus`.
"""

from __future__ import annotations

import torch

BEYOND = (16, 128, 1024)  # beyond_<D>: mass further than D tokens
REACH_MASS = 0.9  # reach90: the distance within which this share of a row's mass lies
ROWS = 256  # query rows per pass on the cache path (bounds the histogram's memory)


def distance_terms(
    P: torch.Tensor, rows: torch.Tensor, K: int
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """``({D: beyond_D}, reach)``, each ``[B, h, r]``, for the rows ``P`` ``[B, h, r, kend]`` of the
    queries ``rows`` (``kend <= K`` keys; keys past ``kend`` are zero)."""
    B, h, r, kend = P.shape
    d = torch.arange(K, device=P.device)
    left = rows[:, None] - d[None, :]  # [r, K]: key i - d
    right = rows[:, None] + d[None, :]
    hist = torch.where(left >= 0, P.gather(-1, left.clamp(0, kend - 1).expand(B, h, r, K)), 0)
    ok = (right < kend) & (d[None, :] > 0)
    hist += torch.where(ok, P.gather(-1, right.clamp(max=kend - 1).expand(B, h, r, K)), 0)
    W = hist.cumsum_(-1)
    total = W[..., -1:]
    beyond = {D: (total[..., 0] - W[..., D]) if D < K else torch.zeros_like(total[..., 0]) for D in BEYOND}
    reach = torch.searchsorted(W, (REACH_MASS * total).contiguous(), side="left")[..., 0]
    return beyond, reach.clamp(max=K - 1).to(P.dtype)


def pattern_distance_terms(P: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """:func:`distance_terms` of a whole pattern ``[B, h, Q, K]``, :data:`ROWS` rows at a time."""
    B, h, Q, K = P.shape
    beyond = {D: P.new_empty(B, h, Q) for D in BEYOND}
    reach = P.new_empty(B, h, Q)
    for q0 in range(0, Q, ROWS):
        q1 = min(Q, q0 + ROWS)
        b, r = distance_terms(P[..., q0:q1, :], torch.arange(q0, q1, device=P.device), K)
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


__all__ = ["BEYOND", "REACH_MASS", "distance_terms", "pattern_distance_terms", "received"]
