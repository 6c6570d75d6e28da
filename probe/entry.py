"""``probe.capture``: the one call that captures a model, whatever it keeps.

Whole patterns, rows, top-k and residuals are the capture engine's (:mod:`probe.capture`, reached
through :mod:`probe.forward`); ``keep="stats"`` streams every attention through the focus
statistics' readers (:mod:`probe.analysis.focus.streamed.reader`) and stores what
:mod:`probe.analysis.focus.streamed.keepstats` makes of them. This module only chooses between the two, so
neither stage imports the other.
"""

from __future__ import annotations

import os
from typing import Any

from probe.analysis.focus.streamed.keepstats import stats_fields
from probe.analysis.focus.streamed.run import stats_readers
from probe.errors import ProbeError


def capture(
    model: Any,
    inputs: Any,
    *,
    tokenizer: Any = None,
    target: Any = None,
    processor: Any = None,
    text: Any = None,
    sampling_rate: int | None = None,
    out: str | os.PathLike | None = None,
    layers: list[int] | None = None,
    heads: list[int] | None = None,
    dtype: Any = None,
    keep: Any = None,
    block: int | None = None,
):
    """:func:`probe.capture.engine.trace.capture`, and ``keep="stats"``: every head's statistics computed
    block by block while the model runs and each residual tensor's norm, no pattern ever whole
    (``block`` query rows at a time, default: see ``probe.capture.consumers.blocks.block_bytes``). See
    ``docs/long-context.md``.
    ``text``: what a vision-language model reads beside the pictures (``processor`` its processor,
    which places the image tokens in it); see ``docs/images.md``."""
    from probe.capture.inputs.images import with_text  # a text read beside pictures by the processor
    from probe.forward import capture as capture_full
    from probe.forward import capture_stats, parse_keep

    processor = with_text(processor, text)

    if parse_keep(keep).kind != "stats":
        if block is not None:
            raise ProbeError("block= sets the row blocks of keep='stats'; drop it for other keeps")
        return capture_full(
            model,
            inputs,
            tokenizer=tokenizer,
            target=target,
            processor=processor,
            sampling_rate=sampling_rate,
            out=out,
            layers=layers,
            heads=heads,
            dtype=dtype,
            keep=keep,
        )
    return capture_stats(
        model,
        inputs,
        stats_readers(),
        stats_fields,
        tokenizer=tokenizer,
        target=target,
        processor=processor,
        sampling_rate=sampling_rate,
        out=out,
        layers=layers,
        heads=heads,
        dtype=dtype,
        block=block,
    )


__all__ = ["capture"]
