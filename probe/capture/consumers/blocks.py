"""A pattern consumer that never holds a whole pattern: each attention handed on row block by row block.

:class:`BlockConsumer` implements the :class:`~probe.capture.hooks.record.PatternConsumer` seam. When an
attention sublayer returns (its role known), it asks ``open_attention(role, shape)`` for a
*block reader* (anything with ``rows(start, end, block)`` and ``close() -> causal or None``) and
hands it the weights ``block`` ``[batch, heads, end - start, kend]`` (float32) of query rows
``start:end``; keys past ``kend`` are zero. SDPA weights are recomputed
(:func:`~probe.capture.patterns.sdpa_blocks`) and dropped block by block, so the memory held is
O(heads · rows · keys), never the layer's whole pattern; a pattern the model computed itself (a
softmax) already exists whole and is sliced. Blocks are valid until the next is handed on. The
shadow of a derived pattern kind (:mod:`probe.capture.consumers.kinds`, ``attn.scale`` set) is
handed on as its scaled weights, each row renormalised to sum 1: readers read distributions.

:func:`probe.capture.engine.streamed.stream_attention` runs one forward with it, residuals
dropped. Which reader, and what it accumulates, is the caller's business
(``probe.analysis.focus.streamed.reader`` builds the focus statistics); analyses reach it through
:mod:`probe.forward`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor

from probe.capture.calls import Attention
from probe.capture.consumers.keep import batch_size, restore_layout
from probe.capture.consumers.scale import scaled
from probe.capture.patterns import sdpa_blocks
from probe.errors import ProbeError

BLOCK_BYTES = 1 << 24  # the float32 weights of one row block on a CPU: at least 16 MiB,
CPU_ROWS = 256  # and room for this many query rows of every head (see block_bytes),
CPU_MAX_BYTES = 1 << 28  # up to 256 MiB
CPU_LAZY_ROWS = 1024  # blocks never written (see block_bytes): this many rows,
CPU_LAZY_MAX_BYTES = 1 << 30  # up to 1 GiB of address space, not of memory
CUDA_BLOCK_BYTES = 1 << 27  # on a GPU: 128 MiB (fewer, larger kernels; the scratch stays under 1 GiB)


class BlockReader(Protocol):
    """Reads one attention's weights row block by row block (see the module docstring)."""

    def rows(self, start: int, end: int, block: Tensor) -> None: ...

    def close(self) -> bool | None: ...


def _reading(reader: Any) -> Any:
    """The reader's own context around its block loop (``reader.reading()``: the CPU statistics
    run torch single-threaded there while their compiled loop takes the cores), else none."""
    ctx = getattr(reader, "reading", None)
    return ctx() if ctx is not None else contextlib.nullcontext()


def _fills(reader: Any, call: tuple) -> bool:
    """Whether ``reader`` computes each block of this SDPA call itself, part by part as it reads
    (``reader.fills(device)``: the CPU statistics' row loop), so the blocks come uncomputed."""
    args, kwargs = call
    q = args[0] if args else kwargs["query"]
    ask = getattr(reader, "fills", None)
    return ask is not None and bool(ask(q.device))


def block_bytes(device: torch.device | str | None, cells: int = 0, lazy: bool = False) -> int:
    """The float32 bytes of one row block on ``device``: :data:`CUDA_BLOCK_BYTES` on a GPU; on a
    CPU :data:`BLOCK_BYTES`, or :data:`CPU_ROWS` query rows of every head where that is more
    (``cells``: batch × heads × keys of the attention), at most :data:`CPU_MAX_BYTES`. A CPU block
    is recomputed a head's rows at a time (``focus/backends/rowloop/rowfused.row_terms``), and
    a matrix product of few rows against many keys spends its time packing the keys: at T =
    16,384 with 12 heads, 16 MiB holds 21 rows a head (``python
    benchmarks/long_context_profile.py --T 16384 --block 128``); and each block has its fixed
    costs (the threads' last tasks, the per-block terms on the calling thread): 256 rows a head
    took 1.5 to 11% less time in all than 128 at T = 4,096 and 16,384, timed in turns
    (docs/performance-history.md, the eighth round).

    ``lazy``: blocks that a reader computes part by part into its threads' own buffers
    (:func:`_fills`): the block's scratch is then address space that nothing writes (only a block
    with a negative weight, which a softmax never gives, is filled in it for a sort), so
    :data:`CPU_LAZY_ROWS` rows, up to :data:`CPU_LAZY_MAX_BYTES`: fewer blocks, fewer of their
    fixed costs (at T = 4,096, 6 layers, in turns in one process: 512 rows 0.96 of the time of
    256, 1,024 rows 0.97 of 512; the peaks within what fresh processes vary by;
    docs/performance-history.md, the fifteenth round)."""
    if torch.device(device or "cpu").type == "cuda":
        return CUDA_BLOCK_BYTES
    if lazy:
        return max(BLOCK_BYTES, min(CPU_LAZY_MAX_BYTES, 4 * CPU_LAZY_ROWS * cells))
    return max(BLOCK_BYTES, min(CPU_MAX_BYTES, 4 * CPU_ROWS * cells))


def block_rows(
    shape: tuple[int, ...], block: int | None, device: torch.device | str | None = None, lazy: bool = False
) -> int:
    """Query rows per block: ``block`` if given, else about :func:`block_bytes` of float32."""
    if block is not None:
        if not isinstance(block, int) or block < 1:
            raise ProbeError(f"block must be a positive number of query rows, not {block!r}")
        return block
    B, H, _, K = shape
    return max(1, block_bytes(device, B * H * K, lazy) // (4 * max(1, B * H * K)))


def _distribution(block: Tensor, scale: Tensor) -> Tensor:
    """A derived kind's block (:mod:`probe.capture.consumers.kinds`): the weights scaled per key,
    each row renormalised to sum 1, as the readers read rows (all-zero rows stay zero)."""
    c = scaled(block, scale, first=True)
    total = c.sum(-1, keepdim=True)
    return torch.where(total > 0, c / total.clamp_min(torch.finfo(c.dtype).tiny), c)


class BlockConsumer:
    """Hands each attention to the reader ``open_attention(role, [B, H, Q, K])`` returns, a row
    block at a time; ``readers`` maps the (sink) handle of every attention read to its reader
    (``sink``: where the handles come from, :class:`probe.capture.engine.streamed.DropSink`)."""

    def __init__(
        self,
        sink: Any,
        open_attention: Callable[[str, tuple], BlockReader],
        block: int | None,
        bar: Any = None,
    ) -> None:
        self.sink = sink
        self.open_attention = open_attention
        self.block = block
        self.bar = bar  # a tqdm bar advanced once per attention read (None: no progress shown)
        self.readers: dict[int, BlockReader] = {}

    def weights(self, attn: Attention, pattern: Tensor, impl: str) -> None:
        p = pattern.detach()
        attn.parts.append(("weights", p, p._version))

    def sdpa(self, attn: Attention, args: tuple, kwargs: dict) -> None:
        attn.parts.append(("sdpa", args, kwargs))

    def close(self, attn: Attention) -> None:
        if not attn.parts:
            return
        kinds = {p[0] for p in attn.parts}
        if len(kinds) > 1:
            raise ProbeError(
                "an attention sublayer computed its heads both with softmax and with SDPA; "
                "capture its patterns whole (probe.capture) instead of streaming them"
            )
        batch = batch_size(attn.primary, attn.qk[0])
        blocks = self._sdpa(attn, batch) if "sdpa" in kinds else self._weights(attn, batch)
        shape = next(blocks)
        reader = self.open_attention(attn.role or "self", shape)
        # a derived kind's shadow (kinds.py) is read as scaled blocks: never by the reader itself
        one_call = kinds == {"sdpa"} and len(attn.parts) == 1 and attn.scale is None
        whole = getattr(reader, "sdpa_call", None)  # a reader that reads one call's q and k itself
        if not (one_call and whole is not None and whole(*attn.parts[0][1:])):
            with _reading(reader):
                if "sdpa" in kinds and hasattr(reader, "recomputed"):
                    reader.recomputed()  # the blocks are probe's own softmax: no weight below 0
                if one_call and _fills(reader, attn.parts[0][1:]):  # computed part by part as read
                    blocks.close()
                    lazy = self._sdpa(attn, batch, lazy=True)
                    next(lazy)  # the shape, as above
                    for i, e, blk, fill in lazy:
                        reader.rows(i, e, blk, fill=fill)
                else:
                    for i, e, blk in blocks:
                        reader.rows(i, e, blk if attn.scale is None else _distribution(blk, attn.scale))
        attn.causal = reader.close() if attn.role == "self" else None
        attn.shape = shape
        attn.handle = self.sink.put(torch.empty(0))
        self.readers[attn.handle] = reader
        attn.parts.clear()
        if self.bar is not None:
            self.bar.update(1)

    def _weights(self, attn: Attention, batch: int | None) -> Iterator[Any]:
        for _, p, v in attn.parts:
            if p._version != v:
                raise RuntimeError(
                    "an attention pattern was modified in place after softmax; "
                    "probe cannot capture it exactly"
                )
        pattern = restore_layout([p for _, p, _ in attn.parts], batch)
        yield tuple(pattern.shape)
        Q = pattern.shape[-2]
        step = block_rows(tuple(pattern.shape), self.block, pattern.device)
        for i in range(0, Q, step):
            e = min(Q, i + step)
            yield i, e, pattern[..., i:e, :].float()

    def _sdpa(self, attn: Attention, batch: int | None, lazy: bool = False) -> Iterator[Any]:
        calls = [(a, k) for _, a, k in attn.parts]
        shapes = []
        for args, kwargs in calls:
            q = args[0] if args else kwargs["query"]
            k = args[1] if len(args) > 1 else kwargs["key"]
            shapes.append((tuple(q.shape[:-2]), q.size(-2), k.size(-2)))
        heads = []
        for lead, _, _ in shapes:
            if len(lead) == 1:  # [batch·heads, L, E]
                if batch is None or lead[0] % batch:
                    raise ProbeError(f"SDPA queries of shape {list(lead)} do not split into batch x heads")
                heads.append((batch, lead[0] // batch))
            elif len(lead) >= 2:
                heads.append((lead[0], int(torch.tensor(lead[1:]).prod())))
            else:
                heads.append((1, 1))
        B, Q, K = heads[0][0], shapes[0][1], shapes[0][2]
        shape = (B, sum(h for _, h in heads), Q, K)
        yield shape
        step = block_rows(shape, self.block, q.device, lazy)
        # a causal call's early blocks may take more rows (the same rows for every call here)
        area = (
            None
            if self.block is not None or len(calls) > 1
            else block_bytes(q.device, B * shape[1] * K, lazy) // (4 * max(1, B * shape[1]))
        )
        if lazy:  # one call: each block uncomputed, with its fill (see sdpa_blocks)
            for i, e, blk, fill in sdpa_blocks(*calls[0][0], **calls[0][1], chunk=step, area=area, lazy=True):
                yield i, e, blk.view(B, shape[1], e - i, blk.size(-1)), fill
            return
        gens = [sdpa_blocks(*a, **k, chunk=step, area=area) for a, k in calls]
        for parts in zip(*gens, strict=True):
            i, e = parts[0][0], parts[0][1]
            blks = [
                blk.reshape(b, h, e - i, blk.size(-1))
                for (b, h), (_, _, blk) in zip(heads, parts, strict=True)
            ]
            yield i, e, blks[0] if len(blks) == 1 else torch.cat(blks, 1)


__all__ = [
    "BlockConsumer",
    "BlockReader",
    "block_rows",
    "block_bytes",
    "BLOCK_BYTES",
    "CPU_ROWS",
    "CPU_LAZY_ROWS",
    "CUDA_BLOCK_BYTES",
]
