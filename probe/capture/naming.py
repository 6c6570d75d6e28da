"""Naming what a tracer captured: stacks, cache keys and the cache's metadata.

The :class:`~probe.capture.tracer.Tracer` knows layers by their list and index
(``model.decoder.layers``, 3); a cache knows them as ``<stack>.blocks.<i>.<name>``. Stacks:
a list of layers with cross-attention is the ``decoder``; another list beside it is the
``encoder``; a lone list is the ``decoder`` when its self-attention is causal (or, with no
verdict, when the model can ``generate``), else the ``encoder``. Several lists mapped to one
stack are numbered one after another.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Any

from torch import nn

from probe import __version__
from probe.cache.format import FORMAT_VERSION, attention_name, key
from probe.cache.selection import Selection
from probe.capture.inputs import model_name
from probe.capture.layers import LayerRecord
from probe.capture.tracer import Tracer
from probe.errors import ProbeError


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


def model_info(model: nn.Module) -> dict[str, Any]:
    """Name, class and config of ``model`` for the cache metadata."""
    cls = type(model)
    return {
        "name": model_name(model),
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "parameters": sum(p.numel() for p in model.parameters()),
        "config": _jsonable(getattr(model, "config", None)),
    }


def check_forward(tr: Tracer, model: nn.Module, selection: Selection) -> None:
    """Refuse a capture that cannot be named truthfully: not one forward, a kernel probe cannot
    see, no attention at all, or a layer selection that recorded less than it named."""
    f = tr.forward
    if f.root_calls == 0:
        raise ProbeError("the model did not run inside probe.trace; call it inside the with block")
    if f.root_calls > 1:
        raise ProbeError(
            f"the model ran {f.root_calls} forward passes inside probe.trace; "
            "capture one forward pass at a time"
        )
    if f.blind:
        raise ProbeError(
            f"{type(model).__name__} computes attention with {f.blind[0]}, which probe cannot "
            'look into; load it with attn_implementation="sdpa" (or "eager") to capture it'
        )
    if not tr.kept:
        raise ProbeError(
            f"no attention found in {type(model).__name__}: probe saw no "
            "softmax over a sequence, scaled_dot_product_attention, flex_attention or "
            "nn.MultiheadAttention in its forward; give a model that computes attention (custom "
            "kernels and banded layouts such as Longformer's sliding-window chunks cannot be seen: "
            'load transformers models with attn_implementation="sdpa" or "eager")'
        )
    # never record a layer that was not captured: refuse the selection as a whole
    selection.check_layers(list(tr.kept.values()), found=bool(tr.records))


def refuse_shared_layers(records: list[LayerRecord]) -> None:
    """Refuse one module of a layer list run several times in one forward (ALBERT shares one
    layer's weights across all layers): its runs would share one key."""
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


def stacks(kept: dict[str, int], records: list[LayerRecord], generates: bool) -> dict[str, str]:
    """Each layer list with attention (``kept``'s keys, in order) -> its stack name."""
    containers = list(kept)
    info: dict[str, dict[str, Any]] = {c: {"cross": False, "causal": []} for c in containers}
    for r in records:
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
            decoder = generates
        return {c: "decoder" if decoder else "encoder"}
    with_cross = [c for c in containers if info[c]["cross"]]
    if not with_cross:
        return {c: ("encoder" if i == 0 else "decoder") for i, c in enumerate(containers)}
    return {c: ("decoder" if c in with_cross else "encoder") for c in containers}


def name_layers(
    records: list[LayerRecord], kept: dict[str, int], stack_of: dict[str, str]
) -> tuple[dict[int, str], list[dict[str, Any]], dict[str, int]]:
    """``(names, layers, counts)``: each sink handle -> its cache key, each layer's metadata entry
    (in stack and layer order), and each stack's number of layers."""
    offsets: dict[str, int] = {}
    base: dict[str, int] = {}
    for c in kept:  # several lists mapped to one stack are numbered one after another
        s = stack_of[c]
        base[c] = offsets.get(s, 0)
        offsets[s] = base[c] + kept[c]
    names: dict[int, str] = {}
    layer_meta: list[dict[str, Any]] = []
    for r in sorted(records, key=lambda r: (base[r.container], r.container, r.index)):
        stack, idx = stack_of[r.container], base[r.container] + r.index
        entry: dict[str, Any] = {"stack": stack, "layer": idx, "module": r.module}
        names.update(_name_attentions(r, stack, idx, entry))
        for name, handle in r.residuals:
            names[handle] = key(stack, idx, name)
        entry.update(r.notes)
        layer_meta.append(entry)
    return names, layer_meta, offsets


def _name_attentions(r: LayerRecord, stack: str, idx: int, entry: dict[str, Any]) -> dict[int, str]:
    """The keys of layer ``r``'s attention fields (handle -> key), its attentions described in
    ``entry``. Several attentions of one role are numbered in the order they ran
    (``self_attn.0``, ``self_attn.1``); a lone one has no number."""
    per_role = collections.Counter(role for role, *_ in r.patterns)
    for role, n in per_role.items():
        if n > 1:
            # numbering them is what the format allows (self_attn.0, self_attn.1), but the models
            # seen with several softmaxes per layer (DeepSeek-V4) mix in softmaxes that are not
            # weights over keys: refuse rather than store them as attention
            raise ProbeError(
                f"layer {r.module} computes {n} {role}-attention patterns; probe records one per "
                "role and layer and cannot yet tell which of them are attention weights"
            )
    seen: collections.Counter = collections.Counter()
    names: dict[int, str] = {}
    kinds = r.kinds or [None] * len(r.patterns)
    for (role, fields, shape, impl, _causal), kind in zip(r.patterns, kinds, strict=True):
        n = seen[role] if per_role[role] > 1 else None
        seen[role] += 1
        for field, h in fields.items():
            names[h] = key(stack, idx, attention_name(role, field, n))
        info: dict[str, Any] = {"impl": impl, "heads": shape[1]}
        if kind is not None:
            info["kind"] = kind
        entry[attention_name(role, "pattern", n).removesuffix(".pattern")] = info
    return names


def name(
    tr: Tracer, model: nn.Module, metadata: dict[str, Any], selection: Selection
) -> tuple[dict[int, str], dict[str, Any]]:
    """``(names, meta)`` for a checked capture (:func:`check_forward`): each sink handle -> its
    cache key, and the cache's metadata (``metadata`` given, then what the capture found)."""
    records = tr.records + tr.plain_records()
    refuse_shared_layers(records)
    stack_of = stacks(tr.kept, tr.records, hasattr(model, "generate"))
    names, layer_meta, offsets = name_layers(records, tr.kept, stack_of)
    meta = dict(metadata)
    meta.setdefault("model", model_info(model))
    if meta.get("input_kind") == "tensor":
        _positions_from_patterns(meta, tr.records)
    meta.update(
        {
            "probe_version": __version__,
            "format_version": FORMAT_VERSION,
            "attention_implementations": sorted(tr.impls),
            # what was stored: one dtype, or several ("float32, bfloat16": patterns are
            # computed in float32 while a bf16 model's residual stream stays bf16)
            "dtype": ", ".join(sorted(tr.stored_dtypes)),
            "stacks": {s: {"layers": n} for s, n in offsets.items()},
            "layers_captured": selection.layers,
            "training": bool(model.training),
            "heads_captured": selection.heads,
            "layers": layer_meta,
        }
    )
    return names, meta


def _positions_from_patterns(meta: dict[str, Any], records: list[LayerRecord]) -> None:
    # A float input's "tokens" are its positions. Which input axis is the sequence is the model's
    # business (sequence-first modules take [pos, batch, d]); the self-attention patterns
    # ([batch, head, query, key]) say it for sure, so the metadata agrees with what is stored.
    for r in records:
        for role, _h, shape, _impl, _causal in r.patterns:
            if role == "self":
                meta["tokens"] = [[str(i) for i in range(shape[2])] for _ in range(shape[0])]
                return
