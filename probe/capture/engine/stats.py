"""``keep="stats"``: a capture that keeps each head's statistics and the residual norms, nothing whole.

:func:`capture_stats` runs one forward with :class:`~probe.capture.consumers.blocks.BlockConsumer`: every
attention's weights are handed a block of query rows at a time to the readers the caller's
``open_attention(meta, role, [B, H, Q, K])`` makes, and dropped. Residual tensors are turned
into their per-position L2 norms as they arrive (:class:`NormSink`) and the tensors let go. When
the forward is named, the caller's ``finish(meta, readers)`` turns the readers (each under its
pattern's cache key) into ``(tensors, metadata)``: the analysis computes the statistics, so this
package never imports it (``probe.capture`` at the top level passes both in, see
:mod:`probe.analysis.focus.streamed.keepstats`).

The cache holds ``<name>.norm`` ``[batch, pos]`` (float32) for every residual tensor, what
``finish`` returns, and ``keep="stats"`` in the metadata.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from probe.cache import Cache
from probe.cache.cache import open_cache
from probe.cache.writer import check_output
from probe.capture.consumers.blocks import BlockReader
from probe.capture.engine.streamed import DropSink, run_blocks
from probe.errors import ProbeError


class NormSink(DropSink):
    """Keeps the per-position L2 norm ``[batch, pos]`` (float32) of every residual tensor handed to
    it, by handle; everything else (the attentions' empty placeholders) is let go."""

    def __init__(self) -> None:
        super().__init__()
        self.norms: dict[int, Tensor] = {}

    def put(self, tensor: Tensor, owned: bool = False) -> int:
        h = super().put(tensor, owned)
        if tensor.dim() == 3:
            self.norms[h] = tensor.detach().float().norm(dim=-1).cpu()
        return h


def capture_stats(
    model: nn.Module,
    inputs: Any,
    open_attention: Callable[[dict, str, tuple], BlockReader],
    finish: Callable[[dict, dict[str, BlockReader]], tuple[dict[str, Tensor], dict[str, Any]]],
    *,
    tokenizer: Any = None,
    target: Any = None,
    processor: Any = None,
    sampling_rate: int | None = None,
    out: str | os.PathLike | None = None,
    layers: list[int] | None = None,
    heads: list[int] | None = None,
    dtype: Any = None,
    block: int | None = None,
    kinds: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Cache:
    """``probe.capture(model, inputs, keep="stats")`` given the statistics' readers and their
    ``finish`` (see the module docstring). Returns the :class:`~probe.Cache` (written to ``out``
    atomically and opened from there when given). ``kinds``: derived pattern kinds read beside the
    weights (their readers reach ``finish`` under ``<attn>.<kind>``); ``metadata``: entries added
    to the cache's metadata (read after the forward: the kinds' callers may fill them as it runs)."""
    if heads is not None:
        raise ProbeError(
            "keep='stats' computes the statistics of every head; drop heads= (select them in the "
            "HeadStats table instead)"
        )
    if dtype is not None:
        raise ProbeError(
            "keep='stats' stores statistics (float32, the sink profile float64) and residual norms "
            "(float32); drop dtype="
        )
    if out is not None:
        check_output(out)
    sink = NormSink()
    names, meta, consumer = run_blocks(
        model,
        inputs,
        open_attention,
        sink,
        tokenizer=tokenizer,
        target=target,
        processor=processor,
        sampling_rate=sampling_rate,
        layers=layers,
        block=block,
        kinds=kinds,
    )
    tensors = {f"{names[h]}.norm": n for h, n in sorted(sink.norms.items())}
    stats, extra = finish(meta, {names[h]: r for h, r in consumer.readers.items()})
    tensors.update(stats)
    meta = dict(meta)
    meta.update(extra)
    meta.update(metadata or {})
    meta["keep"] = "stats"
    meta["dtype"] = ", ".join(sorted({str(t.dtype).replace("torch.", "") for t in tensors.values()}))
    cache = Cache(tensors, meta)
    if out is None:
        return cache
    cache.save(out)
    return open_cache(out)


__all__ = ["NormSink", "capture_stats"]
