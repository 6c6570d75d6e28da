"""How far each head reads: ``beyond_<D>`` and ``reach90``, defined once (:func:`distance_terms`).

For query ``i`` the *distance histogram* is ``h_d = a_i,i−d + a_i,i+d`` (``h_0 = a_ii``): the mass
the row puts at distance ``d``. From its running sum ``W(d) = Σ_{d' ≤ d} h_d'`` (the mass within
distance ``d``):

* ``beyond_<D>`` = ``W(T − 1) − W(D)``: the mass further than ``D`` tokens away (:data:`BEYOND`);
* ``reach90`` = the smallest ``d`` with ``W(d) ≥ 0.9 · W(T − 1)``: the distance within which 90%
  of the row's mass lies (:data:`REACH_MASS`).

:func:`distance_terms` is that rule, given ``W``: the whole-pattern path hands it every ``W(d)``
(a histogram of each row, :func:`~probe.analysis.focus.whole.pattern.pattern_distance_terms`),
the torch backend a ``W(d)`` it reads off a row's prefix sums on demand
(:mod:`probe.analysis.focus.backends.reference`); the compiled backends compute the same rule in
their own loops. Definitions are in the metric table of :mod:`probe.analysis.focus`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from probe.analysis.focus.definitions.table import BEYOND, REACH_MASS


def distance_terms(
    total: torch.Tensor,
    K: int,
    within: Callable[[torch.Tensor], torch.Tensor] | None = None,
    running: torch.Tensor | None = None,
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """``({D: beyond_D}, reach)``, each ``[B, h, r]`` like ``total`` (each row's mass), of rows over
    ``K`` keys. ``within(d)``: the mass within distance ``d`` of each row's query, ``W(d)`` (``d`` a
    long tensor that broadcasts to ``[B, h, r]``), read on demand: ``reach`` is then a bisection
    over ``d`` (``W`` never decreases with ``d``: the weights are non-negative). ``running``: every
    ``W(d)``, ``[B, h, r, K]``: ``within`` reads it, and ``reach`` is one search of it."""
    if within is None:
        within = lambda d: running.gather(-1, d.expand(running.shape[:-1]).unsqueeze(-1))[..., 0]  # noqa: E731
    beyond = {
        D: total - within(torch.tensor(D, device=total.device)) if D < K else torch.zeros_like(total)
        for D in BEYOND
    }
    target = REACH_MASS * total
    if running is not None:
        reach = torch.searchsorted(running, target[..., None].contiguous(), side="left")[..., 0]
        return beyond, reach.clamp(max=K - 1).to(total.dtype)
    lo = torch.zeros(total.shape, dtype=torch.long, device=total.device)
    hi = torch.full(total.shape, K - 1, dtype=torch.long, device=total.device)
    for _ in range(max(1, (K - 1).bit_length())):  # within(K - 1) is the total: it holds there
        mid = (lo + hi) // 2
        ok = within(mid) >= target
        hi = torch.where(ok, mid, hi)
        lo = torch.where(ok, lo, mid + 1)
    return beyond, hi.to(total.dtype)


__all__ = ["distance_terms"]
