"""Naming what a tracer captured: stacks, cache keys and the cache's metadata.

The :class:`~probe.capture.engine.tracer.Tracer` knows layers by their list and index
(``model.decoder.layers``, 3; for a list that runs a module several times, the call's index); a
cache knows them as ``<stack>.blocks.<i>.<name>``. Stacks: a lone list is the ``decoder`` when its
self-attention is causal (or, with no verdict, when the model can ``generate``), else the
``encoder``; a list followed by one that reads it with cross-attention are the ``encoder`` and
the ``decoder``; any other set of lists (Canine's three encoders, Funnel's blocks, BLT's local and
global stacks) names each stack by its list's module path. A stack's ``chain`` says whether every
layer's input was the previous layer's output.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Any

from torch import nn

from probe.cache.format import FORMAT_VERSION, attention_name, key
from probe.cache.selection import Selection
from probe.capture.calls import LayerRecord
from probe.capture.engine.tracer import Tracer
from probe.capture.hooks.layers import count_parameters
from probe.capture.hooks.pooling import SUFFIX as POOL
from probe.capture.hooks.streams import distinct_streams
from probe.capture.inputs.prepared import model_name
from probe.capture.positions.frames import frame_positions
from probe.capture.positions.pictures import layout_of
from probe.errors import ProbeError
from probe.version import __version__


def _jsonable(obj: Any) -> Any:
    if obj is None:
        return None
    to_dict = getattr(type(obj), "to_dict", None)
    if callable(to_dict):  # transformers configs serialise themselves (per-layer fields included)
        obj = obj.to_dict()
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    elif not isinstance(obj, dict):
        return None
    return json.loads(json.dumps(obj, default=str))


def model_info(model: nn.Module) -> dict[str, Any]:
    """Name, class and config of ``model`` for the cache metadata."""
    cls = type(model)
    return {
        "name": model_name(model),
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "parameters": count_parameters(model),
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
        check_unseen(tr, model)
        raise ProbeError(
            f"no attention found in {type(model).__name__}: probe saw no "
            "softmax over a sequence, scaled_dot_product_attention, flex_attention or "
            "nn.MultiheadAttention in its forward; give a model that computes attention (custom "
            "kernels and banded layouts such as Longformer's sliding-window chunks cannot be seen: "
            'load transformers models with attn_implementation="sdpa" or "eager")'
        )
    # never record a layer that was not captured: refuse the selection as a whole
    selection.check_layers(list(tr.kept.values()), found=bool(tr.records))


def check_unseen(tr: Tracer, model: nn.Module) -> None:
    """Refuse a capture in which some layers computed attention probe did not recognise (a softmax
    over a local, chunked or banded layout): storing the rest would drop them without a word."""
    unseen = tr.forward.unseen
    if not unseen:
        return
    kind = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    shown = ", ".join(unseen[:6]) + (f" and {len(unseen) - 6} more" if len(unseen) > 6 else "")
    raise ProbeError(
        f"{kind}: layers {shown} compute attention as a softmax over a layout probe does not "
        "recognise (local, chunked or sliding-window attention); probe refuses rather than store "
        "the capture without them (see docs/attention-kinds.md, local attention)"
        + "".join(f"; {why}" for why in tr.forward.unseen_why)
    )


def check_loops(records: list[LayerRecord], looped: set[str]) -> None:
    """Refuse a list whose layers cannot be numbered by call: a module of it ran a second time
    after layers of it were already numbered by their place in the list, at other numbers."""
    seen: dict[tuple[str, int], str] = {}
    for r in records:
        if (r.container, r.index) in seen:
            raise ProbeError(
                f"layers {seen[(r.container, r.index)]} and {r.module} of {r.container} both ran as "
                f"its layer {r.index}; probe cannot number the calls of a list whose modules run in "
                "a changing order; capture each loop of the model in a forward of its own"
            )
        seen[(r.container, r.index)] = r.module


def _stack_path(container: str) -> str:
    """The stack name of a layer list named by its module path (an adopted layer: its module)."""
    path = container.split(":")[0] if container.endswith((":single", POOL)) else container
    return path or "model"


def stacks(kept: dict[str, int], records: list[LayerRecord], generates: bool) -> dict[str, str]:
    """Each layer list with attention (``kept``'s keys, in the order the model ran them) -> its
    stack name: ``encoder``/``decoder`` for one list, or an encoder beside a decoder that reads it
    with cross-attention; else each list by its module path. An attention pooling head
    (:mod:`probe.capture.hooks.pooling`) is no decoder: it is named by its module path, the other lists
    as if it were not there."""
    pools = [c for c in kept if c.endswith(POOL)]
    if pools and len(pools) < len(kept):
        rest = stacks({c: n for c, n in kept.items() if c not in pools}, records, generates)
        return {c: rest.get(c) or _stack_path(c) for c in kept}
    containers = list(kept)
    info: dict[str, dict[str, Any]] = {c: {"cross": False, "causal": []} for c in containers}
    for r in records:
        if r.container not in info:
            continue
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
    if len(containers) == 2 and not info[containers[0]]["cross"] and info[containers[1]]["cross"]:
        return {containers[0]: "encoder", containers[1]: "decoder"}
    named = {c: _stack_path(c) for c in containers}
    if len(set(named.values())) < len(named):
        return {c: f"{p}_{i}" for i, (c, p) in enumerate(named.items())}
    return named


def name_layers(
    records: list[LayerRecord], kept: dict[str, int], stack_of: dict[str, str], looped: set[str] = frozenset()
) -> tuple[dict[int, str], list[dict[str, Any]], dict[str, int]]:
    """``(names, layers, counts)``: each sink handle -> its cache key, each layer's metadata entry
    (in stack and layer order), and each stack's number of layers."""
    offsets: dict[str, int] = {}
    base: dict[str, int] = {}
    order = {c: i for i, c in enumerate(kept)}
    for c in kept:  # several lists mapped to one stack are numbered one after another
        s = stack_of[c]
        base[c] = offsets.get(s, 0)
        offsets[s] = base[c] + kept[c]
    names: dict[int, str] = {}
    layer_meta: list[dict[str, Any]] = []
    for r in sorted(records, key=lambda r: (order[r.container], r.index)):
        stack, idx = stack_of[r.container], base[r.container] + r.index
        entry: dict[str, Any] = {"stack": stack, "layer": idx, "module": r.module}
        if r.container in looped:
            entry["call"] = r.call
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
    modules = r.modules or [None] * len(r.patterns)
    kinds = r.kinds or [None] * len(r.patterns)
    for role, n in per_role.items():
        mine = [m for (ro, *_), m in zip(r.patterns, modules, strict=True) if ro == role]
        said = [k for (ro, *_), k in zip(r.patterns, kinds, strict=True) if ro == role]
        own = None not in mine and _own_modules(role, r, modules, kinds)
        if n > 1 and not own and (None in said or len(set(said)) < n):
            # ...unless the recorder said what each one is (ProphetNet's main and predict streams)
            # several attentions of one role are numbered (self_attn.0, self_attn.1) when each is
            # its own sublayer module (LongCat-Flash's two attention sublayers); several softmaxes
            # of one module could be anything (parts of one attention, a score that is no weights)
            raise ProbeError(
                f"layer {r.module} computes {n} {role}-attention patterns, not each in a sublayer module "
                "of its own; probe cannot tell which of them are attention weights"
            )
    seen: collections.Counter = collections.Counter()
    names: dict[int, str] = {}
    for (role, fields, shape, impl, _causal), kind, module in zip(r.patterns, kinds, modules, strict=True):
        n = seen[role] if per_role[role] > 1 else None
        seen[role] += 1
        for field, h in fields.items():
            names[h] = key(stack, idx, attention_name(role, field, n))
        info: dict[str, Any] = {"impl": impl, "heads": shape[1]}
        if kind is not None:
            info["kind"] = kind
        if n is not None:  # one of several: which sublayer computed it
            info["module"] = module
        entry[attention_name(role, "pattern", n).removesuffix(".pattern")] = info
    return names


def _own_modules(role: str, r: LayerRecord, modules: list, kinds: list) -> bool:
    """Whether the attentions of ``role`` in layer ``r`` each come from a sublayer module of their
    own, or are the distinct whole softmaxes of one module call (LiLT's two streams)."""
    by_module: dict[Any, list] = collections.defaultdict(list)
    for (ro, *_), m, k in zip(r.patterns, modules, kinds, strict=True):
        if ro == role:
            by_module[m].append(k)
    return all(len(ks) == 1 or distinct_streams(ks) for ks in by_module.values())


def stack_info(
    tr: Tracer, stack_of: dict[str, str], offsets: dict[str, int], meta: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """The metadata's ``stacks``: per stack its layer count, whether its layers chain, and for
    stacks named by module path that path and which token list its positions are (null: pooled
    or downsampled positions that are not tokens)."""
    lengths: dict[str, set[int]] = {}
    for r in tr.records:
        for _role, _h, shape, _impl, _causal in r.patterns:
            lengths.setdefault(stack_of[r.container], set()).add(shape[2])
    source = _padded_length(meta, "")
    target = _padded_length(meta, "target_")
    out: dict[str, dict[str, Any]] = {}
    for c, s in stack_of.items():
        info = out.setdefault(s, {"layers": offsets[s], "chain": True})
        if s not in ("encoder", "decoder"):
            info["module"] = _stack_path(c)
        info["chain"] = info["chain"] and tr.chain.get(c, True) and list(stack_of.values()).count(s) == 1
        seen = lengths.get(s, set())
        if s not in ("encoder", "decoder") and source is not None:
            # encoder/decoder keep the reader's default (source; target for a decoder with one)
            if seen and seen <= {source}:
                info["tokens"] = "source"
            elif seen and target is not None and seen <= {target}:
                info["tokens"] = "target"
            else:
                info["tokens"] = None
        if len(seen) > 1 and meta.get("image_shape"):
            info["tokens"] = None  # grids of several sizes (Swin's stages): each layer's patches, not tokens
    return out


def _padded_length(meta: dict[str, Any], prefix: str) -> int | None:
    rows = meta.get(f"{prefix}attention_mask") or meta.get(f"{prefix}ids")
    if not rows or not isinstance(rows[0], list):
        return None
    return len(rows[0])


def name(
    tr: Tracer, model: nn.Module, metadata: dict[str, Any], selection: Selection
) -> tuple[dict[int, str], dict[str, Any]]:
    """``(names, meta)`` for a checked capture (:func:`check_forward`): each sink handle -> its
    cache key, and the cache's metadata (``metadata`` given, then what the capture found)."""
    records = tr.records + tr.plain_records()
    check_loops(records, tr.looped)
    kept = {c: tr.kept[c] for c in sorted(tr.kept, key=lambda c: _ran(tr.order, c))}
    stack_of = stacks(kept, tr.records, hasattr(model, "generate"))
    names, layer_meta, offsets = name_layers(records, kept, stack_of, tr.looped)
    meta = dict(metadata)
    meta.setdefault("model", model_info(model))
    if meta.get("input_kind") == "tensor":
        _positions_from_patterns(meta, tr.records)
    layout = layout_of(meta)  # pictures: patch grids, tiles or merged grids (positions/pictures.py)
    images = layout.positions(meta, model, tr.records, stack_of) if layout is not None else {}
    if meta.get("audio_shape"):  # sound: each frame's time span (capture/positions/frames.py)
        images.update(frame_positions(meta, model, tr.records, stack_of))
    _mark_prompt_slots(meta, model, tr.records)
    meta.update(
        {
            "probe_version": __version__,
            "format_version": FORMAT_VERSION,
            "attention_implementations": sorted(tr.impls),
            # what was stored: one dtype, or several ("float32, bfloat16": patterns are
            # computed in float32 while a bf16 model's residual stream stays bf16)
            "dtype": ", ".join(sorted(tr.stored_dtypes)),
            "stacks": stack_info(tr, stack_of, offsets, meta),
            "layers_captured": selection.layers,
            "training": bool(model.training),
            "heads_captured": selection.heads,
            "layers": layer_meta,
        }
    )
    for s, pos in images.items():
        keep = ("kinds", "grid", "rows", "layer_grids", "frames")
        meta["stacks"][s]["positions"] = {k: pos[k] for k in keep if k in pos}
    return names, meta


def _mark_prompt_slots(meta: dict[str, Any], model: nn.Module, records: list[LayerRecord]) -> None:
    """CpmAnt runs its layers over ``prompt_length`` learned prompt slots placed ahead of the
    tokens: where every stored pattern is longer than that, ``meta["prompt_slots"]`` says which
    positions they are (its ``output_attentions`` drops them; probe keeps what the layers ran)."""
    inner = next((m for m in (model, getattr(model, "cpmant", None)) if "CpmAnt" in type(m).__name__), None)
    p = getattr(inner, "prompt_length", None)
    lengths = {shape[2] for r in records for _role, _h, shape, _impl, _causal in r.patterns}
    if not isinstance(p, int) or p <= 0 or not lengths or min(lengths) <= p:
        return
    meta["prompt_slots"] = {
        "count": p,
        "note": f"positions 0..{p - 1} of every pattern (queries and keys) and of the residual stream "
        f"are the model's {p} learned prompt slots, ahead of the tokens; the tokens are positions "
        f"{p} on (transformers' output_attentions crops to them)",
    }


def _ran(order: list[str], container: str) -> int:
    return order.index(container) if container in order else len(order)


def _positions_from_patterns(meta: dict[str, Any], records: list[LayerRecord]) -> None:
    # A float input's "tokens" are its positions. Which input axis is the sequence is the model's
    # business (sequence-first modules take [pos, batch, d]); the self-attention patterns
    # ([batch, head, query, key]) say it for sure, so the metadata agrees with what is stored.
    for r in records:
        for role, _h, shape, _impl, _causal in r.patterns:
            if role == "self":
                meta["tokens"] = [[str(i) for i in range(shape[2])] for _ in range(shape[0])]
                return
