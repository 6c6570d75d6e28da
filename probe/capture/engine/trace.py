"""``probe.trace`` (capture whatever forward runs inside a ``with`` block) and ``probe.capture``.

:class:`Trace` is the lifecycle: it checks the arguments, claims the model (one capture per
model object and thread at a time: captures in other threads each see their own forward), opens
the sink (memory, or a file streamed layer by layer), runs a
:class:`~probe.capture.engine.tracer.Tracer` around the forward, then has :mod:`probe.capture.engine.naming`
name what was captured and writes the :class:`~probe.Cache`. Any failure aborts the sink: no
half-written file is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from typing import Any

import torch
from torch import nn

from probe.cache import Cache
from probe.cache.cache import encode_metadata, open_cache
from probe.cache.selection import Selection
from probe.cache.writer import FileSink, MemorySink, check_output
from probe.capture.consumers.kept import parse_keep
from probe.capture.engine import planned
from probe.capture.engine.claims import claim, release
from probe.capture.engine.naming import check_forward, check_unseen, model_info, name
from probe.capture.engine.steps import StepTrace
from probe.capture.engine.tracer import Tracer
from probe.capture.hooks.store import parse_dtype
from probe.capture.inputs.keywords import inputs_metadata
from probe.capture.inputs.prepared import model_name
from probe.capture.inputs.route import prepare
from probe.errors import ProbeError


def _compiler_failed(exc: BaseException | None) -> bool:
    """True for an error raised by torch.compile's tracer or compiler (a compiled function the
    model calls, such as transformers' flex_attention): said in one line, not a compiler traceback."""
    return exc is not None and type(exc).__module__.startswith(("torch._dynamo", "torch._inductor"))


class Trace:
    """Capture the attention of the forward pass that runs inside ``with probe.trace(model):``.

    After the block, ``trace.cache`` holds the :class:`~probe.Cache`. The model is not edited and
    its outputs inside the block are bit-identical to its outputs outside. ``out`` streams the
    cache to a safetensors file layer by layer; ``layers`` and ``heads`` restrict what is kept;
    ``dtype`` (``float16``/``bfloat16``) shrinks what is stored; ``keep`` keeps selected query
    rows or the top-k keys of each row instead of whole patterns (:mod:`probe.capture.consumers.kept`;
    inside ``probe.trace`` row indices count every query position unless ``metadata`` holds the
    ``attention_mask``). ``kinds``: derived pattern kinds kept beside the weights,
    ``{name: scale(attn) -> [batch, heads, keys]}`` (:mod:`probe.capture.consumers.kinds`; what
    ``probe.contributions`` passes).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        out: str | os.PathLike | None = None,
        layers: list[int] | None = None,
        heads: list[int] | None = None,
        dtype: Any = None,
        metadata: dict[str, Any] | None = None,
        reserve: int = 0,
        keep: Any = None,
        kinds: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ProbeError(f"probe captures torch.nn.Module models, not {type(model).__name__}")
        self.selection = Selection.parse(layers, heads)
        if out is not None:
            check_output(out)
        self.model = model
        self.out = out
        self.layers, self.heads = self.selection.layers, self.selection.heads
        self.dtype = parse_dtype(dtype)
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.keep = parse_keep(keep)
        if self.keep.kind == "stats":
            raise ProbeError(
                "probe.trace keeps patterns, rows or top-k; for keep='stats' call "
                "probe.capture(model, inputs, keep='stats') or probe.head_stats(model, inputs)"
            )
        if not self.keep.default:
            self.metadata["keep"] = self.keep.to_json()
        self.kinds = dict(kinds or {})
        self.cache: Cache | None = None
        self.names: dict[int, str] = {}  # after the block: each sink handle -> its cache key
        self._extra_reserve = int(reserve)
        self._sink: Any = None
        self._tracer: Tracer | None = None

    @property
    def tracer(self) -> Tracer | None:
        """The tracer that watched the block (None before it is entered)."""
        return self._tracer

    def _header_estimate(self) -> int:
        # The streamed header's reservation: the metadata known now (texts, tokens, model config),
        # escaped as it will be inside the header, plus a budget per possible layer (its tensor
        # entries and its metadata entry; elements of module lists bound the layer count). A
        # header that outgrows it is still written correctly, by one copy of the data.
        self.metadata.setdefault("model", model_info(self.model))
        known = len(json.dumps(json.dumps(self.metadata, ensure_ascii=False), ensure_ascii=False).encode())
        lists = sum(len(m) for m in self.model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)))
        return known + 1024 * max(lists, 1) + 2048 + self._extra_reserve

    def __enter__(self) -> Trace:
        if self.model.training:
            warnings.warn(
                f"{model_name(self.model)} is in train mode: captured patterns are the attention "
                "weights before dropout (the cache metadata records training=true); call "
                "model.eval() to capture what the model computes at inference",
                stacklevel=3,
            )
        claim(self.model)
        try:
            self._enter()
        except BaseException:
            release(self.model)
            raise
        return self

    def _enter(self) -> None:
        self._sink = FileSink(self.out, reserve=self._header_estimate()) if self.out else MemorySink()
        self._tracer = Tracer(
            self.model,
            self._sink,
            selection=self.selection,
            dtype=self.dtype,
            keep=self.keep,
            metadata=self.metadata,
            kinds=self.kinds,
        )
        try:
            self._tracer.__enter__()
        except BaseException:
            self._sink.abort()
            raise

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self._tracer.__exit__(exc_type, exc, tb)
        except BaseException:
            self._sink.abort()
            raise
        finally:
            release(self.model)
        if exc_type is not None:
            self._sink.abort()
            if _compiler_failed(exc):
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                raise ProbeError(
                    f"torch.compile failed inside the forward probe watched ({type(exc).__name__}: {first}); "
                    "capture the model uncompiled (a transformers model: load it with "
                    "attn_implementation='sdpa' or 'eager', same weights)"
                ) from None
            return False
        try:
            self.cache = self._finish()
        except BaseException:
            self._sink.abort()
            raise
        return False

    def _finish(self) -> Cache:
        check_forward(self._tracer, self.model, self.selection)
        root = self._tracer.forward.root_images
        if root and not any(k in self.metadata for k in ("image_shape", "pixel_shape", "input_kind")):
            # a forward run inside probe.trace on pixels: its positions named as probe.capture's
            for k, v in inputs_metadata(self.model, root).items():
                self.metadata.setdefault(k, v)
        names, meta = name(self._tracer, self.model, self.metadata, self.selection)
        check_unseen(self._tracer, self.model)
        self.names = names
        if isinstance(self._sink, FileSink):
            # opened before the rename: the Cache returned is the file this call wrote
            out = self._sink.path
            return self._sink.finish(
                names, encode_metadata(meta), opener=lambda tmp: open_cache(tmp, shown=out)
            )
        return Cache(self._sink.finish(names, encode_metadata(meta)), meta)


def trace(model: nn.Module, **kwargs: Any) -> Trace:
    """``with probe.trace(model) as t: model(x)`` captures that forward; then use ``t.cache``.

    Keyword arguments: ``out``, ``layers``, ``heads``, ``dtype``, ``metadata``, ``keep`` (see :class:`Trace`).
    ``steps=True`` records every forward inside the block as a step of one growing sequence (a
    generation loop; :class:`~probe.capture.engine.steps.StepTrace`) instead of refusing more than one.
    """
    if kwargs.pop("steps", False):
        return StepTrace(model, **kwargs)
    return Trace(model, **kwargs)


def capture(
    model: nn.Module,
    inputs: Any,
    *,
    tokenizer: Any = None,
    target: Any = None,
    processor: Any = None,
    sampling_rate: int | None = None,
    out: str | os.PathLike | None = None,
    layers: list[int] | None = None,
    heads: list[int] | None = None,
    dtype: Any = None,
    keep: Any = None,
    kinds: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Cache:
    """Run ``model`` on ``inputs`` and capture every attention pattern and residual delta.

    ``inputs`` is a text, a list of texts (padded into one batch), a tensor of token ids or of
    float inputs, a dict of keyword tensors (a processor's ``BatchFeature``: ``{"pixel_values":
    x}``), or pictures (PIL images, numpy arrays, image files, or a list of them) with
    ``processor`` (the model's image processor, called as ``processor(images=...,
    return_tensors="pt")``), or sound (a waveform, a 1-D array or tensor with ``sampling_rate``
    in Hz, a sound file, or a list of them) with ``processor`` (the model's feature extractor, at
    whose rate probe resamples; see ``docs/speech.md``). The tokenizer comes from ``tokenizer`` or
    ``model.tokenizer``. For
    encoder-decoders ``target`` is the decoder text for teacher forcing; without it probe decodes
    greedily (where the model offers it) and captures that forward. With ``out`` the cache is
    streamed to that safetensors file layer by layer and returned opened lazily.

    ``keep`` says what is kept of each attention: whole patterns (``None``, the default),
    ``{"rows": [-1, ...]}`` (those query rows of every text over every key, ``<attn>.rows`` and
    ``<attn>.row_index``; rows count each text's real tokens, -1 is its last) or ``{"topk": k}``
    (``<attn>.topk_values``, ``topk_indices``, ``topk_mass``); neither holds a whole pattern of
    an SDPA call. See ``docs/keep.md``. ``keep="stats"`` (each head's statistics computed while the
    model runs, and residual norms) is the top-level ``probe.capture``'s: it passes the statistics'
    readers in (:mod:`probe.analysis.focus.streamed.keepstats`); called here it is refused.

    ``kinds`` (derived pattern kinds, see :class:`Trace`) and ``metadata`` (entries added to the
    cache's metadata) are for callers that build on the capture, as ``probe.contributions``.

    Returns a :class:`~probe.Cache` with keys ``<stack>.blocks.<i>.<name>``. Later captures of one
    model on one kind of text run with the plan the first two learnt (:mod:`~.planned`), same cache.
    """
    # arguments first: a bad selection or output path is refused before any forward runs
    selection, dt, kept = Selection.parse(layers, heads), parse_dtype(dtype), parse_keep(keep)
    if kept.kind == "stats":
        raise ProbeError(
            "keep='stats' computes statistics with probe's analysis: call probe.capture (the top-level "
            "function), which passes their readers to probe.capture.engine.stats.capture_stats"
        )
    if out is not None:
        check_output(out)
    prepared = prepare(
        model, inputs, tokenizer=tokenizer, target=target, processor=processor, sampling_rate=sampling_rate
    )
    given = {**prepared.meta, **(metadata or {})}
    # captured again on the same kind of input: the plan learnt by the first two (engine/planned.py)
    kind = planned.key_for(model, given, out=out, keep=kept, kinds=kinds, selection=selection, dtype=dt)
    cache = planned.capture_planned(model, kind, prepared.run, given)
    if cache is not None:
        return cache
    t = Trace(
        model,
        out=out,
        layers=selection.layers,
        heads=selection.heads,
        dtype=dtype,
        metadata=dict(given),
        keep=kept,
        kinds=kinds,
    )
    beside = planned.candidate(model, kind)
    with torch.no_grad(), t, beside if beside is not None else contextlib.nullcontext():
        prepared.run()
    planned.learnt(model, kind, t, set(given), beside, selection, dt)
    return t.cache
