"""``probe.head_stats``: the one entry to the focus statistics, of caches or of a model run.

A cache, a path or an iterable of them goes to a :class:`~.accumulator.FocusAccumulator` cache by
cache (:meth:`~.accumulator.FocusAccumulator.add` picks the path for each: whole patterns, kept
rows, or a ``keep="stats"`` cache); a model goes to one streamed forward
(:mod:`probe.analysis.focus.streamed`). Either way the result is a :class:`~.result.HeadStats`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from probe.analysis.focus.accumulator import FocusAccumulator
from probe.analysis.focus.result import HeadStats
from probe.analysis.focus.streamed.run import fold_readers, run_model
from probe.cache import Cache, load
from probe.errors import ProbeError


def model_head_stats(model: Any, inputs: Any, **options: Any) -> HeadStats:
    """Focus statistics of every head of ``model`` on ``inputs`` from one forward, block by block
    (``options`` as :func:`~.streamed.run.run_model` takes them); the same :class:`HeadStats` as
    ``head_stats(capture(...))``, less the rollout (``not_computed["rollout"]`` gives the reason)."""
    meta, readers = run_model(model, inputs, **options)
    acc = FocusAccumulator()
    fold_readers(acc, meta, readers)
    return acc.result()


def _as_caches(obj: Any) -> tuple[Iterable[Cache], int | None]:
    if isinstance(obj, (Cache, str, os.PathLike)):
        obj = [obj]
    try:
        n = len(obj)
    except TypeError:
        n = None

    def gen():
        for c in obj:
            if isinstance(c, (str, os.PathLike)):
                c = load(Path(c))
            if not isinstance(c, Cache):
                raise ProbeError(f"head_stats reads probe caches (or their paths), not {type(c).__name__}")
            yield c

    return gen(), n


def head_stats(
    cache_or_caches: Any,
    inputs: Any = None,
    *,
    rollout: bool = True,
    progress: bool = True,
    tokenizer: Any = None,
    target: Any = None,
    layers: list[int] | None = None,
    block: int | None = None,
    processor: Any = None,
    text: Any = None,
    sampling_rate: int | None = None,
) -> HeadStats:
    """Focus statistics of every captured head (see :mod:`probe.analysis.focus` for definitions).

    ``cache_or_caches``: a :class:`probe.Cache`, a cache path, or an iterable of them (a list,
    or a generator that captures text after text: only one cache is held at a time). Returns
    :class:`HeadStats`; with several texts each metric is the mean over texts with ``_std``.

    Or a model with its ``inputs`` (``tokenizer``, ``target``, ``layers``, and pictures or sound
    with ``processor``, ``text``, ``sampling_rate``, as for :func:`probe.capture`): one forward,
    every statistic computed ``block`` query rows at a time
    while it runs, no pattern ever held whole (:mod:`probe.analysis.focus.streamed`); the same
    table as for the captured cache, without the rollout (``HeadStats.not_computed``).
    ``progress``: a bar (over caches, or over the attentions a model's forward reads).
    """
    if isinstance(cache_or_caches, torch.nn.Module):
        if inputs is None:
            raise ProbeError("head_stats(model, inputs): give the inputs to run the model on")
        return model_head_stats(
            cache_or_caches,
            inputs,
            tokenizer=tokenizer,
            target=target,
            layers=layers,
            block=block,
            progress=progress,
            processor=processor,
            text=text,
            sampling_rate=sampling_rate,
        )
    if processor is not None or text is not None or sampling_rate is not None:
        raise ProbeError("processor=, text= and sampling_rate= are for a model's inputs, not a cache")
    if inputs is not None:
        raise ProbeError("head_stats(cache) takes no inputs; pass a model to run it on inputs")
    caches, n = _as_caches(cache_or_caches)
    acc = FocusAccumulator()
    single = n == 1
    it = caches if single else tqdm(caches, total=n, desc="head stats", unit="cache", disable=not progress)
    for c in it:
        acc.add(c, rollout=rollout and single, progress=progress and single)
    if acc.n_texts == 0:
        raise ProbeError("no caches given; pass a probe.Cache, a path, or a list of them")
    return acc.result()


__all__ = ["head_stats", "model_head_stats"]
