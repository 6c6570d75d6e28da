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
* LSH attention (``LSHSelfAttention``) over hash-sorted chunks: refused (the layers are named)
  where it chunks; plain ``[batch, heads, T, T]`` attention (a sequence no longer than a chunk,
  every position its own bucket order) is stored as it is.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

LOGSUMEXP = frozenset({torch.logsumexp, Tensor.logsumexp})
REFORMER_LOCAL_KIND = (
    "Reformer's chunked local attention, mapped back to [query, key] over the sequence the model "
    "ran; zeros outside each query's chunks (taken cyclically, as the model does)"
)

LSH_WHY = (
    "Reformer's LSH attention over hash-sorted chunks is not mapped back to [query, key] yet "
    "(its local-attention layers are); give attn_layers of 'local' only, or a sequence no longer "
    "than lsh_attn_chunk_length"
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


class ReformerHandlers:
    """The recorder's handler of Reformer's ``logsumexp`` (see the module's docstring). Uses the
    recorder's ``stack``, ``layers``, ``consumer``, ``wants``, ``note_event``, ``_open``,
    ``_softmax`` and ``_unseen``."""

    def in_reformer(self) -> bool:
        """Whether the op running now is inside a Reformer attention module."""
        return bool(self.stack) and reformer_kind(self.stack[-1].module) is not None

    def logsumexp(self, func, args: tuple, kwargs: dict) -> Tensor:
        """Run Reformer's ``logsumexp``; its weights are read (stored, mapped back or refused)."""
        out = func(*args, **kwargs)
        x = args[0] if args else kwargs.get("input")
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
        if isinstance(x, Tensor) and dim in (-1, x.dim() - 1) and x.dim() >= 4:
            keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            probs = torch.exp(x - (out if keep else out.unsqueeze(-1)))
            self._reformer_weights(probs)
        self.layers.after_op(func, args, kwargs, out)
        return out

    def _reformer_weights(self, probs: Tensor) -> None:
        """Reformer's weights ``probs``: plain ``[b, h, T, T]`` ones as any softmax, local chunks
        mapped back, LSH chunks refused."""
        module = self.stack[-1].module
        if probs.dim() == 4:
            self._softmax((probs, -1), {}, probs)
            return
        if reformer_kind(module) == "lsh" or probs.dim() != 5:
            self._unseen()
            if reformer_kind(module) == "lsh" and LSH_WHY not in self.forward.unseen_why:
                self.forward.unseen_why.append(LSH_WHY)
            return
        c = module.chunk_length
        if probs.shape[-2] != c or probs.shape[-1] % c:
            self._unseen()
            return
        if not self.wants():
            self.note_event()
            return
        pattern = chunks_to_keys(probs, module.num_chunks_before)
        a = self._open(tuple(pattern.shape[-2:]), "softmax")
        a.kind = REFORMER_LOCAL_KIND
        self.consumer.weights(a, pattern, "softmax")
