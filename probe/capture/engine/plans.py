"""What a planned capture repeats (:mod:`probe.capture.engine.planned`): the kind of capture a plan
is kept for (:func:`key_for`), and the :class:`Plan` a model's first full capture proposes
(:func:`propose`): each stored key a layer's input or output, the output of the layer's child the
key names, or the one ``F.scaled_dot_product_attention`` call of the attention sublayer the tracer
saw compute it, with the model-side metadata to repeat.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import torch
from torch import Tensor, nn

from probe.cache.perf.options import OPTIONS
from probe.capture.engine.lean import sdpa_args
from probe.capture.engine.naming import model_info

# the metadata a capture adds that a plan may repeat: the same for every input of one kind
_MODEL_SIDE = {
    "probe_version",
    "format_version",
    "attention_implementations",
    "stacks",
    "layers_captured",
    "training",
    "heads_captured",
    "layers",
}


def key_for(
    model: nn.Module, meta: dict[str, Any], *, out: Any, keep: Any, kinds: Any, selection: Any, dtype: Any
) -> tuple | None:
    """The kind of capture a plan is kept for, or None where captures are never planned: a batch
    of texts or of token ids (padded or not) to a model in eval mode, whole patterns kept in memory."""
    if not OPTIONS.planned_capture or out is not None or kinds or not keep.default or model.training:
        return None
    kind = meta.get("input_kind")
    if kind not in ("text", "ids") or any(k.startswith("target") for k in meta):
        return None
    mask = meta.get("attention_mask")
    padded = isinstance(mask, list) and any(0 in row for row in mask if isinstance(row, list))
    layers = tuple(selection.layers) if selection.layers is not None else None
    heads = tuple(selection.heads) if selection.heads is not None else None
    return (kind, padded, layers, heads, dtype)


def sdpa_form(args: tuple, kwargs: dict) -> tuple:
    """What must stay the same between an SDPA call of the learnt forward and a planned one."""
    q, k, mask, causal, scale = sdpa_args(args, kwargs)
    shape = lambda t: (t.dim(), t.size(-3) if t.dim() >= 3 else None, t.dtype)  # noqa: E731
    m = None if mask is None else (mask.dtype, mask.dim())
    return shape(q), shape(k), m, causal, scale is None, bool(kwargs.get("enable_gqa", False))


class _Attention:
    """An attention sublayer of the plan: its pattern key and the form of its SDPA call."""

    def __init__(self, module: nn.Module, key: str) -> None:
        self.module, self.key = module, key
        self.form: tuple | None = None  # learnt from the second capture


class _Layer:
    """A planned layer: the keys of its input and output, its deltas (child, key) in the order
    they are added to the stream, and its attention sublayers."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.pre: str | None = None
        self.post: str | None = None
        self.deltas: list[tuple[nn.Module, str]] = []
        self.attns: list[_Attention] = []


class Plan:
    """Where each key of a capture comes from (see the module docstring)."""

    def __init__(self, heads: list[int] | None, dtype: torch.dtype | None) -> None:
        self.heads, self.dtype = heads, dtype
        self.layers: list[_Layer] = []
        self.lists: list[tuple[nn.Module, int]] = []  # each layer list and its length
        self.chain = True  # every layer's input is the previous layer's output
        self.meta: dict[str, Any] = {}
        self._meta: bytes | None = None  # self.meta pickled
        self.confirmed = False

    def keys(self) -> set[str]:
        out: set[str] = set()
        for lay in self.layers:
            out.update(k for k in (lay.pre, lay.post) if k is not None)
            out.update(k for _, k in lay.deltas)
            out.update(a.key for a in lay.attns)
        return out

    def intact(self) -> bool:
        """Whether the model's layer lists still have the lengths learnt."""
        return all(len(c) == n for c, n in self.lists)

    def metadata(self, model: nn.Module, given: dict[str, Any], tensors: dict[str, Tensor]) -> dict[str, Any]:
        """A planned capture's metadata: what was given, the model, and the learnt rest."""
        meta = dict(given)
        meta.setdefault("model", model_info(model))
        meta.update(pickle.loads(self._meta) if self._meta is not None else copy.deepcopy(self.meta))
        floats = {str(t.dtype).replace("torch.", "") for t in tensors.values() if t.is_floating_point()}
        meta["dtype"] = ", ".join(sorted(floats))
        return meta


def propose(
    tracer: Any,
    names: dict[int, str],
    meta: dict[str, Any],
    model: nn.Module,
    given: set[str],
    selection: Any,
    dtype: Any,
) -> Plan | None:
    """A plan from a full capture (its tracer, handle ``names`` and metadata), or None when some
    key is of a kind a plan does not repeat (see the module docstring)."""
    f = tracer.forward
    if f.blind or f.unseen or tracer.looped or tracer.plain_records() or not tracer.records:
        return None
    if set(meta) - given - _MODEL_SIDE - {"model", "dtype"}:
        return None  # metadata read from this input's patterns or positions
    stacks = meta.get("stacks", {})
    if set(stacks) - {"encoder", "decoder"} or any(set(s) - {"layers", "chain"} for s in stacks.values()):
        return None
    modules = dict(model.named_modules(remove_duplicate=False))
    plan = Plan(selection.heads, dtype)
    for entry in meta.get("layers", []):
        if set(entry.get("deltas", {}).values()) - {"sublayer output"}:
            return None
    for r in tracer.records:
        layer = modules.get(r.module)
        if layer is None or r.call or any(k is not None for k in r.kinds):
            return None
        lay = _Layer(layer)
        for rname, h in r.residuals:
            key = names.get(h)
            if key is None:
                return None
            if rname == "resid_pre" and lay.pre is None:
                lay.pre = key
            elif rname == "resid_post" and lay.post is None:
                lay.post = key
            elif rname.endswith(".delta"):
                try:
                    child = layer.get_submodule(rname.removesuffix(".delta"))
                except AttributeError:
                    return None
                lay.deltas.append((child, key))
            else:
                return None
        if len(r.modules) != len(r.patterns):
            return None
        for (_role, fields, _shape, impl, _causal), path in zip(r.patterns, r.modules, strict=True):
            sub = modules.get(path) if path is not None else None
            key = names.get(fields.get("pattern", -1)) if set(fields) == {"pattern"} else None
            if sub is None or key is None or set(impl) != {"sdpa"}:
                return None
            lay.attns.append(_Attention(sub, key))
        if lay.pre is None or lay.post is None:
            return None
        plan.layers.append(lay)
    if plan.keys() != set(names.values()):
        return None
    plan.lists = [
        (modules[c], n) for c, n in tracer.kept.items() if isinstance(modules.get(c), nn.ModuleList)
    ]
    if len(plan.lists) != len(tracer.kept):
        return None
    plan.chain = all(tracer.chain.get(c, True) for c in tracer.kept)
    plan.meta = copy.deepcopy({k: v for k, v in meta.items() if k in _MODEL_SIDE})
    try:  # each capture gets its own copy: unpickled, several times faster than a deep copy
        plan._meta = pickle.dumps(plan.meta)
    except Exception:  # something in it that does not pickle: deep copies
        plan._meta = None
    return plan


__all__ = ["Plan", "key_for", "propose", "sdpa_form"]
