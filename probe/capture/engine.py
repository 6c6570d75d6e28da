"""``probe.trace`` (capture whatever forward runs inside a ``with`` block) and ``probe.capture``."""

from __future__ import annotations

import collections
import dataclasses
import json
import operator
import os
import threading
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from probe import __version__
from probe.cache import Cache
from probe.cache.cache import encode_metadata, open_cache
from probe.cache.format import FORMAT_VERSION, key
from probe.cache.writer import FileSink, MemorySink, check_output
from probe.capture.inputs import model_name, prepare
from probe.capture.tracer import Tracer
from probe.errors import ProbeError

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def _dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ProbeError(f"dtype {dtype!r} is not supported; use float32, float16 or bfloat16")


def _selection(values: Any, what: str, one: str) -> list[int] | None:
    """``layers=``/``heads=``: None (all) or a non-empty list of distinct non-negative indices."""
    if values is None:
        return None
    if isinstance(values, int) and not isinstance(values, bool):
        values = [values]
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ProbeError(f"{what} must be a list of {one} indices like [0, 2], not {values!r}")
    raw = list(values)
    if not raw:
        raise ProbeError(f"{what}=[] selects no {one}; give indices like [0, 2], or None for all")
    values = []
    for v in raw:
        try:
            i = -1 if isinstance(v, bool) else operator.index(v)
        except TypeError:
            i = -1
        if i < 0:
            raise ProbeError(f"{what} must be non-negative {one} indices like [0, 2]; {v!r} is not one")
        values.append(i)
    if len(set(values)) != len(values):
        raise ProbeError(f"{what}={values} names a {one} twice; give each index once")
    return values


def _jsonable(obj: Any) -> Any:
    if obj is None:
        return None
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    elif hasattr(obj, "to_dict"):
        obj = obj.to_dict()
    elif not isinstance(obj, dict):
        return None
    return json.loads(json.dumps(obj, default=str))


# models a capture is running on (one capture per model object at a time: hooks are per module)
_RUNNING: weakref.WeakSet = weakref.WeakSet()
_RUNNING_LOCK = threading.Lock()


def _claim(model: nn.Module) -> None:
    with _RUNNING_LOCK:
        if model in _RUNNING:
            raise ProbeError(
                f"a capture is already running on this {type(model).__name__} object (another "
                "thread); capture one text batch at a time per model, or give each thread its own copy"
            )
        _RUNNING.add(model)


def _release(model: nn.Module) -> None:
    with _RUNNING_LOCK:
        _RUNNING.discard(model)


def _blind_attention(model: nn.Module) -> str | None:
    """The attention implementation of a transformers model that probe cannot look into, if any."""
    for m in model.modules():
        impl = getattr(getattr(m, "config", None), "_attn_implementation", None)
        if isinstance(impl, str) and "flex" in impl:
            return impl
    return None


def model_info(model: nn.Module) -> dict[str, Any]:
    """Name, class and config of ``model`` for the cache metadata."""
    cls = type(model)
    return {
        "name": model_name(model),
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "parameters": sum(p.numel() for p in model.parameters()),
        "config": _jsonable(getattr(model, "config", None)),
    }


class Trace:
    """Capture the attention of the forward pass that runs inside ``with probe.trace(model):``.

    After the block, ``trace.cache`` holds the :class:`~probe.Cache`. The model is not edited and
    its outputs inside the block are bit-identical to its outputs outside. ``out`` streams the
    cache to a safetensors file layer by layer; ``layers`` and ``heads`` restrict what is kept;
    ``dtype`` (``float16``/``bfloat16``) shrinks what is stored.
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
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ProbeError(f"probe captures torch.nn.Module models, not {type(model).__name__}")
        layers = _selection(layers, "layers", "layer")
        heads = _selection(heads, "heads", "head")
        if out is not None:
            check_output(out)
        self.model = model
        self.out = out
        self.layers, self.heads = layers, heads
        self.dtype = _dtype(dtype)
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.cache: Cache | None = None
        self._extra_reserve = int(reserve)
        self._sink: Any = None
        self._tracer: Tracer | None = None

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
        blind = _blind_attention(self.model)
        if blind is not None:
            raise ProbeError(
                f"{model_name(self.model)} computes attention with {blind}, which probe cannot look "
                'into; load it with attn_implementation="sdpa" (or "eager") to capture it'
            )
        if self.model.training:
            warnings.warn(
                f"{model_name(self.model)} is in train mode: captured patterns are the attention "
                "weights before dropout (the cache metadata records training=true); call "
                "model.eval() to capture what the model computes at inference",
                stacklevel=3,
            )
        _claim(self.model)
        try:
            self._enter()
        except BaseException:
            _release(self.model)
            raise
        return self

    def _enter(self) -> None:
        self._sink = FileSink(self.out, reserve=self._header_estimate()) if self.out else MemorySink()
        self._tracer = Tracer(self.model, self._sink, layers=self.layers, heads=self.heads, dtype=self.dtype)
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
            _release(self.model)
        if exc_type is not None:
            self._sink.abort()
            return False
        try:
            self.cache = self._finish()
        except BaseException:
            self._sink.abort()
            raise
        return False

    # -- naming --------------------------------------------------------------------------------
    def _stacks(self, tr: Tracer) -> dict[str, str]:
        containers = list(tr.kept)
        info: dict[str, dict[str, Any]] = {c: {"cross": False, "causal": []} for c in containers}
        for r in tr.records:
            for role, _h, _shape, _impl, causal in r.patterns:
                if role == "cross":
                    info[r.container]["cross"] = True
                elif causal is not None:
                    info[r.container]["causal"].append(causal)
        if len(containers) == 1:
            c = containers[0]
            flags = info[c]["causal"]
            if info[c]["cross"]:
                decoder = True
            elif flags:
                decoder = all(flags)
            else:
                decoder = hasattr(self.model, "generate")
            return {c: "decoder" if decoder else "encoder"}
        with_cross = [c for c in containers if info[c]["cross"]]
        if not with_cross:
            return {c: ("encoder" if i == 0 else "decoder") for i, c in enumerate(containers)}
        return {c: ("decoder" if c in with_cross else "encoder") for c in containers}

    def _finish(self) -> Cache:
        tr = self._tracer
        if tr.root_calls == 0:
            raise ProbeError("the model did not run inside probe.trace; call it inside the with block")
        if tr.root_calls > 1:
            raise ProbeError(
                f"the model ran {tr.root_calls} forward passes inside probe.trace; "
                "capture one forward pass at a time"
            )
        if tr.blind:
            raise ProbeError(
                f"{type(self.model).__name__} computes attention with {tr.blind[0]}, which probe cannot "
                'look into; load it with attn_implementation="sdpa" (or "eager") to capture it'
            )
        if not tr.kept:
            raise ProbeError(
                f"no attention found in {type(self.model).__name__}: probe saw no "
                "softmax over a sequence, scaled_dot_product_attention or nn.MultiheadAttention in "
                "its forward; give a model that computes attention (flex_attention, custom kernels "
                "and banded layouts such as Longformer's sliding-window chunks cannot be seen: "
                'load transformers models with attn_implementation="sdpa" or "eager")'
            )
        most = max(tr.kept.values())
        missing = [i for i in self.layers or [] if i >= most]
        if missing or not tr.records:
            # never record a layer that was not captured: refuse the selection as a whole
            counts = " and ".join(f"{n}" for n in tr.kept.values())
            what = "selects no layer" if not tr.records else f"names layers {missing} that do not exist"
            raise ProbeError(
                f"layers={self.layers} {what} (the model has {counts} layers); "
                f"choose indices from 0-{most - 1}"
            )
        records = tr.records + tr.plain_records()
        _refuse_shared_layers(records)
        stacks = self._stacks(tr)
        offsets: dict[str, int] = {}
        base: dict[str, int] = {}
        for c in tr.kept:  # several lists mapped to one stack are numbered one after another
            s = stacks[c]
            base[c] = offsets.get(s, 0)
            offsets[s] = base[c] + tr.kept[c]
        names: dict[int, str] = {}
        layer_meta: list[dict[str, Any]] = []
        for r in sorted(records, key=lambda r: (base[r.container], r.container, r.index)):
            stack, idx = stacks[r.container], base[r.container] + r.index
            entry: dict[str, Any] = {"stack": stack, "layer": idx, "module": r.module}
            for role, handle, shape, impl, _causal in r.patterns:
                k = key(stack, idx, f"{role}_attn.pattern")
                if k in names.values():
                    raise ProbeError(
                        f"layer {r.module} computes two {role}-attention patterns; "
                        "probe records one per role and layer"
                    )
                names[handle] = k
                entry[f"{role}_attn"] = {"impl": impl, "heads": shape[1]}
            for name, handle in r.residuals:
                names[handle] = key(stack, idx, name)
            entry.update(r.notes)
            layer_meta.append(entry)
        meta = dict(self.metadata)
        meta.setdefault("model", model_info(self.model))
        if meta.get("input_kind") == "tensor":
            _positions_from_patterns(meta, tr)
        meta.update(
            {
                "probe_version": __version__,
                "format_version": FORMAT_VERSION,
                "attention_implementations": sorted(tr.impls),
                # what was stored: one dtype, or several ("float32, bfloat16": patterns are
                # computed in float32 while a bf16 model's residual stream stays bf16)
                "dtype": ", ".join(sorted(tr.stored_dtypes)),
                "stacks": {s: {"layers": n} for s, n in offsets.items()},
                "layers_captured": self.layers,
                "training": bool(self.model.training),
                "heads_captured": self.heads,
                "layers": layer_meta,
            }
        )
        if isinstance(self._sink, FileSink):
            # opened before the rename: the Cache returned is the file this call wrote
            out = self._sink.path
            return self._sink.finish(
                names, encode_metadata(meta), opener=lambda tmp: open_cache(tmp, shown=out)
            )
        return Cache(self._sink.finish(names, encode_metadata(meta)), meta)


def _refuse_shared_layers(records: list) -> None:
    # One module of a layer list run several times in one forward (ALBERT shares one layer's
    # weights across all layers): its runs would share one key, so the cache could not say which
    # run a tensor came from.
    runs = collections.Counter((r.container, r.index) for r in records)
    for r in records:
        n = runs[(r.container, r.index)]
        if n > 1:
            raise ProbeError(
                f"layer {r.module} runs {n} times in one forward (one layer's weights shared by "
                "several layers, as in ALBERT); probe keeps one layer per module and does not support "
                "weight-shared layers: to capture it, give each run its own module (a ModuleList of "
                "copy.deepcopy of the shared layer)"
            )


def _positions_from_patterns(meta: dict[str, Any], tr: Tracer) -> None:
    # A float input's "tokens" are its positions. Which input axis is the sequence is the model's
    # business (sequence-first modules take [pos, batch, d]); the self-attention patterns
    # ([batch, head, query, key]) say it for sure, so the metadata agrees with what is stored.
    for r in tr.records:
        for role, _h, shape, _impl, _causal in r.patterns:
            if role == "self":
                meta["tokens"] = [[str(i) for i in range(shape[2])] for _ in range(shape[0])]
                return


def trace(model: nn.Module, **kwargs: Any) -> Trace:
    """``with probe.trace(model) as t: model(x)`` captures that forward; then use ``t.cache``.

    Keyword arguments: ``out``, ``layers``, ``heads``, ``dtype``, ``metadata`` (see :class:`Trace`).
    """
    return Trace(model, **kwargs)


def capture(
    model: nn.Module,
    inputs: Any,
    *,
    tokenizer: Any = None,
    target: Any = None,
    out: str | os.PathLike | None = None,
    layers: list[int] | None = None,
    heads: list[int] | None = None,
    dtype: Any = None,
) -> Cache:
    """Run ``model`` on ``inputs`` and capture every attention pattern and residual delta.

    ``inputs`` is a text, a list of texts (padded into one batch), or a tensor of token ids or
    of float inputs. The tokenizer comes from ``tokenizer`` or ``model.tokenizer``. For
    encoder-decoders ``target`` is the decoder text for teacher forcing; without it probe decodes
    greedily (where the model offers it) and captures that forward. With ``out`` the cache is
    streamed to that safetensors file layer by layer and returned opened lazily.

    Returns a :class:`~probe.Cache` with keys ``<stack>.blocks.<i>.<name>``.
    """
    # arguments first: a bad selection or output path is refused before any forward runs
    layers = _selection(layers, "layers", "layer")
    heads = _selection(heads, "heads", "head")
    _dtype(dtype)
    if out is not None:
        check_output(out)
    prepared = prepare(model, inputs, tokenizer=tokenizer, target=target)
    t = Trace(model, out=out, layers=layers, heads=heads, dtype=dtype, metadata=prepared.meta)
    with torch.no_grad(), t:
        prepared.run()
    return t.cache
