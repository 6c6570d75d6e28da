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

from probe.capture.calls import Call
from probe.capture.compressed import CompressedHandlers, is_compressed
from probe.capture.globallocal import GlobalLocalHandlers, global_block_of
from probe.capture.ngram import NgramHandlers, ngram_of
from probe.capture.reformer import ReformerHandlers

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


DEPTH_NOTE = (
    "a softmax of learned queries over the outputs of earlier blocks (block attention residuals, "
    "Inkling2): weights over depth, not keys"
)


def mixes_blocks(call: Call, out: Tensor) -> bool:
    """Whether the softmax ``out`` mixes the outputs of earlier blocks (Inkling2's block attention
    residuals): a module with a learned ``query`` handed the stacked block states ``[batch, T,
    n, d]`` (and the block being built), whose weights are ``[batch, T, q, n + 1]``."""
    p, q = call.primary, getattr(call.module, "query", None)
    if not isinstance(q, nn.Parameter) or p is None or p.dim() != 4 or not isinstance(out, Tensor):
        return False
    return out.dim() == 4 and tuple(out.shape[:2]) == tuple(p.shape[:2]) and out.shape[-1] == p.shape[2] + 1


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


class LocalHandlers(GlobalLocalHandlers, NgramHandlers, ReformerHandlers, CompressedHandlers):
    """The :class:`~probe.capture.record.Recorder`'s handlers of local attention: a softmax over a
    chunked, banded or blocked layout mapped back to ``[query, key]`` and handed to the consumer,
    or refused (the recorder's ``_unseen``). Uses the recorder's ``stack``, ``consumer``,
    ``wants``, ``note_event``, ``_open`` and ``_unseen``."""

    def _local(self, out: Tensor) -> bool:
        """Whether the softmax ``out`` is local attention (Canine's chunks, Longformer/LED's band,
        LongT5's blocks, Pegasus-X's blocks with global tokens, or a layout refused); handled here
        when it is."""
        local = self._chunked_call()
        if local is not None:
            self._chunk(local, out)
            return True
        inner = self.stack[-1].module if self.stack else None
        if inner is None:
            return False
        if mixes_blocks(self.stack[-1], out):
            if self.layers.layer is not None:
                self.layers.layer.skipped.add(DEPTH_NOTE)
            return True
        if is_compressed(inner) and isinstance(out, Tensor) and out.dim() == 4:
            self._compressed(self.stack[-1], out)
            return True
        ngram = ngram_of(inner)
        if ngram is not None:
            return self._predict_streams(self.stack[-1], out, ngram)
        if is_unmapped(inner):
            self._unseen()  # a layout that could pass for a pattern by its sizes: never stored
            return True
        band, block, glob = window_of(inner), block_len_of(inner), global_block_of(inner)
        if glob is not None:
            self._global_local(self.stack[-1], out, glob)
            return True
        if band is not None:
            self._band(self.stack[-1], out, band)
        elif block is not None:
            self._block(self.stack[-1], out, block)
        return band is not None or block is not None

    def _chunked_call(self) -> Call | None:
        """The call running chunked local attention (Canine's) that this softmax is inside, if any."""
        for c in reversed(self.stack):
            if is_chunked(c.module):
                return c
        return None

    def _chunk(self, call: Call, out: Tensor) -> None:
        """One chunk's weights of a chunked local attention; the last one hands on the pattern
        over the whole sequence. A chunk that does not fit the module's chunks is refused (unseen)."""
        length = call.primary.shape[1] if call.primary is not None and call.primary.dim() == 3 else 0
        if call.chunks is None:
            call.chunks = Chunks(chunk_pairs(call.module, length))
        try:
            done = call.chunks.add(out, length)
        except ValueError:
            self._unseen()
            return
        if not done:
            return
        pattern, call.chunks = call.chunks.pattern, None
        if not self.wants():
            self.note_event()
            return
        a = self._open(tuple(pattern.shape[-2:]), "softmax")
        a.kind = LOCAL_KIND
        self.consumer.weights(a, pattern, "softmax")

    def _band(self, call: Call, out: Tensor, w: int) -> None:
        """Longformer/LED's sliding-window softmax ``[batch, T, heads, 2w + 1]`` mapped back to
        ``[batch, heads, T, T]``. Refused (unseen) where it has global columns or its mask is not
        found: global attention is not mapped yet."""
        if not isinstance(out, Tensor) or out.dim() != 4 or out.shape[-1] != 2 * w + 1:
            self._unseen()  # global keys joined ahead of the window, or the global queries' softmax
            return
        b, T = out.shape[:2]
        masks = [t for t in call.inputs if t.is_floating_point() and tuple(t.shape) == (b, T)]
        if len(masks) != 1:
            self._unseen()
            return
        if not self.wants():
            self.note_event()
            return
        pattern = band_pattern(out, w, masks[0] < 0)  # the model's is_index_masked
        a = self._open((T, T), "softmax")
        a.kind = BAND_KIND
        self.consumer.weights(a, pattern, "softmax")

    def _block(self, call: Call, out: Tensor, n: int) -> None:
        """LongT5's local softmax ``[batch, blocks, heads, n, 3n]`` mapped back to ``[batch, heads,
        T, T]``; refused (unseen) when it does not have that shape."""
        p = call.primary
        if p is None or p.dim() != 3 or out.dim() != 5 or out.shape[-2:] != (n, 3 * n):
            self._unseen()
            return
        if out.shape[1] * n < p.shape[1]:
            self._unseen()
            return
        if not self.wants():
            self.note_event()
            return
        T = p.shape[1]
        a = self._open((T, T), "softmax")
        a.kind = BLOCK_KIND
        self.consumer.weights(a, block_pattern(out, T), "softmax")
