"""Canine's local attention, computed chunk by chunk, mapped back to ``[query, key]`` over the whole sequence.

Canine's local attention (its ``initial_char_encoder``) runs one softmax per pair of chunks: the
queries ``from_start:from_end`` over the keys ``to_start:to_end`` (and, where the module says
so, the first position ahead of them). Each chunk's weights are placed at their queries and keys
of one ``[batch, heads, T, T]`` pattern, zeros outside the chunks; a key that appears twice in a
chunk (the first position, when it is also in the chunk) gets the sum of its weights, the share
of the values the model reads at that position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from probe.capture.calls import Call
from probe.capture.layouts.registry import Layout, hand_on, refuse, register, skipped

LOCAL_KIND = (
    "local attention computed chunk by chunk, mapped back to [query, key] over the whole "
    "sequence; zeros outside each query's chunk"
)


def is_chunked(module: nn.Module) -> bool:
    """Whether ``module`` runs Canine-style chunked local attention (``local`` and its chunk sizes)."""
    return getattr(module, "local", None) is True and hasattr(module, "attend_from_chunk_stride")


def chunk_pairs(module: nn.Module, length: int) -> list[tuple[int, int, list[int]]]:
    """``(from_start, from_end, keys)`` of each softmax ``module`` runs over a ``length``-long
    sequence, in order, as Canine's ``CanineAttention`` builds them (``keys``: key positions)."""
    m = module
    froms, tos = [], []
    start = 0
    if m.first_position_attends_to_all:
        froms.append((0, 1))
        tos.append((0, length))
        start = 1
    for s in range(start, length, m.attend_from_chunk_stride):
        froms.append((s, min(length, s + m.attend_from_chunk_width)))
    for s in range(0, length, m.attend_to_chunk_stride):
        tos.append((s, min(length, s + m.attend_to_chunk_width)))
    first = [0] if m.always_attend_to_first_position else []
    return [(fs, fe, first + list(range(ts, te))) for (fs, fe), (ts, te) in zip(froms, tos, strict=False)]


@dataclass
class Chunks:
    """The chunks of one local-attention call seen so far, gathered into ``pattern``."""

    pairs: list[tuple[int, int, list[int]]]
    pattern: Tensor | None = None
    seen: int = 0

    def add(self, weights: Tensor, length: int) -> bool:
        """Place one chunk's ``[batch, heads, q, k]`` weights; True when the last chunk arrived.
        Raises ValueError when the chunk does not have the shape its pair says."""
        if self.seen >= len(self.pairs):
            raise ValueError("more chunks than the module's chunk pairs")
        fs, fe, keys = self.pairs[self.seen]
        if weights.dim() != 4 or tuple(weights.shape[-2:]) != (fe - fs, len(keys)):
            raise ValueError(
                f"chunk {self.seen} has shape {tuple(weights.shape)}, not q={fe - fs}, k={len(keys)}"
            )
        if self.pattern is None:
            b, h = weights.shape[:2]
            self.pattern = weights.new_zeros(b, h, length, length)
        index = torch.tensor(keys, device=weights.device)
        self.pattern[:, :, fs:fe].index_add_(-1, index, weights)
        self.seen += 1
        return self.seen == len(self.pairs)


class CanineChunks(Layout):
    """Canine's chunks: claimed by the chunked call the softmax runs inside (anywhere up the stack);
    the last chunk hands on the pattern over the whole sequence. A chunk that does not fit the
    module's chunks is refused."""

    name = "canine-chunks"
    priority = 10

    def claim(self, stack: list[Call], out: Any) -> Call | None:
        for c in reversed(stack):
            if is_chunked(c.module):
                return c
        return None

    def softmax(self, rec, call: Call, out: Any) -> bool:
        length = call.primary.shape[1] if call.primary is not None and call.primary.dim() == 3 else 0
        if call.chunks is None:
            call.chunks = Chunks(chunk_pairs(call.module, length))
        try:
            done = call.chunks.add(out, length)
        except ValueError:
            refuse(rec)
            return True
        if not done:
            return True
        pattern, call.chunks = call.chunks.pattern, None
        if not skipped(rec):
            hand_on(rec, pattern, LOCAL_KIND)
        return True


CANINE = register(CanineChunks())
