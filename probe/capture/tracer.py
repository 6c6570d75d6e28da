"""The capture engine: module hooks plus a ``TorchFunctionMode`` that sees attention being computed.

How it works, in one pass over the unmodified model:

* **Where attention happens.** While the model runs, a ``TorchFunctionMode`` sees every
  ``softmax`` (``F.softmax``, ``torch.softmax``, ``Tensor.softmax``), every
  ``F.scaled_dot_product_attention`` and every ``F.multi_head_attention_forward`` call. A softmax
  over the last dimension is a pattern when its last two axes are sequence lengths (lengths of
  the model's inputs or of a layer's stream): routers over experts, output probabilities and
  softmaxes over features are not. Scores laid out ``[batch·heads, q, k]`` are restored to
  ``[batch, heads, q, k]``. For SDPA the fused kernel runs untouched and the weights are
  computed beside it from the same ``q``, ``k``, mask and scale (:mod:`probe.capture.patterns`).
  ``nn.MultiheadAttention`` (and torch's encoder layers), whose fast paths switch off whenever a
  torch-function mode is active, run with the mode suspended; their weights are recomputed from
  the module's parameters. ``flex_attention`` computes inside a compiled kernel probe cannot see:
  a layer that uses it is an error naming the fix, never a silently dropped layer.
* **Layers** are found in the module tree: a layer is the outermost module on the call stack that
  is an element of an ``nn.ModuleList`` (or of an ``nn.Sequential`` of one module type). Its index
  is its index in that list, so ``blocks.3`` is ``list[3]`` also when some elements compute no
  attention (hybrids); those keep ``resid_pre``/``resid_post`` only. A model without such a list
  has one layer: the top-level child that computes attention (or the model itself).
* **Sublayers and roles.** Attention computed inside one child call of the layer is one
  attention sublayer; softmaxes of separate head modules (``[batch, q, k]`` each) are stacked as
  its heads. A sublayer is *cross*-attention when its queries and keys differ in length or it
  is handed a second stream-shaped tensor that is not derived from the layer's own stream (the
  encoder output); the residual handed to an attention module (BLOOM) is not.
* **Stacks.** A list of layers with cross-attention is the ``decoder``; another list beside it is
  the ``encoder``. A lone list is the ``decoder`` when its self-attention is causal, else the
  ``encoder``.
* **Residual stream.** ``resid_pre``/``resid_post`` are the layer's input and output; the deltas
  come from following the data flow inside the layer (:mod:`probe.capture.residual`) and are
  verified against the stream before they are stored, or left out with a note saying why.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from probe.cache.writer import MemorySink
from probe.capture.patterns import mha_weights, sdpa_weights
from probe.capture.residual import ADD, ADD_INPLACE, LayerStream
from probe.errors import ProbeError

try:  # the higher-order op flex_attention runs; its scores never exist outside the kernel
    from torch._higher_order_ops.flex_attention import flex_attention as _FLEX
except ImportError:  # pragma: no cover - older torch
    _FLEX = None

_SOFTMAX = {F.softmax, torch.softmax, Tensor.softmax, torch.special.softmax}
_SDPA = F.scaled_dot_product_attention
_MHA_FN = F.multi_head_attention_forward
# torch modules whose fast paths are disabled by any active torch-function mode
_SUSPEND = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)


def _first_tensor(args: tuple, kwargs: dict) -> Tensor | None:
    for a in args:
        if isinstance(a, Tensor):
            return a
    for name in ("hidden_states", "x", "input", "inputs", "query", "src", "tgt"):
        if isinstance(kwargs.get(name), Tensor):
            return kwargs[name]
    for v in kwargs.values():
        if isinstance(v, Tensor):
            return v
    return None


def _output_tensor(out: Any) -> Tensor | None:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    first = getattr(out, "last_hidden_state", None)
    if isinstance(first, Tensor):
        return first
    if isinstance(out, dict):
        for v in out.values():
            if isinstance(v, Tensor):
                return v
    return None


def _tensors(args: tuple, kwargs: dict) -> list[Tensor]:
    found = []
    for v in itertools.chain(args, kwargs.values()):
        if isinstance(v, Tensor):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            found.extend(t for t in v if isinstance(t, Tensor))
    return found


def _lengths(tensors: list[Tensor]) -> set[int]:
    """Sizes that may be sequence lengths: every axis of id tensors and masks, all but the last of floats."""
    sizes: set[int] = set()
    for t in tensors:
        if t.is_nested or t.dim() == 0:
            continue
        sizes.update(t.shape if not t.is_floating_point() else t.shape[:-1])
    return sizes


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


class _Mode(TorchFunctionMode):
    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        # weak: the tracer holds the mode, and a cycle would keep the model's tensors alive
        self._tracer = weakref.ref(tracer)
        self.quiet = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tr = self._tracer()
        if tr is None or self.quiet or not tr.stack:
            return func(*args, **kwargs)
        if func in _SOFTMAX:
            out = func(*args, **kwargs)
            tr.on_softmax(args, kwargs, out)
            tr.after_op(func, args, kwargs, out)
            return out
        if func is _SDPA:
            out = func(*args, **kwargs)
            if tr.wants_pattern():
                buf, clean = tr.scratch()
                w = sdpa_weights(*args, **kwargs, out=buf, clean=clean)
                tr.note_causal(len(args) > 5 and args[5] or kwargs.get("is_causal", False))
                tr.on_pattern(w, "sdpa")
            else:
                tr.note_event()  # a layer left out by `layers=`: count it, skip the work
            tr.after_op(func, args, kwargs, out)
            return out
        if func is _MHA_FN:
            # re-enter the mode so the SDPA or softmax inside is seen like any other
            with self:
                out = func(*args, **kwargs)
            tr.after_op(func, args, kwargs, out)
            return out
        if func is _FLEX and _FLEX is not None:
            # runs while torch.compile traces flex_attention: only record (dynamo replays appends)
            tr.blind.append("flex_attention")
            return func(*args, **kwargs)
        lay = tr.layer
        if lay is not None and lay.stream is not None:
            if func in ADD or func in ADD_INPLACE:
                return lay.stream.on_add(func, args, kwargs, tr.source_id())
            out = func(*args, **kwargs)
            lay.stream.after_op(func, args, kwargs, out, tr.source_id())
            return out
        return func(*args, **kwargs)


class Tracer:
    """Hooks a model for one capture; see the module docstring for what it records."""

    def __init__(
        self,
        model: nn.Module,
        sink: Any,
        *,
        layers: list[int] | None = None,
        heads: list[int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.sink = sink
        self.layers_wanted = None if layers is None else set(layers)
        self.heads = heads
        self.dtype = dtype
        self.names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        # list element -> (the list's name, its index there): layers keep the model's own numbers
        self.container_of: dict[int, tuple[str, int]] = {}
        self.container_len: dict[str, int] = {}
        for n, m in model.named_modules():
            homogeneous = isinstance(m, nn.Sequential) and len({type(c) for c in m}) == 1
            if isinstance(m, nn.ModuleList) or homogeneous:
                self.container_len.setdefault(n, len(m))
                for i, child in enumerate(m.children()):
                    self.container_of.setdefault(id(child), (n, i))
        self.stack: list[_Call] = []
        self.layer: _Layer | None = None
        self.layer_call: _Call | None = None
        self.records: list[LayerRecord] = []
        self.plain: list[tuple[str, int, str, Tensor, Tensor]] = []  # list elements without attention
        self.kept: dict[str, int] = {}  # list with attention -> its number of elements
        self.root_calls = 0
        self.impls: set[str] = set()
        self.stored_dtypes: set[str] = set()
        self.lengths: set[int] = set()  # sizes that are sequence lengths in this forward
        self.blind: list[str] = []  # attention kernels probe cannot look into, as seen
        self._sources: dict[type, bool] = {}
        self._param_counts: dict[int, int] = {}
        self._mode = _Mode(self)
        self._handles: list[Any] = []
        self._suspended = 0
        self._fast_layers: set[int] = set()
        self._replaying = False
        # Streaming to disk: recomputed patterns go into two buffers used in turn (the I/O thread
        # writes one while the next layer fills the other), which saves allocating and
        # page-faulting a fresh one every layer.
        self._reuse = not isinstance(sink, MemorySink)
        self._scratches: list[Tensor | None] = [None, None]
        self._clean = [False, False]  # last filled by a causal call: zeros above the diagonal stay
        self._turn = 0
        self._causal_call = False
        self._scratch_busy = False

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> Tracer:
        # nn.TransformerEncoderLayer leaves its fast path when any hook sits on it or inside it,
        # so those subtrees get no per-module hooks: a global hook pair, filtered to these
        # layers, sees their calls instead (global hooks live outside the per-module dicts).
        opaque: set[int] = set()
        for m in self.model.modules():
            if isinstance(m, nn.TransformerEncoderLayer):
                self._fast_layers.add(id(m))
                opaque.update(id(x) for x in m.modules())
        for m in self.model.modules():
            if id(m) in opaque:
                continue
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post, with_kwargs=True, always_call=True))
        if self._fast_layers:
            module_hooks = nn.modules.module
            self._handles.append(module_hooks.register_module_forward_pre_hook(self._global_pre))
            self._handles.append(
                module_hooks.register_module_forward_hook(
                    self._global_post, with_kwargs=True, always_call=True
                )
            )
        self._mode.__enter__()
        return self

    def _global_pre(self, module: nn.Module, args: tuple) -> None:
        if id(module) in self._fast_layers:
            self._pre(module, args, {})

    def _global_post(self, module: nn.Module, args: tuple, *rest: Any) -> None:
        if id(module) in self._fast_layers:
            # (kwargs, output) normally; torch passes only (output) when forward raised
            kwargs, output = rest if len(rest) == 2 else ({}, rest[-1])
            self._post(module, args, kwargs, output)

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._suspended:
                torch._C._push_on_torch_function_stack(self._mode)
                self._suspended = 0
            self._mode.__exit__(*exc)
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self.layer = self.layer_call = None
            self.stack.clear()

    # -- hooks ---------------------------------------------------------------------------------
    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._replaying:
            return
        self._mode.quiet += 1
        try:
            parent = self.stack[-1] if self.stack else None
            inputs = _tensors(args, kwargs)
            call = _Call(module, parent, _first_tensor(args, kwargs), inputs)
            if parent is None:
                self.root_calls += 1
                self.lengths |= _lengths(inputs)
            if self.layer is None and id(module) in self.container_of:
                self._start_layer(call, *self.container_of[id(module)])
            elif parent is not None and (parent is self.layer_call or parent.wrapper):
                n = self._n_params(module)
                if n and n == self._n_params(self.layer_call.module):
                    call.wrapper = True  # a wrapper of the whole layer: its children are the sublayers
                else:
                    kind = type(module)
                    if kind not in self._sources:
                        self._sources[kind] = _is_source(module)
                    call.source = self._sources[kind] or _is_source(module)
                    if call.source:
                        self.layer.calls[id(call)] = call
            self.stack.append(call)
            if isinstance(module, _SUSPEND):
                call.suspended = True
                self._suspend()
        finally:
            self._mode.quiet -= 1

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._replaying:
            return
        self._mode.quiet += 1
        try:
            if not self.stack or self.stack[-1].module is not module:
                return  # a call that began before capture started
            call = self.stack[-1]
            if call.suspended:
                self._resume()
                if isinstance(module, nn.MultiheadAttention) and call.events == 0:
                    self._mha_event(module, args, kwargs)
                elif isinstance(module, nn.TransformerEncoderLayer) and call.events == 0:
                    self._encoder_layer_event(module, args, kwargs, output)
                lay = self.layer
                src = self.source_id()
                if lay is not None and lay.stream is not None and src is not None:
                    # computed with the mode off: label the output as this sublayer's
                    stream = any(lay.stream.label(t)[0] for t in call.inputs)
                    lay.stream.mark(_output_tensor(output), stream, src)
            self.stack.pop()
            if call.attn is not None:
                self._flush_attn(call.attn)
            if call is self.layer_call:
                self._end_layer(call, _output_tensor(output))
        finally:
            self._mode.quiet -= 1

    def _n_params(self, module: nn.Module) -> int:
        n = self._param_counts.get(id(module))
        if n is None:
            n = self._param_counts[id(module)] = sum(p.numel() for p in module.parameters())
        return n

    def source_id(self) -> int | None:
        """The sublayer (child call of the layer) running now, as a key into the layer's calls."""
        lay = self.layer
        if lay is None:
            return None
        for c in self.stack[lay.depth + 1 :]:
            if not c.wrapper:
                return id(c) if c.source else None
        return id(self.layer_call)  # computed in the layer's own forward

    def _suspend(self) -> None:
        if self._suspended == 0:
            n = torch._C._len_torch_function_stack()
            if n and torch._C._get_function_stack_at(n - 1) is self._mode:
                torch._C._pop_torch_function_stack()
                self._suspended = 1
            else:
                self._suspended = -1  # another mode is on top: leave the stack alone
        elif self._suspended > 0:
            self._suspended += 1
        else:
            self._suspended -= 1

    def _resume(self) -> None:
        if self._suspended > 1:
            self._suspended -= 1
        elif self._suspended == 1:
            torch._C._push_on_torch_function_stack(self._mode)
            self._suspended = 0
        elif self._suspended < -1:
            self._suspended += 1
        else:
            self._suspended = 0

    def _mha_event(self, module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> None:
        if not self.wants_pattern():
            self.note_event()
            return
        with torch.no_grad():
            w = mha_weights(module, args, kwargs)
        if w is not None:
            self.on_pattern(w, "mha")

    def _encoder_layer_event(
        self, layer: nn.TransformerEncoderLayer, args: tuple, kwargs: dict, output: Any
    ) -> None:
        """Patterns and residual boundary of an ``nn.TransformerEncoderLayer`` that ran fused.

        Its fast path computes the whole layer in one kernel, so nothing inside can be watched:
        the weights are recomputed from ``self_attn``'s parameters, and the stream after the
        attention sublayer from the layer's own modules (torch's slow path, same arithmetic).
        """
        names = ("src", "src_mask", "src_key_padding_mask", "is_causal")
        bound = dict(zip(names, args, strict=False))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        x, out = bound["src"], _output_tensor(output)
        kpm = bound.get("src_key_padding_mask")
        if x.is_nested:  # TransformerEncoder's nested-tensor path: the padding lives in the sizes
            lengths = torch.tensor([t.size(0) for t in x.unbind()], device=x.device)
            x = x.to_padded_tensor(0.0)
            out = out.to_padded_tensor(0.0, x.shape)
            kpm = torch.arange(x.size(1), device=x.device)[None, :] >= lengths[:, None]
        mask, causal = bound.get("src_mask"), bool(bound.get("is_causal", False))
        if causal and mask is None:
            mask = torch.ones(x.size(-2), x.size(-2), dtype=torch.bool, device=x.device).triu_(1)
        attn_kw = {"attn_mask": mask, "key_padding_mask": kpm}
        self._replaying = True  # the layer's own modules run below: not part of the capture
        try:
            with torch.no_grad():
                a_in = layer.norm1(x) if layer.norm_first else x
                weights = mha_weights(layer.self_attn, (a_in, a_in, a_in), attn_kw)
                sa = layer.self_attn(a_in, a_in, a_in, need_weights=False, **attn_kw)[0]
                s1 = x + sa if layer.norm_first else layer.norm1(x + sa)
        finally:
            self._replaying = False
        if self.wants_pattern():
            self.on_pattern(weights, "mha")
        else:
            self.note_event()
        lay = self.layer
        if lay is not None and lay.wanted:
            if lay.resid_pre is None or lay.resid_pre.is_nested:  # the padded form of a nested input
                lay.resid_pre = x.detach().clone()
            lay.fused = (s1, out)

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
        if layer.index + 1 >= self.container_len.get(layer.container, 0):
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

    # -- attention events ----------------------------------------------------------------------
    def _current_layer(self) -> _Layer:
        if self.layer is None:
            self._adopt_layer()
        return self.layer

    def wants_pattern(self) -> bool:
        """Whether the attention about to be seen belongs to a layer being captured."""
        if not self.stack:
            return False
        return self._current_layer().wanted

    def note_event(self) -> None:
        for c in self.stack:
            c.events += 1
        self._current_layer().events += 1

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

    def on_softmax(self, args: tuple, kwargs: dict, out: Tensor) -> None:
        if not isinstance(out, Tensor) or out.dim() < 3:
            return
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if dim is None or dim not in (-1, out.dim() - 1):
            return
        if out.shape[-1] not in self.lengths or out.shape[-2] not in self.lengths:
            return  # over experts, classes or features: not attention over a sequence
        if self.wants_pattern():
            self.on_pattern(out, "softmax")
        else:
            self.note_event()

    def scratch(self) -> tuple[Tensor | None, bool]:
        """A buffer the next recomputed pattern may be written into (or None), and whether it is
        clean (last filled by a causal call: its unseen keys are zeros already)."""
        if not self._reuse or self._scratch_busy:
            return None, False
        buf = self._scratches[self._turn]
        if buf is not None:
            self.sink.wait_written(buf)  # its previous pattern may still be on its way to disk
        return buf, buf is not None and self._clean[self._turn]

    def note_causal(self, causal: Any) -> None:
        """Whether the SDPA call about to be recorded was ``is_causal`` (keeps a scratch clean)."""
        self._causal_call = bool(causal)

    def on_pattern(self, pattern: Tensor, impl: str) -> None:
        """Record an attention pattern ``[batch, (head,) query, key]`` computed now."""
        self.note_event()
        layer = self._current_layer()
        sub = self._sublayer_call()
        if sub.attn is None:
            a = _Attn(inputs=sub.inputs, primary=sub.primary)
            sub.attn = a
            layer.attns.append(a)
        a = sub.attn
        if a.parts and a.parts[0][0].shape[-2:] != pattern.shape[-2:]:
            # a second, differently shaped attention in the same sublayer: record it on its own
            self._flush_attn(a)
            a = _Attn(inputs=sub.inputs, primary=sub.primary)
            sub.attn = a
            layer.attns.append(a)
        p = pattern.detach()
        if self._reuse and not self._scratch_busy and impl == "sdpa":
            self._scratches[self._turn], self._scratch_busy = p, True
            # same shape next time: sdpa_weights writes the same causal region, the rest stays 0
            self._clean[self._turn] = self._causal_call
        a.parts.append((p, p._version))
        a.impl.add(impl)
        self.impls.add(impl)

    def _batch_size(self, a: _Attn, q: int) -> int | None:
        """The batch size of the stream handed to the sublayer: ``[batch, q, d]`` or ``[q, batch, d]``."""
        p = a.primary
        if p is None or p.is_nested or p.dim() != 3:
            return None
        if p.shape[1] == q:
            return p.shape[0]
        return p.shape[1] if p.shape[0] == q else None

    def _flush_attn(self, a: _Attn) -> None:
        if not a.parts or a.handle is not None:
            return
        for p, v in a.parts:
            if p._version != v:
                raise RuntimeError(
                    "an attention pattern was modified in place after softmax; "
                    "probe cannot capture it exactly"
                )
        batch = self._batch_size(a, a.parts[0][0].shape[-2])
        parts = []
        for p, _ in a.parts:
            if p.dim() == 3 and batch is not None and p.shape[0] != batch:
                # scores laid out [batch·heads, q, k] (bmm/baddbmm): batch-major, as torch's own
                if p.shape[0] % batch:
                    raise ProbeError(
                        f"attention weights of shape {list(p.shape)} do not split into batch "
                        f"{batch} x heads; lay the scores out as [batch, heads, query, key]"
                    )
                p = p.reshape(batch, p.shape[0] // batch, *p.shape[1:])
            parts.append(p if p.dim() >= 4 else p.unsqueeze(-3))
        pattern = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-3)
        if pattern.dim() > 4:
            pattern = pattern.flatten(1, -4)
        if self.heads is not None:
            if max(self.heads) >= pattern.shape[1]:
                n = pattern.shape[1]
                raise ProbeError(
                    f"heads={self.heads}: this model's attention has {n} heads; choose indices from 0-{n - 1}"
                )
            pattern = pattern[:, self.heads]
        q, k = pattern.shape[-2], pattern.shape[-1]
        cross = q != k
        p0 = a.primary
        if not cross and p0 is not None and not p0.is_nested and p0.dim() == 3:
            st = self.layer.stream if self.layer is not None else None
            for t in a.inputs:
                if (
                    t is not p0
                    and not t.is_nested
                    and t.dim() == 3
                    and t.is_floating_point()
                    and t.shape[0] == p0.shape[0]
                    and t.shape[-1] == p0.shape[-1]
                    and t.data_ptr() != p0.data_ptr()
                    and not (st is not None and st.label(t)[0])  # the layer's own stream (BLOOM's residual)
                ):
                    cross = True
                    break
        a.role = "cross" if cross else "self"
        if not cross and q > 1:
            # judged per text: a decoder's longest text has no pad queries (a pad query whose keys
            # are all masked may come out uniform), an encoder's texts all see ahead
            mid = q // 2
            first = (pattern[:, :, 0, 1:] == 0).flatten(1).all(dim=1)
            middle = (pattern[:, :, mid, mid + 1 :] == 0).flatten(1).all(dim=1)
            a.causal = bool((first & middle).any())
        a.shape = tuple(pattern.shape)
        # recomputed weights are probe's own memory (the scratch is only reused once written);
        # softmax outputs are the model's
        mine = a.impl <= {"sdpa", "mha"} or all(
            pattern.untyped_storage().data_ptr() != p.untyped_storage().data_ptr() for p, _ in a.parts
        )  # stacked heads or selected heads are a copy
        a.handle = self._put(pattern, owned=mine)
        if self._scratch_busy and any(p is self._scratches[self._turn] for p, _ in a.parts):
            self._scratch_busy = False
            self._turn ^= 1
        a.parts.clear()

    # -- storage -------------------------------------------------------------------------------
    def _put(self, t: Tensor, owned: bool = False) -> int:
        """Hand ``t`` to the sink; a converted copy is probe's own memory."""
        stored = self._store(t)
        if not owned and stored.device == t.device and not stored.is_nested and not t.is_nested:
            owned = stored.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        return self.sink.put(stored, owned=owned)

    def _store(self, t: Tensor) -> Tensor:
        t = t.detach()
        if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
            t = t.to(self.dtype)
        self.stored_dtypes.add(str(t.dtype).replace("torch.", ""))
        return t
