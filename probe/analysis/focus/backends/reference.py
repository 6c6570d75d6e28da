"""The per-row terms of one block of pattern rows, computed in few passes (the streamed path).

``head_stats(model, ...)`` reduces every block of recomputed weights ``P`` ``[B, h, r, kend]``
(query rows ``rows``, keys past ``kend`` zero) to per-query terms; the definitions are those of
:mod:`probe.analysis.focus.definitions.terms` (and the whole-pattern code there is the independent check
in the tests). What makes this path fast on a CPU, measured on ``[1, 12, 341, 4096]`` blocks:

* **warm buffers** (:class:`Workspace`): a fresh 64 MiB tensor per operation costs more in page
  faults than the arithmetic it holds (a multiply into a new tensor 33 ms, into a reused one
  6 ms), so every full-size temporary lives in a buffer reused across blocks and layers;
* **one prefix sum per row** ``C`` gives the mass within any distance of the query
  (``C[i + d] − C[i − d − 1]``), so ``beyond_<D>`` is two gathers per row and ``reach90`` a
  binary search of ``log2 K`` gathers, instead of a ``[r, K]`` distance histogram;
* **sparse templates**: the duplicate-token and induction pairs are few; their weights are
  gathered pair by pair instead of multiplying the block by a mask;
* the effective span's sort (numpy's SIMD sort, in place) is split over threads by rows.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from probe.analysis.focus.definitions.reach import BEYOND, REACH_MASS
from probe.analysis.focus.whole.rows import SPAN_MASS

_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max(1, min(16, torch.get_num_threads(), os.cpu_count() or 1)))
    return _POOL


class Pairs(dict):
    """:func:`template_pairs`' ``{name: (b, i, j, hits)}``, with room (``memo``) for what a reader
    derives from them once (the CPU row loop's index of them, :func:`~.rowparts.pairs_csr`):
    every layer of a stack reads the same pairs (:meth:`Workspace.pairs`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.memo: dict = {}


class Workspace:
    """Scratch buffers reused across the blocks and layers of one run: ``get(name, shape, dtype,
    device)`` is a view of a buffer grown as needed (its contents are whatever was left there)."""

    MEMO_PAIRS = 1 << 23  # template pairs remembered across layers (3 int64 each: ~200 MiB)

    def __init__(self) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}
        self._pairs: dict[tuple, dict] = {}
        self._n_pairs = 0

    def pairs(
        self, qs, ks, q0: int, q1: int, kend: int, device: torch.device | str = "cpu"
    ) -> dict[str, tuple[torch.Tensor, ...]]:
        """:func:`template_pairs` of these rows on ``device``, remembered for the next layer
        (every layer of a stack reads the same tokens) while fewer than :data:`MEMO_PAIRS` pairs
        are held."""
        key = (id(qs), id(ks), q0, q1, kend, str(device))
        got = self._pairs.get(key)
        if got is None:
            got = Pairs(
                {n: tuple(x.to(device) for x in v) for n, v in template_pairs(qs, ks, q0, q1, kend).items()}
            )
            n = sum(v[0].numel() for v in got.values())
            if self._n_pairs + n <= self.MEMO_PAIRS:
                self._pairs[key] = got
                self._n_pairs += n
        return got

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        n = math.prod(shape)
        key = (name, dtype, str(device))
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            self._bufs.pop(key, None)  # let the smaller buffer go before the larger is made
            buf = torch.empty(n, dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf[:n].view(shape)


def entropy(P: torch.Tensor, ws: Workspace) -> torch.Tensor:
    """``-Σ_j p log p`` per row ``[B, h, r]`` (as :class:`~probe.analysis.focus.whole.rows._Rows`:
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


def distance_terms(
    C: torch.Tensor, rows: torch.Tensor, K: int
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """``({D: beyond_D}, reach)`` ``[B, h, r]`` from the prefix sums ``C`` of the rows ``rows``
    (``K`` keys in all): the definitions of :mod:`probe.analysis.focus.definitions.reach`."""
    B, h, r, _ = C.shape
    total = C[..., -1]
    beyond = {}
    for D in BEYOND:
        if D < K:
            beyond[D] = total - _within(C, rows, torch.tensor(D, device=C.device))
        else:
            beyond[D] = torch.zeros_like(total)
    # reach: the smallest d with within(d) >= REACH_MASS · total; within(K - 1) is the total,
    # and within(d) never decreases with d (prefix sums of non-negative weights), so bisect
    target = REACH_MASS * total
    lo = torch.zeros(B, h, r, dtype=torch.long, device=C.device)
    hi = torch.full((B, h, r), K - 1, dtype=torch.long, device=C.device)
    for _ in range(max(1, (K - 1).bit_length())):
        mid = (lo + hi) // 2
        ok = _within(C, rows, mid) >= target
        hi = torch.where(ok, mid, hi)
        lo = torch.where(ok, lo, mid + 1)
    return beyond, hi.to(C.dtype)


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


def template_pairs(qs, ks, q0: int, q1: int, kend: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """The duplicate-token and induction pairs among query rows ``q0:q1`` and keys ``:kend``:
    ``{name: (b, i, j, hits)}`` (``i`` relative to ``q0``; ``hits`` ``[B, r]`` whether a query
    has a match), the masks ``D`` of :mod:`probe.analysis.focus` for these rows, in row-major order.

    Found without a ``[rows, keys]`` mask: the real keys sorted by (token id, position) put each
    query's earlier same-token keys in one run, found by two binary searches. Duplicate pairs are
    ``(i, j)`` with ``ids[j] == ids[i]``, ``j < i``, both real; induction pairs are ``(i, m + 1)``
    for each duplicate pair ``(i, m)`` whose ``m + 1`` is a real key (the token after an earlier
    copy of the query's token)."""
    B, r = qs.real.shape[0], q1 - q0
    found: dict[str, list] = {"dup": [], "induction": []}
    hits = {n: torch.zeros(B, r, dtype=torch.bool) for n in found}
    rows = torch.arange(q0, q1)
    for b in range(B):
        real = ks.real[b, :kend]
        pos = torch.arange(kend)[real]
        order_key, order = (ks.ids[b, :kend][real] * kend + pos).sort()
        pos = pos[order]
        qid = qs.ids[b, q0:q1]
        lo = torch.searchsorted(order_key, qid * kend)
        hi = torch.searchsorted(order_key, qid * kend + rows)  # keys of the same token before the query
        n = torch.where(qs.real[b, q0:q1], hi - lo, 0)
        i = torch.repeat_interleave(torch.arange(r), n)
        within = torch.arange(int(n.sum())) - torch.repeat_interleave(n.cumsum(0) - n, n)
        j = pos[torch.repeat_interleave(lo, n) + within]
        found["dup"].append((b, i, j))
        hits["dup"][b] = n > 0
        nxt = j + 1
        ok = nxt < kend
        ok[ok.clone()] = ks.real[b, nxt[ok]]
        found["induction"].append((b, i[ok], nxt[ok]))
        hits["induction"][b] = torch.bincount(i[ok], minlength=r) > 0
    out = {}
    for name, parts in found.items():
        b_idx = torch.cat([torch.full_like(i, b) for b, i, _ in parts])
        out[name] = (
            b_idx,
            torch.cat([i for _, i, _ in parts]),
            torch.cat([j for *_, j in parts]),
            hits[name],
        )
    return out


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


__all__ = [
    "Workspace",
    "entropy",
    "sorted_terms",
    "prefix_sums",
    "distance_terms",
    "diagonals",
    "abs_distance",
    "template_pairs",
    "pair_sums",
    "received",
]
