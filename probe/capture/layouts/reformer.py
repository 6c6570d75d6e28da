"""Reformer's attention: a softmax written as ``exp(x - logsumexp(x))``, seen at its ``logsumexp``.

Reformer's attention modules compute their weights as ``torch.exp(dots - torch.logsumexp(dots,
-1, keepdim=True))``, no softmax call. Inside them probe reads each ``logsumexp`` over the keys
and recomputes the weights with the same two ops (the same numbers):

* local attention (``LocalSelfAttention``) over chunks: ``[batch, heads, chunks, c, (before + 1 +
  after)·c]``, query ``a`` of chunk ``i`` over the chunks ``i - before .. i + after``, taken
  cyclically as the model does (``_look_adjacent`` rolls them, so the first chunk's "before" is
  the last chunk where no causal mask hides it); mapped back to ``[batch, heads, T, T]``, zeros
  outside the chunks, a key met twice getting the sum of its weights. A sequence no longer than
  a chunk runs as plain ``[batch, heads, T, T]`` attention and is stored as it is.
* LSH attention (``LSHSelfAttention``) over hash-sorted chunks, the same layout over the sorted
  positions: mapped back through the positions the layer compares for its self mask (``torch.ne``
  of the queries' and keys' sorted positions, read just before the softmax), several hash rounds
  summed with the weights the model gives each round's output (:func:`lsh_pattern`). Refused
  (the layers named) where the sorted positions do not fit. A sequence no longer than a chunk
  runs as plain ``[batch, heads, T, T]`` attention and is stored as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from probe.capture.calls import Call
from probe.capture.layouts.registry import Layout, attention, refuse, register, skipped

LOGSUMEXP = frozenset({torch.logsumexp, Tensor.logsumexp})
# the ops read inside Reformer's attention modules: the softmax's logsumexp, and the comparison
# of query and key positions the LSH layers make for their self mask (the positions they sorted)
REFORMER_OPS = LOGSUMEXP | {torch.ne, Tensor.ne}
LSH_KIND = (
    "Reformer's LSH attention over hash-sorted chunks, mapped back to [query, key] through the "
    "model's sorted positions; the hash rounds combined with the model's weights per round; zeros "
    "where a query did not look"
)
REFORMER_LOCAL_KIND = (
    "Reformer's chunked local attention, mapped back to [query, key] over the sequence the model "
    "ran; zeros outside each query's chunks (taken cyclically, as the model does)"
)

LSH_WHY = (
    "Reformer's LSH attention: its hash-sorted positions were not found as probe reads them "
    "(each hash round a permutation of the sequence), so its chunks cannot be mapped back"
)


def reformer_kind(module: nn.Module | None) -> str | None:
    """``"lsh"`` or ``"local"`` for Reformer's attention modules, else None."""
    if module is None or not hasattr(module, "chunk_length") or not hasattr(module, "num_chunks_before"):
        return None
    return "lsh" if hasattr(module, "num_hashes") else "local"


def chunks_to_keys(probs: Tensor, before: int) -> Tensor:
    """Local weights ``probs`` ``[batch, heads, n, c, m·c]`` (column block ``j`` = chunk ``i - before
    + j`` mod ``n`` of query chunk ``i``) as ``[batch, heads, n·c, n·c]``."""
    b, h, n, c, width = probs.shape
    out = probs.new_zeros(b, h, n * c, n * c)
    for i in range(n):
        for j in range(width // c):
            k = (i - before + j) % n
            out[:, :, i * c : (i + 1) * c, k * c : (k + 1) * c] += probs[:, :, i, :, j * c : (j + 1) * c]
    return out


class ReformerAttention(Layout):
    """Reformer's attention modules (the innermost call), read at their ``logsumexp`` and, for the
    LSH layers, at the comparison of the sorted positions (see the module's docstring). Reads no
    softmax: Reformer calls none."""

    name = "reformer"
    priority = 100
    reads = frozenset()
    ops = frozenset(REFORMER_OPS)

    def claim(self, stack: list[Call], out: Any) -> Call | None:
        return stack[-1] if stack and reformer_kind(stack[-1].module) is not None else None

    def op(self, rec, call: Call, func: Any, args: tuple, kwargs: dict) -> Tensor:
        if func in LOGSUMEXP:
            return self.logsumexp(rec, call, func, args, kwargs)
        out = func(*args, **kwargs)
        q, k = (args + (None, None))[:2]
        if (
            reformer_kind(call.module) == "lsh"
            and isinstance(q, Tensor)
            and isinstance(k, Tensor)
            and q.dim() == k.dim() == 5
            and not q.is_floating_point()
            and q.shape[-1] == 1
            and k.shape[-2] == 1
        ):
            call.chunks = (q[..., 0], k[..., 0, :])  # the sorted positions of queries and keys
        rec.layers.after_op(func, args, kwargs, out)
        return out

    def logsumexp(self, rec, call: Call, func: Any, args: tuple, kwargs: dict) -> Tensor:
        """Run Reformer's ``logsumexp``; its weights are read (stored, mapped back or refused)."""
        out = func(*args, **kwargs)
        x = args[0] if args else kwargs.get("input")
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
        if isinstance(x, Tensor) and dim in (-1, x.dim() - 1) and x.dim() >= 4:
            keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            lse = out if keep else out.unsqueeze(-1)
            self._weights(rec, call, torch.exp(x - lse), lse)
        rec.layers.after_op(func, args, kwargs, out)
        return out

    def _weights(self, rec, call: Call, probs: Tensor, lse: Tensor) -> None:
        """Reformer's weights ``probs`` (``lse``: their logsumexp): plain ``[b, h, T, T]`` ones as
        any softmax, local and LSH chunks mapped back; refused where they do not fit."""
        module = call.module
        if probs.dim() == 4:
            rec.plain_softmax((probs, -1), {}, probs)
            return
        held, call.chunks = call.chunks, None
        if reformer_kind(module) == "lsh" and self._lsh(rec, call, probs, lse, held):
            return
        if reformer_kind(module) == "lsh" or probs.dim() != 5:
            refuse(rec, LSH_WHY if reformer_kind(module) == "lsh" else None)
            return
        c = module.chunk_length
        if probs.shape[-2] != c or probs.shape[-1] % c:
            refuse(rec)
            return
        if skipped(rec):
            return
        pattern = chunks_to_keys(probs, module.num_chunks_before)
        a = attention(rec, tuple(pattern.shape[-2:]), REFORMER_LOCAL_KIND)
        rec.consumer.weights(a, pattern, "softmax")

    def _lsh(self, rec, call: Call, probs: Tensor, lse: Tensor, held) -> bool:
        """LSH weights ``probs`` ``[b, h, chunks, c, m·c]`` over the sorted positions ``held`` (the
        queries' ``[b, h, chunks, c]``, the keys' ``[b, h, chunks, m·c]``) mapped back to
        ``[b, h, T, T]``; False (then refused) where they do not fit."""
        p = call.primary
        if held is None or p is None or p.dim() != 3 or probs.dim() != 5:
            return False
        qi, ki = held
        T = p.shape[1]
        b, h, n, c, m = probs.shape
        if qi.shape != probs.shape[:-1] or ki.shape != (b, h, n, m) or (n * c) % T:
            return False
        rounds = qi.reshape(b, h, -1, T).sort(-1).values  # each round a permutation of 0..T-1
        if not bool((rounds == torch.arange(T, device=qi.device)).all()):
            return False
        if skipped(rec):
            return True
        a = attention(rec, (T, T), LSH_KIND)
        rec.consumer.weights(a, lsh_pattern(probs, lse, qi, ki, T), "softmax")
        return True


def lsh_pattern(probs: Tensor, lse: Tensor, qi: Tensor, ki: Tensor, T: int) -> Tensor:
    """LSH weights ``probs`` ``[b, h, chunks, c, m·c]`` (their per-query logsumexp ``lse``
    ``[b, h, chunks, c, 1]``; queries at positions ``qi`` ``[b, h, chunks, c]``, keys at ``ki``
    ``[b, h, chunks, m·c]``) as ``[b, h, T, T]``. The sorted positions run round by round (``R =
    chunks·c / T`` hash rounds); each round's weights count as the model counts its output,
    ``exp(lse_r − logsumexp over rounds of lse_r)`` per query."""
    b, h, n, c, m = probs.shape
    R = n * c // T
    q = qi.reshape(b, h, R, T).long()
    # each query's logsumexp per round, at its position: [b, h, R, T]
    per_round = torch.zeros(b, h, R, T, dtype=lse.dtype, device=lse.device)
    per_round.scatter_(-1, q, lse.reshape(b, h, R, T))
    w = torch.exp(per_round - torch.logsumexp(per_round, dim=2, keepdim=True))
    w_sorted = torch.gather(w, -1, q).reshape(b, h, n, c, 1)
    rows = qi.long().unsqueeze(-1).expand(b, h, n, c, m)
    cols = ki.long().unsqueeze(-2).expand(b, h, n, c, m)
    out = probs.new_zeros(b, h, T * T)
    out.scatter_add_(-1, (rows * T + cols).reshape(b, h, -1), (probs * w_sorted).reshape(b, h, -1))
    return out.view(b, h, T, T)


REFORMER = register(ReformerAttention())
