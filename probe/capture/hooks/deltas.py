"""A layer's residual stream turned into deltas: ``resid_pre``, one per sublayer kind, ``resid_post``.

The :class:`~probe.capture.hooks.layers.LayerTracker` calls :func:`layer_residuals` once per captured
layer; the data flow inside the layer was followed by its
:class:`~probe.capture.hooks.residual.LayerStream`, whose residual adds :func:`decompose` turns into
deltas and verifies:

* **sublayer output**: when the add's stream operand is the stream before it and its result is
  the stream after it (pre-norm and parallel blocks), the delta is the tensor added, bit for bit;
* **stream difference**: otherwise (post-norm: the sum is normalised before the next sublayer)
  the delta is the difference of the stream values around the sublayer; a stream multiplied or
  divided by a constant before its residual add (DeepNorm's ``α·x + f(x)``) counts as the stream
  before that scaling, so the scaling is in the delta of the sublayer whose add it joins;
* the deltas must add up to ``resid_post`` within float rounding, every sublayer whose output
  reached a stream-sized tensor must be accounted for by a residual add, and outputs of
  different kinds mixed before the add must have been seen as separate parts. If any of this
  fails, no deltas are stored and the reason is returned for the cache metadata.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from probe.capture.calls import Call
from probe.capture.hooks.residual import LayerStream, ResidualAdd

_ORDER = ("self_attn", "cross_attn", "mlp")


def _absmax(t: Tensor) -> float:
    """``max |t|`` from one ``aminmax`` pass (NaN if ``t`` holds one), without the temporary of
    ``t.abs().max()``."""
    lo, hi = torch.aminmax(t)
    return max(-float(lo), float(hi))


def _same(x: Tensor, y: Tensor) -> bool:
    """``torch.equal`` with the shortcut of one memory (the stream handed on as a view)."""
    if x is y:
        return True
    if (
        x.shape == y.shape
        and x.dtype == y.dtype
        and x.data_ptr() == y.data_ptr()
        and x.stride() == y.stride()
    ):
        return True
    return torch.equal(x, y)


def _deviation(pre: Tensor, out: Tensor, deltas: dict[str, Tensor]) -> float:
    """``max |pre + sum of deltas - out|``, all ``[n, d_model]``; the deltas are added in the
    order the stream received them (no 0 + d first)."""
    total = None
    for d in deltas.values():
        if total is None or d.dtype != total.dtype or d.shape != total.shape:
            total = pre + d if total is None else total + d
        else:  # the sum is probe's own tensor from here: added in place, the same rounding
            total.add_(d)
    if not out.numel():
        return 0.0
    outf = out.float()
    # the sum (converted or not) is probe's own tensor: subtracted in place; pre is not
    return _absmax(pre.float() - outf if total is None else total.float().sub_(outf))


def _scale(pre: Tensor, out: Tensor) -> float:
    """The scale a deviation is judged by: ``max(|out|, |pre|, 1)``."""
    if not out.numel():
        return 1.0
    return max(_absmax(out.float()), _absmax(pre.float()), 1.0)


@dataclass
class Decomposition:
    """Deltas by sublayer name (``self_attn``/``cross_attn``/``mlp``), or the reason there are none."""

    deltas: dict[str, Tensor] | None
    definition: dict[str, str]
    note: str | None = None
    deviation: float = 0.0


def _is_origin(st: LayerStream, a: ResidualAdd) -> bool:
    """Whether ``a``'s stream is the layer's input itself, not written since ``pre`` was copied
    from it (the same memory, layout and dtype, and the version it had then)."""
    o, s = st.origin, a.stream
    return (
        s.data_ptr() == o.data_ptr()
        and s.dtype == o.dtype
        and s.shape == (st.numel // st.width, st.width)
        and s.stride() == (st.width, 1)
        and o.is_contiguous()
        and a.versions[0] == st.origin_version
    )


def _plans(
    st: LayerStream, kind_of: Callable[[int], str], names: Callable[[int], str]
) -> tuple[list[list[tuple[str, Tensor | None]]] | None, str | None]:
    """For each residual add, the ``(kind, part)`` pieces it splits into (one piece with part
    None when one kind of sublayer added it); or None and the note saying why it cannot split."""
    plans = []
    for a in st.adds:
        kinds = {kind_of(s) for s in a.sources}
        if len(kinds) == 1:
            plans.append([(kinds.pop(), None)])
            continue
        part_kinds = [{kind_of(s) for s in srcs} for srcs, _ in a.parts or []]
        if not part_kinds or any(len(k) != 1 for k in part_kinds):
            who = ", ".join(sorted(names(s) for s in a.sources))
            return None, (
                f"the outputs of {' and '.join(sorted(kinds))} are mixed before they reach the "
                f"stream; probe cannot separate them ({who})"
            )
        plans.append([(k.pop(), v) for k, (_, v) in zip(part_kinds, a.parts, strict=True)])
    return plans, None


def decompose(
    st: LayerStream, post: Tensor | None, kind_of: Callable[[int], str], names: Callable[[int], str]
) -> Decomposition:
    """Deltas of this layer ending in ``post`` (see the module docstring), each shaped like the stream.

    ``kind_of(source)`` names a sublayer's delta (``self_attn``/``cross_attn``/``mlp``);
    ``names(source)`` is its module path, for notes.
    """
    none = Decomposition(None, {})
    if post is None or not st.sized(post):
        none.note = "the layer's output is not shaped like its input, so it has no residual deltas"
        return none
    if not st.adds:
        none.note = "probe saw no residual addition (stream + sublayer output) in this layer"
        return none
    if not all(a.intact() for a in st.adds):
        none.note = "the layer overwrote a residual sum in place after adding it; no deltas stored"
        return none
    w = st.width
    pre, out = st.pre.reshape(-1, w), post.detach().reshape(-1, w)
    added = set().union(*(a.sources for a in st.adds))
    missing = sorted(st.touched - added)
    if missing:
        who = ", ".join(names(s) for s in missing)
        none.note = f"the output of {who} reaches the stream in a way probe does not follow"
        return none
    plans, none.note = _plans(st, kind_of, names)
    if plans is None:
        return none
    # the stream between two sublayers: what the next residual add takes, before any rescaling
    bounds = [pre] + [a.stream if a.base is None else a.base for a in st.adds[1:]] + [out]
    deltas: dict[str, Tensor] = {}
    definition: dict[str, str] = {}
    for k, (a, plan) in enumerate(zip(st.adds, plans, strict=True)):
        first = k == 0 and _is_origin(st, a)
        exact = (first or _same(a.stream, bounds[k])) and _same(a.result, bounds[k + 1])
        if len(plan) > 1 and not exact:
            none.note = (
                "the sum of the parallel sublayers' outputs is normalised before it becomes the "
                "stream; probe cannot separate their deltas"
            )
            return none
        pieces = [(plan[0][0], a.added if exact else bounds[k + 1] - bounds[k])] if len(plan) == 1 else plan
        for name, piece in pieces:
            deltas[name] = deltas[name] + piece if name in deltas else piece
            how = "sublayer output" if exact else "stream difference"
            definition[name] = how if definition.get(name, how) == how else "mixed"
    dev = _deviation(pre, out, deltas)
    tol = 16 * len(st.adds) * torch.finfo(out.dtype).eps
    # the scale is at least 1: a deviation within tol needs no look at it (a pre-norm layer's
    # sublayer outputs add up to its output exactly)
    if dev > tol and dev > tol * _scale(pre, out):
        none.note = (
            f"the residual additions probe followed do not add up to the layer's output "
            f"(off by {dev:.2g}); no deltas stored"
        )
        return none
    shape = post.shape
    return Decomposition({n: d.reshape(shape) for n, d in deltas.items()}, definition, None, dev)


def _kind(layer: Any, source: int) -> str:
    """The delta name of sublayer ``source``: ``<role>_attn`` where it computed attention, else ``mlp``."""
    call = layer.calls.get(source)
    while call is not None and call.attn is None and call.parent is not None and call.parent.wrapper:
        call = call.parent  # a projection of an attention module that holds all the layer's weights
    if call is None or call.attn is None:
        return "mlp"
    return f"{call.attn.role or 'self'}_attn"


def layer_residuals(
    layer: Any, call: Call, out: Tensor | None, name_of: Callable[[Any], str]
) -> tuple[list[tuple[str, Tensor]], dict[str, Any]]:
    """``([(name, tensor), ...], notes)`` for a layer (a :class:`~probe.capture.hooks.layers.Layer`)
    whose call ``call`` returned ``out``: names ``resid_pre``, ``<kind>.delta``..., ``resid_post``
    in that order (each tensor shaped like the stream), and the metadata notes (``deltas``: how
    each delta is defined; ``residual_note``: why there are none). ``name_of(module)``: its path."""
    if layer.fused is not None:
        out = layer.fused[1]
    pre = layer.resid_pre
    if pre is None or pre.is_nested or out is None or out.is_nested or out.shape != pre.shape:
        return [], {"residual_note": "the layer's input or output is not a residual stream tensor"}
    post = out.detach()
    if layer.fused is not None:  # nn.TransformerEncoderLayer's fused kernel, replayed
        s1 = layer.fused[0]
        deltas = {"self_attn": s1 - pre, "mlp": post - s1}
        notes: dict[str, Any] = {"deltas": {"self_attn": "stream difference", "mlp": "stream difference"}}
    elif layer.stream is not None:
        deltas, notes = _followed(layer, call, post, pre, name_of)
        layer.stream = None
    else:
        deltas, notes = {}, {}
    items = [("resid_pre", pre)]
    items += [(f"{name}.delta", deltas[name]) for name in _ORDER if name in deltas]
    items.append(("resid_post", post))
    return items, notes


def _followed(
    layer: Any, call: Call, post: Tensor, pre: Tensor, name_of: Callable[[Any], str]
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The deltas found by following the layer's data flow (its stream's residual adds)."""
    st = layer.stream
    attn_calls = [c for c in layer.calls.values() if c.attn is not None]
    layer_level = id(call) in {s for a in st.adds for s in a.sources}
    if not st.adds and len(layer.attns) == 1 and attn_calls == [call]:
        # the layer is one attention module without a residual (no stream to add to)
        name = f"{layer.attns[0].role or 'self'}_attn"
        return {name: post - pre}, {"deltas": {name: "stream difference"}}
    if layer_level and len(st.adds) > 1:
        return {}, {
            "residual_note": "attention and MLP are computed in the layer's own forward (not in child "
            "modules), so probe cannot tell their residual additions apart"
        }
    d = decompose(
        st,
        post,
        lambda s: _kind(layer, s),
        lambda s: name_of(layer.calls[s].module) if s in layer.calls else "?",
    )
    if d.deltas is None:
        return {}, {"residual_note": d.note}
    unseen = [n for n in (f"{a.role or 'self'}_attn" for a in layer.attns) if n not in d.deltas]
    if unseen:
        return {}, {"residual_note": f"probe found no residual addition of the {unseen[0]} output"}
    return d.deltas, {"deltas": d.definition}


def channels_last(items: list[tuple[str, Tensor]], q: int | None, notes: dict) -> list[tuple[str, Tensor]]:
    """A layer's residual tensors as ``[batch, pos, d_model]`` where the model keeps its stream
    channel-first, ``[batch, d_model, pos]`` (SqueezeBERT): the last axis is the layer's query
    length ``q`` and the middle one is not. Returned as given otherwise."""
    if q is None or not items or any(t.dim() != 3 or t.shape[2] != q or t.shape[1] == q for _, t in items):
        return items
    notes["residual_layout"] = "the model keeps its stream as [batch, d_model, pos]; stored transposed"
    return [(n, t.transpose(1, 2).contiguous()) for n, t in items]
