"""Scratch reused across the blocks and layers of one streamed run, and the template pairs.

:class:`Workspace` holds the buffers every backend computes its block's temporaries in (a fresh
64 MiB tensor per operation costs more in page faults than the arithmetic it holds: a multiply
into a new tensor 33 ms, into a reused one 6 ms, on ``[1, 12, 341, 4096]`` blocks) and remembers
each stack's duplicate-token and induction pairs (:func:`template_pairs`) for the next layer.
"""

from __future__ import annotations

import math

import torch


class Pairs(dict):
    """:func:`template_pairs`' ``{name: (b, i, j, hits)}``, with room (``memo``) for what a reader
    derives from them once (the CPU row loop's index of them, :func:`~.rowloop.rowparts.pairs_csr`):
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


__all__ = ["Workspace", "Pairs", "template_pairs"]
