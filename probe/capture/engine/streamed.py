"""One forward whose attentions are read a block of query rows at a time and nothing whole is kept.

:func:`run_blocks` prepares the inputs as :func:`probe.capture` would, runs the model once under
a :class:`~probe.capture.engine.tracer.Tracer` whose consumer is a
:class:`~probe.capture.consumers.blocks.BlockConsumer`, and names the forward: each attention's
reader under the cache key its pattern would have. Residual tensors go to the sink it is given: a
:class:`DropSink` lets them go (:func:`stream_attention`, for ``probe.head_stats(model, ...)`` and
``probe.retrieval_scores``); ``keep="stats"`` keeps their norms (:mod:`probe.capture.engine.stats`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from probe.cache.selection import Selection
from probe.capture.consumers.blocks import BlockConsumer, BlockReader, block_rows
from probe.capture.engine.claims import claim, release
from probe.capture.engine.naming import check_forward, name
from probe.capture.engine.tracer import Tracer
from probe.capture.inputs.images import with_text
from probe.capture.inputs.route import prepare
from probe.errors import ProbeError


class DropSink:
    """A sink that keeps nothing: every tensor handed to it is let go at once (residuals of a
    statistics-only run); handles are counted so the capture can still be named."""

    empty = None

    def __init__(self) -> None:
        self.n = 0

    def put(self, tensor: Tensor, owned: bool = False) -> int:
        self.n += 1
        return self.n - 1

    def held(self) -> list[Tensor]:
        return []

    def wait_written(self, tensor: Tensor) -> None:
        """Nothing is written."""


def run_blocks(
    model: nn.Module,
    inputs: Any,
    open_attention: Callable[[dict, str, tuple], BlockReader],
    sink: DropSink,
    *,
    tokenizer: Any = None,
    target: Any = None,
    processor: Any = None,
    sampling_rate: int | None = None,
    layers: list[int] | None = None,
    block: int | None = None,
    progress: bool = False,
    kinds: dict[str, Any] | None = None,
) -> tuple[dict[int, str], dict[str, Any], BlockConsumer]:
    """One forward with a :class:`BlockConsumer` into ``sink``: ``(names, meta, consumer)``, each
    sink handle's cache key, the cache's metadata and the consumer (its ``readers`` by handle).
    ``progress``: a bar counting the attentions read (a long context takes minutes on a CPU).
    ``kinds``: derived pattern kinds read beside the weights (:mod:`probe.capture.consumers.kinds`;
    their readers under ``<attn>.<kind>``)."""
    if not isinstance(model, nn.Module):
        raise ProbeError(f"probe runs torch.nn.Module models, not {type(model).__name__}")
    selection = Selection.parse(layers, None)
    block_rows((1, 1, 1, 1), block)
    prepared = prepare(
        model, inputs, tokenizer=tokenizer, target=target, processor=processor, sampling_rate=sampling_rate
    )
    meta = prepared.meta
    bar = tqdm(desc="attentions read", unit=" attentions", disable=not progress, leave=False)
    consumer = BlockConsumer(sink, lambda role, shape: open_attention(meta, role, shape), block, bar)
    tracer = Tracer(model, sink, selection=selection, consumer=consumer, kinds=kinds)
    claim(model)
    try:
        with torch.no_grad(), tracer:
            prepared.run()
    finally:
        release(model)
        bar.close()
    check_forward(tracer, model, selection)
    names, full = name(tracer, model, meta, selection)
    return names, full, consumer


def stream_attention(
    model: nn.Module,
    inputs: Any,
    open_attention: Callable[[dict, str, tuple], BlockReader],
    *,
    tokenizer: Any = None,
    target: Any = None,
    layers: list[int] | None = None,
    block: int | None = None,
    progress: bool = False,
    processor: Any = None,
    text: Any = None,
    sampling_rate: int | None = None,
) -> tuple[dict[str, Any], dict[str, BlockReader]]:
    """Run ``model`` once on ``inputs`` (as :func:`probe.capture` would), handing every attention
    pattern row block by row block to ``open_attention(meta, role, [B, H, Q, K])``'s reader; keep
    nothing else (residuals are dropped).

    ``block``: query rows per block (default: :func:`block_bytes` of float32 weights per block).
    Returns ``(meta, readers)``: the metadata a cache of the same call would hold, and each
    reader under the cache key its pattern would have (``decoder.blocks.0.self_attn.pattern``).
    ``processor``, ``text`` and ``sampling_rate``: pictures or sound, as for :func:`probe.capture`.
    """
    names, full, consumer = run_blocks(
        model,
        inputs,
        open_attention,
        DropSink(),
        tokenizer=tokenizer,
        target=target,
        layers=layers,
        block=block,
        progress=progress,
        processor=with_text(processor, text),
        sampling_rate=sampling_rate,
    )
    return full, {names[h]: r for h, r in consumer.readers.items()}


__all__ = ["DropSink", "run_blocks", "stream_attention"]
