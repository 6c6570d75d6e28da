"""Per-layer bookkeeping: which call is a layer, its sublayers and their roles, its residuals.

A layer starts when an element of an ``nn.ModuleList`` (or a one-type ``nn.Sequential``) is
entered, or is adopted when attention is seen outside any list; it ends when that call returns.
Its sublayers are the child calls that carry weights; each keeps the attention seen inside it
(:class:`_Attn`). At the end the layer's residual stream (:mod:`probe.capture.residual`) is split
into ``resid_pre``, one delta per sublayer kind and ``resid_post``, and one :class:`LayerRecord`
is kept for the engine to name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from probe.cache import heap
from probe.capture.residual import LayerStream
from probe.errors import ProbeError


def _is_source(module: nn.Module) -> bool:
    """Whether a child of a layer is a sublayer (attention, MLP, experts, a projection), not a norm."""
    if next(module.children(), None) is not None:
        return True
    return any(p.dim() >= 2 for p in module.parameters(recurse=False))


@dataclass
class _Attn:
    """Attention seen inside one sublayer call."""

    parts: list[tuple[Tensor, int]] = field(default_factory=list)  # (pattern, version at capture)
    impl: set[str] = field(default_factory=set)
    inputs: list[Tensor] = field(default_factory=list)
    primary: Tensor | None = None
    role: str | None = None
    handle: int | None = None
    causal: bool | None = None
    shape: tuple[int, ...] = ()


@dataclass
class _Layer:
    container: str
    index: int
    wanted: bool
    depth: int = 0  # position of the layer's call on the stack
    resid_pre: Tensor | None = None
    stream: LayerStream | None = None
    attns: list[_Attn] = field(default_factory=list)
    events: int = 0
    blind: int = 0  # attention calls seen before this layer that probe cannot look into
    fused: tuple[Tensor, Tensor] | None = None  # (stream after attention, output) of a fused layer
    calls: dict[int, Any] = field(default_factory=dict)  # sublayer id -> its _Call


@dataclass
class _Call:
    module: nn.Module
    parent: _Call | None
    primary: Tensor | None
    inputs: list[Tensor]
    layer: _Layer | None = None
    attn: _Attn | None = None
    suspended: bool = False
    source: bool = False  # a sublayer of the layer being captured
    wrapper: bool = False  # holds all of the layer's weights (TransformerLens' bridge): look inside
    events: int = 0


@dataclass
class LayerRecord:
    """What the tracer captured for one layer (before stack names are settled)."""

    container: str
    index: int
    module: str
    patterns: list[tuple[str, int, tuple[int, ...], list[str], bool | None]]
    residuals: list[tuple[str, int]]
    notes: dict[str, Any] = field(default_factory=dict)  # residual_note / deltas definitions


class _Layers:
    """The :class:`~probe.capture.tracer.Tracer`'s layer bookkeeping (starting, adopting, ending
    and closing layers; finding the sublayer running now; the residual hand-off)."""

    # -- layers --------------------------------------------------------------------------------
    def _start_layer(self, call: _Call, container: str, index: int) -> None:
        wanted = self.layers_wanted is None or index in self.layers_wanted
        layer = _Layer(container=container, index=index, wanted=wanted, depth=len(self.stack))
        layer.blind = len(self.blind)
        layer.calls[id(call)] = call
        call.layer = layer
        self.layer, self.layer_call = layer, call
        p = call.primary
        if wanted and p is not None and p.is_nested:
            layer.resid_pre = p  # torch's nested-tensor path: made dense once the layer has run
        elif wanted and p is not None and p.is_floating_point() and p.dim() > 0:
            layer.stream = LayerStream(p)
            layer.resid_pre = layer.stream.pre
            if p.dim() >= 2:
                self.lengths.update(p.shape[:-1])

    def _adopt_layer(self) -> None:
        # No list of layers on the stack: the layer is the top-level child computing attention.
        call = self.stack[1] if len(self.stack) > 1 else self.stack[0]
        depth = self.stack.index(call)
        self._start_layer(call, self.names.get(id(self.model), "") + ":single", 0)
        self.container_len.setdefault(self.layer.container, 1)
        self.layer.depth = depth
        self.layer.resid_pre = self.layer.stream = None  # adopted mid-call: its input was not watched
        p = call.primary
        if p is not None and not p.is_nested and p.is_floating_point() and p.dim() > 0:
            self.layer.stream = LayerStream(p)
            self.layer.resid_pre = self.layer.stream.pre

    def _end_layer(self, call: _Call, out: Tensor | None) -> None:
        layer = call.layer
        self.layer, self.layer_call = None, None
        if layer is None:
            return
        last = layer.index + 1 >= self.container_len.get(layer.container, 0)
        if last:
            # the list's last layer: what runs next (a final norm, the LM head and its logits)
            # computes no pattern, so the reused buffers are let go (the I/O thread frees each
            # once written) instead of adding to the forward's own peak
            self._scratches, self._clean = [None, None], [False, False]
        try:
            self._close_layer(layer, call, out)
        finally:
            # _Layer.calls -> _Call.layer -> _Layer is a cycle: left alone, it keeps the layer's
            # stream tensors (inputs, residual adds) alive until a garbage collection, so a
            # streamed capture would hold every layer's residuals to the end
            call.layer = None
            layer.calls.clear()
            layer.attns.clear()
            layer.stream = layer.fused = layer.resid_pre = None
        if last and not self._reuse and heap.heap_bytes(self.sink.held()) >= heap.MIN_BYTES:
            # Kept in memory, each layer's residuals stay in the C heap while the model's
            # temporaries come and go around them: the holes left are free but resident. Handed
            # back now, they do not add to what runs next (an LM head's logits are the plain
            # forward's own peak): -100 MiB of peak for GPT-2 small at T = 1024. (Short inputs
            # keep too little to leave holes worth the trim and the faults that follow it.)
            heap.trim()

    def _close_layer(self, layer: _Layer, call: _Call, out: Tensor | None) -> None:
        if len(self.blind) > layer.blind:
            name = self.names.get(id(call.module), "?")
            raise ProbeError(
                f"layer {name} computes attention with {self.blind[-1]}, which probe cannot look "
                'into; load the model with attn_implementation="sdpa" (or "eager") to capture it'
            )
        if not layer.events:
            # a list element with no attention (a Mamba or MLP-only block of a hybrid): its
            # stream is kept, named once the lists with attention are known
            if layer.wanted and layer.resid_pre is not None and not layer.resid_pre.is_nested:
                if out is not None and not out.is_nested and out.shape == layer.resid_pre.shape:
                    name = self.names.get(id(call.module), "?")
                    self.plain.append((layer.container, layer.index, name, layer.resid_pre, out.detach()))
            return
        self.kept[layer.container] = self.container_len.get(layer.container, layer.index + 1)
        if not layer.wanted:
            return
        patterns = [
            (a.role or "self", a.handle, a.shape, sorted(a.impl), a.causal)
            for a in layer.attns
            if a.handle is not None
        ]
        residuals, notes = self._residuals(layer, call, out)
        self.records.append(
            LayerRecord(
                layer.container,
                layer.index,
                self.names.get(id(call.module), "?"),
                patterns,
                residuals,
                notes,
            )
        )

    def plain_records(self) -> list[LayerRecord]:
        """Records of list elements without attention in lists that have attention (hybrids)."""
        out = []
        for container, index, name, pre, post in self.plain:
            if container not in self.kept:
                continue
            handles = [
                ("resid_pre", self._put(pre)),
                ("resid_post", self._put(post)),
            ]
            note = "no attention in this layer: only resid_pre and resid_post are stored"
            out.append(LayerRecord(container, index, name, [], handles, {"residual_note": note}))
        self.plain.clear()
        return out

    def _kind(self, layer: _Layer, source: int) -> str:
        call = layer.calls.get(source)
        while call is not None and call.attn is None and call.parent is not None and call.parent.wrapper:
            call = call.parent  # a projection of an attention module that holds all the layer's weights
        if call is None or call.attn is None:
            return "mlp"
        return f"{call.attn.role or 'self'}_attn"

    def _residuals(
        self, layer: _Layer, call: _Call, out: Tensor | None
    ) -> tuple[list[tuple[str, int]], dict]:
        if layer.fused is not None:
            out = layer.fused[1]
        pre = layer.resid_pre
        if pre is None or pre.is_nested or out is None or out.is_nested or out.shape != pre.shape:
            return [], {"residual_note": "the layer's input or output is not a residual stream tensor"}
        post = out.detach()
        notes: dict[str, Any] = {}
        deltas: dict[str, Tensor] = {}
        if layer.fused is not None:  # nn.TransformerEncoderLayer's fused kernel, replayed
            s1 = layer.fused[0]
            deltas["self_attn"], deltas["mlp"] = s1 - pre, post - s1
            notes["deltas"] = {"self_attn": "stream difference", "mlp": "stream difference"}
        elif layer.stream is not None:
            st = layer.stream
            attn_calls = [c for c in layer.calls.values() if c.attn is not None]
            layer_level = id(call) in {s for a in st.adds for s in a.sources}
            if not st.adds and len(layer.attns) == 1 and attn_calls == [call]:
                # the layer is one attention module without a residual (no stream to add to)
                deltas[f"{layer.attns[0].role or 'self'}_attn"] = post - pre
                notes["deltas"] = {f"{layer.attns[0].role or 'self'}_attn": "stream difference"}
            elif layer_level and len(st.adds) > 1:
                notes["residual_note"] = (
                    "attention and MLP are computed in the layer's own forward (not in child "
                    "modules), so probe cannot tell their residual additions apart"
                )
            else:
                d = st.decompose(
                    post,
                    lambda s: self._kind(layer, s),
                    lambda s: self.names.get(id(layer.calls[s].module), "?") if s in layer.calls else "?",
                )
                if d.deltas is None:
                    notes["residual_note"] = d.note
                else:
                    deltas = d.deltas
                    notes["deltas"] = d.definition
                    unseen = [
                        f"{a.role or 'self'}_attn"
                        for a in layer.attns
                        if f"{a.role or 'self'}_attn" not in deltas
                    ]
                    if unseen:
                        deltas = {}
                        notes = {
                            "residual_note": f"probe found no residual addition of the {unseen[0]} output"
                        }
            layer.stream = None
        items = [("resid_pre", pre)]
        for name in ("self_attn", "cross_attn", "mlp"):
            if name in deltas:
                items.append((f"{name}.delta", deltas[name]))
        items.append(("resid_post", post))
        return [(n, self._put(t)) for n, t in items], notes

    # -- the layer and sublayer of an event ----------------------------------------------------
    def _current_layer(self) -> _Layer:
        if self.layer is None:
            self._adopt_layer()
        return self.layer

    def after_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        lay = self.layer
        if lay is not None and lay.stream is not None:
            lay.stream.after_op(func, args, kwargs, out, self.source_id())

    def _sublayer_call(self) -> _Call:
        lc = self.layer_call
        for i, c in enumerate(self.stack):
            if c is lc:
                for sub in self.stack[i + 1 :]:
                    if not sub.wrapper:
                        return sub
                return self.stack[-1]
        return self.stack[-1]

    def source_id(self) -> int | None:
        """The sublayer (child call of the layer) running now, as a key into the layer's calls."""
        lay = self.layer
        if lay is None:
            return None
        for c in self.stack[lay.depth + 1 :]:
            if not c.wrapper:
                return id(c) if c.source else None
        return id(self.layer_call)  # computed in the layer's own forward
