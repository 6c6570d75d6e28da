"""Local attention computed chunk by chunk, mapped back to ``[query, key]`` over the whole sequence.

Canine's local attention (its ``initial_char_encoder``) runs one softmax per pair of chunks: the
queries ``from_start:from_end`` over the keys ``to_start:to_end`` (and, where the module says
so, the first position ahead of them). Each chunk's weights are placed at their queries and keys
of one ``[batch, heads, T, T]`` pattern, zeros outside the chunks; a key that appears twice in a
chunk (the first position, when it is also in the chunk) gets the sum of its weights, the share
of the values the model reads at that position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

LOCAL_KIND = (
    "local attention computed chunk by chunk, mapped back to [query, key] over the whole "
    "sequence; zeros outside each query's chunk"
)


BAND_KIND = (
    "sliding-window attention (Longformer/LED), mapped back to [query, key] over the sequence the "
    "model ran (padded by the model to a multiple of its window); zeros outside each query's window"
)
BLOCK_KIND = (
    "block-local attention (LongT5), mapped back to [query, key]; zeros outside each query's "
    "three blocks; a padding query's weight on positions past the sequence's ends is not stored"
)
# attributes of the modules that compute local attention over a layout probe does not map yet:
# LongT5's transient-global blocks (their global keys are summaries of blocks, not positions)
UNMAPPED = ("global_block_size",)


def block_len_of(module: nn.Module) -> int | None:
    """The block length of LongT5's local attention module (blocks without global keys), else None."""
    n = getattr(module, "block_len", None)
    return n if isinstance(n, int) and not hasattr(module, "global_block_size") else None


def block_pattern(probs: Tensor, length: int) -> Tensor:
    """LongT5's local weights ``probs`` ``[batch, blocks, heads, n, 3n]`` (query ``a`` of block ``i``
    over the keys of blocks ``i - 1, i, i + 1``) mapped back to ``[batch, heads, T, T]`` for the
    ``length`` = T positions, zeros elsewhere."""
    b, nb, h, n, _ = probs.shape
    canvas = probs.new_zeros(b, h, nb * n, (nb + 2) * n)  # key column k + n holds key k
    for i in range(nb):
        canvas[:, :, i * n : (i + 1) * n, i * n : (i + 3) * n] = probs[:, i]
    return canvas[:, :, :length, n : n + length].contiguous()


def window_of(module: nn.Module) -> int | None:
    """The one-sided window of a Longformer/LED sliding-chunk self-attention module, else None."""
    w = getattr(module, "one_sided_attn_window_size", None)
    return w if isinstance(w, int) else None


def band_pattern(probs: Tensor, w: int, masked: Tensor) -> Tensor:
    """Longformer's sliding-window weights ``probs`` ``[batch, T, heads, 2w + 1]`` (column ``j`` is
    the key ``i - w + j`` of query ``i``) mapped back to ``[batch, heads, T, T]``, zeros outside the
    window and on the rows of the ``masked`` ``[batch, T]`` queries (the model zeroes them)."""
    b, T, h, _ = probs.shape
    out = probs.new_zeros(b, h, T, T)
    for j in range(2 * w + 1):
        d = j - w  # key offset from the query
        if abs(d) >= T:
            continue
        rows = probs[:, : T - d, :, j] if d >= 0 else probs[:, -d:, :, j]
        out.diagonal(offset=d, dim1=-2, dim2=-1).copy_(rows.transpose(1, 2))
    return out.masked_fill(masked[:, None, :, None], 0.0)


def is_unmapped(module: nn.Module) -> bool:
    """Whether ``module`` computes local attention whose layout probe does not map back yet."""
    return any(hasattr(module, a) for a in UNMAPPED)


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
