"""The capture engine: module hooks plus a ``TorchFunctionMode`` that sees attention being computed.

How it works, in one pass over the unmodified model:

* **Where attention happens.** While the model runs, a ``TorchFunctionMode`` sees every
  ``softmax`` (``F.softmax``, ``torch.softmax``, ``Tensor.softmax``), every
  ``F.scaled_dot_product_attention`` and every ``F.multi_head_attention_forward`` call. A softmax
  over the last dimension of a tensor of three or more dimensions *is* the pattern the model
  computed; for SDPA the fused kernel runs untouched and the weights are computed beside it from
  the same ``q``, ``k``, mask and scale (:mod:`probe.capture.patterns`). ``nn.MultiheadAttention``
  (and torch's encoder layers), whose fast paths switch off whenever a torch-function mode is
  active, run with the mode suspended; their weights are recomputed from the module's parameters.
* **Layers** are found in the module tree: a layer is the outermost module on the call stack that
  is an element of an ``nn.ModuleList`` (or of an ``nn.Sequential`` of one module type) and in
  whose forward attention happens. A model without such a list has one layer: the top-level
  child that computes attention (or the model itself).
* **Sublayers and roles.** Attention computed inside one child call of the layer is one
  attention sublayer; softmaxes of separate head modules (``[batch, q, k]`` each) are stacked as
  its heads. A sublayer is *cross*-attention when its queries and keys differ in length or it
  is handed a second, different stream-shaped tensor (the encoder output).
* **Stacks.** A list of layers with cross-attention is the ``decoder``; another list beside it is
  the ``encoder``. A lone list is the ``decoder`` when its self-attention is causal, else the
  ``encoder``.
* **Residual stream.** ``resid_pre``/``resid_post`` are the layer's input and output. Inside the
  layer the mode watches additions of two stream-shaped tensors (the residual adds); the older
  operand is the residual. The stream between two sublayers is the residual operand of the next
  add (post-norm: the normalised sum; pre-norm: the sum itself), and each sublayer's delta is the
  difference of the stream across it; when a sublayer's add is exactly ``stream + output`` the
  delta is that output, bit for bit. Two sublayer outputs summed before they meet the stream
  (parallel blocks: ``x + attn(ln(x)) + mlp(ln(x))``) are kept apart, each its own delta. So
  ``resid_pre + Σ deltas == resid_post`` for pre-norm, post-norm and parallel blocks alike.
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

_SOFTMAX = {F.softmax, torch.softmax, Tensor.softmax, torch.special.softmax}
_SDPA = F.scaled_dot_product_attention
_MHA_FN = F.multi_head_attention_forward
_ADD = {torch.add, Tensor.add, Tensor.__add__, Tensor.__radd__}
_ADD_INPLACE = {Tensor.add_, Tensor.__iadd__}
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


def _vkey(t: Tensor) -> tuple[int, int]:
    return (id(t), t._version)


class _ByIdentity:
    """A map keyed by tensor identity that cannot be fooled by a recycled ``id()``.

    (Tensors compare elementwise, so they cannot be dict keys; an ``id`` outlives its tensor.)
    """

    def __init__(self) -> None:
        self._items: dict[int, tuple[Any, Any]] = {}

    def get(self, t: Any) -> Any:
        held = self._items.get(id(t))
        return held[1] if held is not None and held[0]() is t else None

    def put(self, t: Tensor, value: Any) -> None:
        self._items[id(t)] = (weakref.ref(t), value)

    def clear(self) -> None:
        self._items.clear()


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
class _Add:
    kind: Any  # an _Attn (its role is settled later) or "mlp"
    residual: Tensor
    other: Tensor
    result: Tensor
    exact: bool  # result == residual + other with the residual being the stream so far
    parts: list[tuple[Any, Tensor]] | None = None  # `other` as a sum of sublayer outputs


@dataclass
class _Layer:
    container: str
    index: int
    wanted: bool
    resid_pre: Tensor | None = None
    pre_key: tuple[int, int] | None = None
    stream_shape: torch.Size | None = None
    attns: list[_Attn] = field(default_factory=list)
    adds: list[_Add] = field(default_factory=list)
    pending: _Attn | None = None
    events: int = 0
    fused: tuple[Tensor, Tensor] | None = None  # (stream after attention, output) of a fused layer
    combos: _ByIdentity = field(default_factory=_ByIdentity)  # sum of sublayer outputs -> its parts


@dataclass
class _Call:
    module: nn.Module
    parent: _Call | None
    primary: Tensor | None
    inputs: list[Tensor]
    layer: _Layer | None = None
    attn: _Attn | None = None
    suspended: bool = False
    events: int = 0


@dataclass
class LayerRecord:
    """What the tracer captured for one layer (before stack names are settled)."""

    container: str
    index: int
    module: str
    patterns: list[tuple[str, int, tuple[int, ...], list[str], bool | None]]
    residuals: list[tuple[str, int]]


class _Mode(TorchFunctionMode):
    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer
        self.quiet = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tr = self.tracer
        if self.quiet or not tr.stack:
            return func(*args, **kwargs)
        if func in _SOFTMAX:
            out = func(*args, **kwargs)
            tr.on_softmax(args, kwargs, out)
            return out
        if func is _SDPA:
            out = func(*args, **kwargs)
            if tr.wants_pattern():
                tr.on_pattern(sdpa_weights(*args, **kwargs, out=tr.scratch()), "sdpa")
            else:
                tr.note_event()  # a layer left out by `layers=`: count it, skip the work
            return out
        if func is _MHA_FN:
            # re-enter the mode so the SDPA or softmax inside is seen like any other
            with self:
                return func(*args, **kwargs)
        if (func in _ADD or func in _ADD_INPLACE) and tr.layer is not None:
            return tr.on_add(func, args, kwargs)
        out = func(*args, **kwargs)
        if tr.layer is not None:
            tr.stamp(out)
        return out


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
        self.container_of: dict[int, str] = {}
        for n, m in model.named_modules():
            homogeneous = isinstance(m, nn.Sequential) and len({type(c) for c in m}) == 1
            if isinstance(m, nn.ModuleList) or homogeneous:
                for child in m.children():
                    self.container_of.setdefault(id(child), n)
        self.stack: list[_Call] = []
        self.layer: _Layer | None = None
        self.layer_call: _Call | None = None
        self.records: list[LayerRecord] = []
        self.kept: dict[str, int] = {}
        self.root_calls = 0
        self.impls: set[str] = set()
        self.stored_dtypes: set[str] = set()
        self._stamps = _ByIdentity()  # stream-shaped tensor -> when it was first seen
        self._tags = _ByIdentity()  # sublayer output -> its sublayer (an _Attn or "mlp")
        self._tick = itertools.count()
        self._mode = _Mode(self)
        self._handles: list[Any] = []
        self._suspended = 0
        self._fast_layers: set[int] = set()
        self._replaying = False
        # Streaming to disk: recomputed patterns go into one reused buffer, written out at the
        # end of their sublayer (saves allocating and page-faulting a fresh one every layer).
        self._reuse = not isinstance(sink, MemorySink)
        self._scratch: Tensor | None = None
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
            # break the tracer <-> mode cycle, so a dropped cache is freed at once (by reference
            # counting) instead of at the next full garbage collection
            self._mode.tracer = None

    # -- hooks ---------------------------------------------------------------------------------
    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._replaying:
            return
        self._mode.quiet += 1
        try:
            parent = self.stack[-1] if self.stack else None
            call = _Call(module, parent, _first_tensor(args, kwargs), _tensors(args, kwargs))
            if parent is None:
                self.root_calls += 1
            if self.layer is None and id(module) in self.container_of:
                self._start_layer(call, self.container_of[id(module)])
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
            self.stack.pop()
            if self.layer is not None:
                out = _output_tensor(output)
                self.stamp(out)
                if call.parent is self.layer_call and next(module.children(), None) is not None:
                    self._tag(out, call.attn if call.attn is not None else "mlp")
            if call.attn is not None:
                self._flush_attn(call.attn)
            if call is self.layer_call:
                self._end_layer(call, _output_tensor(output))
        finally:
            self._mode.quiet -= 1

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
            lengths = torch.tensor([t.size(0) for t in x.unbind()])
            x = x.to_padded_tensor(0.0)
            out = out.to_padded_tensor(0.0, x.shape)
            kpm = torch.arange(x.size(1))[None, :] >= lengths[:, None]
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
            lay.stream_shape, lay.fused = x.shape, (s1, out)

    # -- layers --------------------------------------------------------------------------------
    def _start_layer(self, call: _Call, container: str) -> None:
        index = self.kept.get(container, 0)
        wanted = self.layers_wanted is None or index in self.layers_wanted
        layer = _Layer(container=container, index=index, wanted=wanted)
        call.layer = layer
        self.layer, self.layer_call = layer, call
        p = call.primary
        if wanted and p is not None and p.is_nested:
            layer.resid_pre = p  # torch's nested-tensor path: made dense once the layer has run
        elif wanted and p is not None and p.is_floating_point():
            layer.resid_pre = p.detach().clone()
            layer.pre_key = _vkey(p)
            layer.stream_shape = p.shape
            self.stamp(p)

    def _adopt_layer(self) -> None:
        # No list of layers on the stack: the layer is the top-level child computing attention.
        call = self.stack[1] if len(self.stack) > 1 else self.stack[0]
        self._start_layer(call, self.names.get(id(self.model), "") + ":single")

    def _end_layer(self, call: _Call, out: Tensor | None) -> None:
        layer = call.layer
        self.layer, self.layer_call = None, None
        self._stamps.clear()
        self._tags.clear()
        if layer is None or not layer.events:
            return  # a list element with no attention (e.g. an MLP-only block)
        self.kept[layer.container] = layer.index + 1
        if not layer.wanted:
            return
        patterns = [
            (a.role or "self", a.handle, a.shape, sorted(a.impl), a.causal)
            for a in layer.attns
            if a.handle is not None
        ]
        residuals = self._residuals(layer, out)
        self.records.append(
            LayerRecord(
                layer.container,
                layer.index,
                self.names.get(id(call.module), "?"),
                patterns,
                residuals,
            )
        )

    def _residuals(self, layer: _Layer, out: Tensor | None) -> list[tuple[str, int]]:
        if layer.fused is not None:
            out = layer.fused[1]
        if (
            layer.resid_pre is None
            or layer.resid_pre.is_nested
            or out is None
            or out.is_nested
            or out.shape != layer.stream_shape
        ):
            return []
        pre, post = layer.resid_pre, out.detach()
        deltas: dict[str, Tensor] = {}
        adds = layer.adds
        if layer.fused is not None:
            s1 = layer.fused[0]
            deltas["self_attn"], deltas["mlp"] = s1 - pre, post - s1
        elif adds:
            # stream boundaries: before sublayer k+1 the stream is the residual operand of add k+1
            bounds = [pre] + [a.residual for a in adds[1:]] + [post]
            for k, a in enumerate(adds):
                exact = a.exact and (
                    k + 1 == len(adds)
                    and a.result is out
                    or k + 1 < len(adds)
                    and adds[k + 1].residual is a.result
                )
                d = a.other if exact else bounds[k + 1] - bounds[k]
                if a.parts is None:
                    pieces = [(a.kind, d)]
                else:  # a sum of sublayer outputs: each part is its sublayer's delta
                    pieces = list(a.parts)
                    if not exact:  # the stream was normalised after the sum: the rest goes to the last
                        pieces[-1] = (pieces[-1][0], d - sum(p for _, p in pieces[:-1]))
                for kind, piece in pieces:
                    name = "mlp" if kind == "mlp" else f"{kind.role or 'self'}_attn"
                    deltas[name] = deltas[name] + piece if name in deltas else piece
        elif len(layer.attns) == 1:
            deltas[f"{layer.attns[0].role or 'self'}_attn"] = post - pre
        else:
            return []
        items = [("resid_pre", pre)]
        for name in ("self_attn", "cross_attn", "mlp"):
            if name in deltas:
                items.append((f"{name}.delta", deltas[name]))
        items.append(("resid_post", post))
        return [(n, self.sink.put(self._store(t))) for n, t in items]

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

    def _sublayer_call(self) -> _Call:
        lc = self.layer_call
        for i, c in enumerate(self.stack):
            if c is lc:
                return self.stack[i + 1] if i + 1 < len(self.stack) else c
        return self.stack[-1]

    def on_softmax(self, args: tuple, kwargs: dict, out: Tensor) -> None:
        if not isinstance(out, Tensor) or out.dim() < 3:
            return
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if dim is None or dim not in (-1, out.dim() - 1):
            return
        if self.wants_pattern():
            self.on_pattern(out, "softmax")
        else:
            self.note_event()

    def scratch(self) -> Tensor | None:
        """A buffer the next recomputed pattern may be written into, or None."""
        if not self._reuse or self._scratch_busy:
            return None
        return self._scratch

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
            self._scratch, self._scratch_busy = p, True
        a.parts.append((p, p._version))
        a.impl.add(impl)
        self.impls.add(impl)
        layer.pending = a

    def _flush_attn(self, a: _Attn) -> None:
        if not a.parts or a.handle is not None:
            return
        for p, v in a.parts:
            if p._version != v:
                raise RuntimeError(
                    "an attention pattern was modified in place after softmax; "
                    "probe cannot capture it exactly"
                )
        parts = [p if p.dim() >= 4 else p.unsqueeze(-3) for p, _ in a.parts]
        pattern = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-3)
        if pattern.dim() > 4:
            pattern = pattern.flatten(1, -4)
        if self.heads is not None:
            pattern = pattern[:, self.heads]
        q, k = pattern.shape[-2], pattern.shape[-1]
        cross = q != k
        if not cross and a.primary is not None and not a.primary.is_nested and a.primary.dim() == 3:
            p0 = a.primary
            for t in a.inputs:
                if (
                    t is not p0
                    and not t.is_nested
                    and t.dim() == 3
                    and t.is_floating_point()
                    and t.shape[0] == p0.shape[0]
                    and t.shape[-1] == p0.shape[-1]
                    and t.data_ptr() != p0.data_ptr()
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
        a.handle = self.sink.put(self._store(pattern))
        if any(p is self._scratch for p, _ in a.parts):
            self._scratch_busy = False
        a.parts.clear()

    # -- residual adds -------------------------------------------------------------------------
    def stamp(self, t: Any) -> None:
        """Note when a stream-shaped tensor was first seen (older operand = the residual)."""
        layer = self.layer
        if (
            isinstance(t, Tensor)
            and layer is not None
            and layer.stream_shape is not None
            and not t.is_nested
            and t.shape == layer.stream_shape
        ):
            if self._stamps.get(t) is None:
                self._stamps.put(t, next(self._tick))

    def _tag(self, t: Any, kind: Any) -> None:
        """Remember that ``t`` is the output of a sublayer (attention or MLP module) of the layer."""
        layer = self.layer
        if (
            isinstance(t, Tensor)
            and not t.is_nested
            and layer is not None
            and layer.stream_shape is not None
            and t.shape == layer.stream_shape
        ):
            if self._tags.get(t) is None:  # identity modules pass a tensor on: first tag wins
                self._tags.put(t, kind)

    def _parts(self, t: Tensor) -> list[tuple[Any, Tensor]] | None:
        combo = self.layer.combos.get(t) if self.layer is not None else None
        if combo is not None:
            return combo
        kind = self._tags.get(t)
        return [(kind, t)] if kind is not None else None

    def _age(self, t: Tensor) -> float:
        tick = self._stamps.get(t)
        return tick if tick is not None else float("inf")

    def on_add(self, func: Any, args: tuple, kwargs: dict) -> Any:
        layer = self.layer
        a = args[0] if args else kwargs.get("input")
        b = args[1] if len(args) > 1 else kwargs.get("other")
        shape = layer.stream_shape
        if (
            shape is None
            or not isinstance(a, Tensor)
            or not isinstance(b, Tensor)
            or a.is_nested
            or b.is_nested
            or a.shape != shape
            or b.shape != shape
            or kwargs.get("alpha", 1) != 1
        ):
            out = func(*args, **kwargs)
            self.stamp(out)
            return out
        inplace = func in _ADD_INPLACE
        pa, pb = self._parts(a), self._parts(b)
        if pa is not None and pb is not None and not inplace:
            # two sublayers' outputs summed before they meet the stream (parallel attention and
            # MLP, as in GPT-J and GPT-NeoX): not a residual add; the next one carries both parts
            out = func(*args, **kwargs)
            layer.combos.put(out, pa + pb)
            return out
        if self._age(b) < self._age(a):
            residual, other = b, a
        else:
            residual, other = a, b
        # an in-place add overwrites its first operand: keep the stream value it had
        res_value = a.clone() if inplace and residual is a else residual
        prev = layer.adds[-1].result if layer.adds else None
        follows = (prev is residual) if prev is not None else (_vkey(residual) == layer.pre_key)
        out = func(*args, **kwargs)
        self.stamp(out)
        kind: Any = layer.pending if layer.pending is not None else "mlp"
        layer.pending = None
        parts = self._parts(other)
        add = _Add(kind, res_value, other, out, exact=follows and not inplace)
        if parts is not None and len(parts) > 1:
            add.parts = parts
        layer.adds.append(add)
        return out

    # -- storage -------------------------------------------------------------------------------
    def _store(self, t: Tensor) -> Tensor:
        t = t.detach()
        if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
            t = t.to(self.dtype)
        self.stored_dtypes.add(str(t.dtype).replace("torch.", ""))
        return t
