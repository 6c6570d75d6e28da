"""The torch reference backend: the per-row terms of any block, in few passes of plain torch.

It takes every block the other backends leave (no numba, a negative weight, a device no kernel
runs on), and is the one :mod:`probe.analysis.focus.whole` is checked against in the tests through
the streamed path; the definitions are those of :mod:`probe.analysis.focus.definitions`. What makes
it fast on a CPU, measured on ``[1, 12, 341, 4096]`` blocks:

* **warm buffers** (:class:`~.workspace.Workspace`): every full-size temporary lives in a buffer
  reused across blocks and layers;
* **one prefix sum per row** ``C`` gives the mass within any distance of the query
  (``C[i + d] − C[i − d − 1]``), so ``beyond_<D>`` is two gathers per row and ``reach90`` a
  binary search of ``log2 K`` gathers, instead of a ``[r, K]`` distance histogram;
* **sparse templates**: the duplicate-token and induction pairs are few; their weights are
  gathered pair by pair instead of multiplying the block by a mask;
* the effective span's sort (numpy's SIMD sort, in place) is split over threads by rows.

The other backends use its :func:`columns`, :func:`key_masses` and :func:`gathered_pairs` for what
they leave to torch.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from probe.analysis.focus.backends.base import RowTermsBackend
from probe.analysis.focus.backends.workspace import Workspace
from probe.analysis.focus.definitions.reach import distance_terms
from probe.analysis.focus.definitions.table import LOCAL_WINDOW, SPAN_MASS
from probe.analysis.focus.definitions.terms import word_masses

_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max(1, min(16, torch.get_num_threads(), os.cpu_count() or 1)))
    return _POOL


def entropy(P: torch.Tensor, ws: Workspace) -> torch.Tensor:
    """``-Σ_j p log p`` per row ``[B, h, r]`` (as :class:`~probe.analysis.focus.whole.rows.PatternRows`:
    ``p · log max(p, tiny)``)."""
    buf = ws.get("tmp", tuple(P.shape), P.dtype, P.device)
    torch.clamp_min(P, torch.finfo(P.dtype).tiny, out=buf)
    buf.log_().mul_(P)
    return buf.sum(-1).neg_()


def sorted_terms(P: torch.Tensor, ws: Workspace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(top, arg, span)`` ``[B, h, r]``: each row's largest weight, its first position, and the
    effective span (the fewest keys whose weights cover :data:`SPAN_MASS` of the row's mass)."""
    kend = P.shape[-1]
    vals = ws.get("sort", tuple(P.shape), P.dtype, P.device)
    if P.device.type == "cpu":
        arg = torch.from_numpy(P.numpy().argmax(-1))
        vals.copy_(P)
        a = vals.numpy().reshape(-1, kend)
        n = a.shape[0]
        parts = max(1, min(_pool()._max_workers, n // 8))
        cuts = [n * i // parts for i in range(parts + 1)]
        list(_pool().map(lambda s: a[s[0] : s[1]].sort(-1), zip(cuts, cuts[1:], strict=False)))
    else:
        arg = P.argmax(-1)
        torch.sort(P, -1, out=(vals, ws.get("sort_idx", tuple(P.shape), torch.long, P.device)))
    top = vals[..., -1].clone()
    vals.cumsum_(-1)
    # leftover keys: the most smallest weights whose sum stays within the (1 − SPAN_MASS) rest
    rest = (1 - SPAN_MASS) * vals[..., -1:]
    left = torch.searchsorted(vals, rest.contiguous(), side="right")[..., 0]
    return top, arg, (kend - left).to(P.dtype)


def prefix_sums(P: torch.Tensor, ws: Workspace) -> torch.Tensor:
    """``C[..., j] = Σ_{j' <= j} P[..., j']`` (float32, in a reused buffer)."""
    C = ws.get("cum", tuple(P.shape), P.dtype, P.device)
    return torch.cumsum(P, -1, out=C)


def _within(C: torch.Tensor, rows: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The mass each row puts within distance ``d`` of its query, ``C[i + d] − C[i − d − 1]``;
    ``d`` broadcasts to ``[B, h, r]``."""
    kend = C.shape[-1]
    hi = (rows + d).clamp(max=kend - 1)
    lo = rows - d - 1
    B, h, r, _ = C.shape
    hi = hi.expand(B, h, r).unsqueeze(-1)
    up = C.gather(-1, hi)[..., 0]
    down = C.gather(-1, lo.clamp(0, kend - 1).expand(B, h, r).unsqueeze(-1))[..., 0]
    return up - torch.where(lo >= 0, down, 0)


def prefix_distances(
    C: torch.Tensor, rows: torch.Tensor, K: int
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """``({D: beyond_D}, reach)`` ``[B, h, r]`` from the prefix sums ``C`` of the rows ``rows``
    (``K`` keys in all): :func:`~probe.analysis.focus.definitions.reach.distance_terms`, the mass
    within distance ``d`` read off ``C`` on demand."""
    return distance_terms(C[..., -1], K, within=lambda d: _within(C, rows, d))


def diagonals(P: torch.Tensor, rows: torch.Tensor, window: int) -> dict[int, torch.Tensor]:
    """``{d: P[..., i, i + d]}`` ``[B, h, r]`` for ``|d| <= window`` (0 where the key is missing)."""
    B, h, r, kend = P.shape
    steps = range(-window, window + 1)
    offsets = torch.arange(-window, window + 1, device=P.device)
    idx = rows[:, None] + offsets[None, :]  # [r, 2w + 1]
    ok = (idx >= 0) & (idx < kend)
    got = P.gather(-1, idx.clamp(0, kend - 1).expand(B, h, r, offsets.numel()))
    got = torch.where(ok, got, 0)
    return {d: got[..., n] for n, d in enumerate(steps)}


def abs_distance(P: torch.Tensor, rows: torch.Tensor, ws: Workspace) -> torch.Tensor:
    """``Σ_j P_ij |i − j|`` per row ``[B, h, r]``."""
    kend = P.shape[-1]
    dist = (torch.arange(kend, device=P.device)[None, :] - rows[:, None]).abs().to(P.dtype)
    buf = ws.get("tmp", tuple(P.shape), P.dtype, P.device)
    return torch.mul(P, dist, out=buf).sum(-1)


def pair_sums(P: torch.Tensor, b: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """``Σ_j D_ij P_ij`` per row ``[B, h, r]`` for the pairs ``(b, i, j)`` where ``D`` is 1."""
    B, h, r, _ = P.shape
    dev = P.device
    b, i, j = b.to(dev), i.to(dev), j.to(dev)
    picked = P[b, :, i, j]  # [n_pairs, h]
    per = torch.zeros(B * r, h, dtype=P.dtype, device=dev).index_add_(0, b * r + i, picked)
    return per.view(B, r, h).permute(0, 2, 1)


def received(P: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``Σ_i w_i P_ij`` per key ``[B, h, kend]`` (``weights`` ``[B, r]``): a vector-matrix
    product per head, which reads the block once in its own layout."""
    return (weights[:, None, None, :].to(P.dtype) @ P)[..., 0, :]


def key_masses(P: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``[B, h, r, 3]``: each row's mass on the special, punctuation and content keys (``cols``
    ``[B, 3, kend]``, the reader's ``facts(device)["cols"]`` cut to the block's keys)."""
    return torch.einsum("bhrk,bck->bhrc", P, cols)


def columns(reader: Any, P: torch.Tensor, q0: int, q1: int, got: dict | None = None) -> None:
    """The column sums of rows ``q0:q1`` (the sink profile) and the first real query's row, into
    the reader's ``recv`` and ``recv_first``; ``got``: a backend's own column sums (``recv``) and,
    where it read a block that was never written, each text's first real query's row
    (``first_row``)."""
    kend = P.shape[-1]
    qreal = reader.facts(P.device)["qreal"]
    got = got or {}
    reader.recv[..., :kend] += received(P, qreal[:, q0:q1]) if "recv" not in got else got["recv"]
    for b, f in enumerate(reader.qs.first.tolist()):
        if q0 <= f < q1:
            row = got["first_row"][b] if "first_row" in got else P[b, :, f - q0]
            reader.recv_first[b, :, :kend] = row


def gathered_pairs(reader: Any, P: torch.Tensor, sl: slice) -> None:
    """The duplicate-token and induction sums of rows ``sl`` (templates of the token ids),
    gathered pair by pair from ``P``, into the reader's terms."""
    t = reader.t
    for n, (b, i, j, hits) in reader.pair_keys(sl, P.shape[-1], P.device).items():
        t.tmpl[n][..., sl] = pair_sums(P, b, i, j)
        t.hits[n][:, sl] = hits


class Reference(RowTermsBackend):
    """Every block, in torch: the rows sorted for the span, prefix sums for the distances."""

    name = "reference"
    order = 90

    @classmethod
    def available(cls) -> bool:
        return True

    def terms(self, q0: int, q1: int, P: torch.Tensor, fill: Any = None, trim: bool = False) -> bool:
        r = self.reader
        B, H, n, kend = P.shape
        t, sl, ws, dev = r.t, slice(q0, q1), r.ws, r.facts(P.device)
        rows = torch.arange(q0, q1, device=P.device)
        t.ent[..., sl], t.total[..., sl] = entropy(P, ws), P.sum(-1)
        t.top[..., sl], t.arg[..., sl], t.span[..., sl] = sorted_terms(P, ws)
        lower = self._lower(P, q0, q1, rows)
        t.masks[:, :, sl] = key_masses(P, dev["cols"][..., :kend])
        first = dev["first"].clamp(max=kend - 1)[:, None, None, None].expand(B, H, n, 1)
        at_first = P.gather(-1, first)[..., 0]
        t.first[..., sl] = torch.where((dev["first"] < kend)[:, None, None], at_first, 0)
        columns(r, P, q0, q1)
        if r.self_attn:
            self._self_rows(P, rows, sl, lower)
        return True

    def _lower(self, P: torch.Tensor, q0: int, q1: int, rows: torch.Tensor) -> bool:
        """Whether no real query of this block puts weight on a key after it (only keys after
        ``q0`` can be); a layer stays causal while every block is."""
        r = self.reader
        if not r.causal:
            return False
        kend = P.shape[-1]
        if kend <= q0 + 1:
            return True
        keys = torch.arange(q0 + 1, kend, device=P.device)
        dev = r.facts(P.device)
        above = (keys[None, :] > rows[:, None]) & dev["qreal"][:, q0:q1, None]
        above = above & dev["real"][:, None, q0 + 1 : kend]
        sub = P[..., q0 + 1 :]
        hit = torch.mul(sub, above[:, None], out=r.ws.get("tmp", tuple(sub.shape), P.dtype, P.device))
        if bool(hit.amax() != 0):  # weights are non-negative: a positive maximum is one after the query
            r.causal = False
        return r.causal

    def _self_rows(self, P: torch.Tensor, rows: torch.Tensor, sl: slice, lower: bool) -> None:
        """The self-attention terms of rows ``sl``: diagonals, distances, ``beyond_<D>``, ``reach``,
        word masses and templates."""
        r = self.reader
        t, kend, q0, dev = r.t, P.shape[-1], sl.start, r.facts(P.device)
        for d, v in diagonals(P, rows, LOCAL_WINDOW).items():
            t.diag[d][..., sl] = v
        C = prefix_sums(P, r.ws)
        # Σ (j − i)·a as Σ (j − q0)·a − (i − q0)·Σ a: no term grows with the position i
        shifted = P @ (dev["kf"][:kend] - q0)
        signed = shifted - (rows - q0).to(P.dtype) * t.total[..., sl]
        t.signed[..., sl] = signed
        # a block with no weight after the query: Σ a_ij |i − j| = −Σ a_ij (j − i)
        t.dist[..., sl] = -signed if lower else abs_distance(P, rows, r.ws)
        beyond, reach = prefix_distances(C, rows, r.shape[3])
        for D, v in beyond.items():
            if D not in t.beyond:
                t.beyond[D] = torch.zeros_like(t.ent)
            t.beyond[D][..., sl] = v
        if t.reach is None:
            t.reach = torch.zeros_like(t.ent)
        t.reach[..., sl] = reach
        if t.word is not None:
            at = {n: (s[:, sl], e[:, sl]) for n, (s, e) in dev["words"].items()}
            for n, m in word_masses(C, r.lay, rows, at).items():
                t.word[n][..., sl] = m
        if t.tmpl is not None:
            real_q = dev["qreal"][:, None, sl]
            t.tmpl["prev"][..., sl] = torch.where(real_q, t.diag[-1][..., sl], 0)
            gathered_pairs(r, P, sl)


BACKEND = Reference


__all__ = [
    "Reference",
    "entropy",
    "sorted_terms",
    "prefix_sums",
    "prefix_distances",
    "diagonals",
    "abs_distance",
    "pair_sums",
    "received",
    "key_masses",
    "columns",
    "gathered_pairs",
]
