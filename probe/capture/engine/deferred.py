"""Deferred rows: the rows of lean decode steps over an append-only KV cache, many steps at once.

A lean decode step (:mod:`probe.capture.engine.lean`) keeps each attention's row, the weights
``softmax(q Kᵀ · scale)`` of its one new query over the keys its SDPA call read. Computed at
every step, that reads the layer's whole key cache once more per step, and for ``{"topk": k}``
runs a top-k per step: small products whose cost is mostly reading memory and starting threads.

When the keys a step read can still be read later, unchanged, the row can wait. That holds for
transformers' ``DynamicLayer`` (checked by exact type: the cache layer that only appends, ``keys =
cat([keys, new])``; sliding-window, static, quantised or offloaded layers are other classes and
never deferred) when the SDPA call's key argument *is* that layer's ``keys`` (not a repeated or
converted copy), with no mask, one query and a batch of one (beam search reorders the cache's rows
between steps), and each step adds exactly one key: the keys step ``t`` read are then the first
``S_t`` keys of every later step's (a cache cropped or grown by more than one key computes the
waiting rows first, against the keys they read). Such a step keeps its scaled query (a few hundred
bytes) and its key count. Every :data:`EVERY` steps, at the end of the trace, and before a row of
the same attention is computed at once, the waiting rows are computed in one product against the
latest keys, the keys past each step's own count masked, one softmax (and one top-k), and handed
to the assembler as a block: the same weights as step by step, up to float rounding.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

EVERY = 64  # steps whose rows wait at most before they are computed


def _dynamic_layer() -> Any:
    cu = sys.modules.get("transformers.cache_utils")
    return getattr(cu, "DynamicLayer", None) if cu is not None else None


class _Waiting:
    """The waiting rows of one attention: scaled queries ``[batch, key heads, group, E]``, each
    step's position and key count, and the latest keys."""

    def __init__(self) -> None:
        self.queries: list[Tensor] = []
        self.positions: list[int] = []
        self.lengths: list[int] = []
        self.keys: Tensor | None = None


class Deferred:
    """The rows a generation's lean steps left waiting (see the module docstring).

    ``kind``: ``"rows"``, ``"topk"`` (with ``k``) or ``"patterns"`` (each step's row of the whole
    pattern); ``heads`` and ``dtype`` as the plan keeps them;
    ``hand(prefix, positions, fields)`` gives the assembler a block: each field ``[batch, heads,
    steps, ...]`` in step order.
    """

    def __init__(
        self, kind: str, k: int, heads: list[int] | None, dtype: Any, hand: Callable[..., None]
    ) -> None:
        self.kind, self.k, self.heads, self.dtype, self.hand = kind, k, heads, dtype, hand
        self.waiting: dict[str, _Waiting] = {}
        self.steps = 0  # rows waiting, over all attentions
        self.deferred = 0  # rows computed deferred so far

    def fits(self, module: nn.Module, q: Tensor, key: Tensor, mask: Any, causal: bool, past: Any) -> bool:
        """Whether this SDPA call's row may wait: one query, no mask, and keys that are an
        append-only cache layer's own (see the module docstring)."""
        if self.kind not in ("rows", "topk", "patterns"):
            return False
        if mask is not None or causal or q.dim() != 4 or key.dim() != 4 or q.size(-2) != 1:
            return False
        if q.size(0) != 1 or key.size(0) != 1:  # beam search reorders the cache's rows between steps
            return False
        if q.size(1) % key.size(1) or key.size(0) not in (1, q.size(0)) or key.size(-1) != q.size(-1):
            return False
        dynamic, idx = _dynamic_layer(), getattr(module, "layer_idx", None)
        layers = getattr(past, "layers", None)
        if dynamic is None or not isinstance(idx, int) or not isinstance(layers, list):
            return False
        if not 0 <= idx < len(layers):
            return False
        return type(layers[idx]) is dynamic and layers[idx].keys is key

    def wait(self, prefix: str, q: Tensor, key: Tensor, scale: Any, position: int) -> None:
        """Keep a step's row of attention ``prefix`` for later (``position``: the step's query)."""
        w = self.waiting.get(prefix)
        if w is not None and key.size(-2) != w.lengths[-1] + 1:
            # the cache did more than append this step's key (cropped, or grown by several): the
            # waiting rows are computed now, against the keys they read
            self.flush(prefix)
            w = None
        if w is None:
            w = self.waiting[prefix] = _Waiting()
        B, H, _, E = q.shape
        s = 1.0 / math.sqrt(E) if scale is None else scale
        w.queries.append((q.float() * s).reshape(B, key.size(1), H // key.size(1), E))
        w.positions.append(position)
        w.lengths.append(key.size(-2))
        w.keys = key
        self.steps += 1

    def due(self) -> bool:
        return self.steps >= EVERY * max(1, len(self.waiting))

    def flush(self, prefix: str | None = None) -> None:
        """Compute the waiting rows (of ``prefix``, or of every attention) and hand them on."""
        for p in [prefix] if prefix is not None else list(self.waiting):
            w = self.waiting.pop(p, None)
            if w is not None and w.queries:
                self.steps -= len(w.queries)
                self.deferred += len(w.queries)
                self.hand(p, w.positions, self._fields(w))

    @torch.no_grad()
    def _fields(self, w: _Waiting) -> dict[str, Tensor]:
        q = torch.cat(w.queries, dim=2)  # [B, Hk, M·g, E]: step-major, each step's group of heads
        B, Hk, _, E = q.shape
        M, S = len(w.queries), max(w.lengths)
        g = q.size(2) // M
        scores = torch.matmul(q, w.keys[..., :S, :].float().transpose(-1, -2))  # [B, Hk, M·g, S]
        # head h = kh·g + j (the layout SDPA's grouped-query heads have), one row per step
        scores = scores.view(B, Hk, M, g, S).permute(0, 1, 3, 2, 4).reshape(B, Hk * g, M, S)
        lengths = torch.tensor(w.lengths, device=scores.device)
        unseen = torch.arange(S, device=scores.device) >= lengths[:, None]  # keys after each step's
        scores.masked_fill_(unseen, float("-inf"))
        rows = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
        if self.heads is not None:
            rows = rows[:, self.heads]
        if self.kind == "topk":
            values, indices = rows.topk(min(self.k, S), dim=-1)
            indices = torch.where(indices < lengths[:, None], indices, -1)  # a row with < k keys
            return {
                "topk_values": self._dtype(values),
                "topk_indices": indices.int(),
                "topk_mass": self._dtype(values.sum(-1)),
            }
        return {"rows" if self.kind == "rows" else "pattern": self._dtype(rows)}

    def _dtype(self, t: Tensor) -> Tensor:
        return t.to(self.dtype) if self.dtype is not None and t.dtype != self.dtype else t


__all__ = ["EVERY", "Deferred"]
