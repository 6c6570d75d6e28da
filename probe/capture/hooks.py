"""Watching the forward: module hooks keep a call stack, a ``TorchFunctionMode`` sees the ops.

The mode's ``__torch_function__`` runs for every torch call while a capture is on, so it stays
lean: softmaxes, ``F.scaled_dot_product_attention`` and ``F.multi_head_attention_forward`` are
handed to the tracer (:mod:`probe.capture.record`); inside a layer every other op goes to the
layer's :class:`~probe.capture.residual.LayerStream`; everything else runs untouched.
``nn.MultiheadAttention`` and torch's encoder layers, whose fast paths switch off under any
torch-function mode, run with the mode suspended; their weights are recomputed after the call.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from probe.capture.inputs import past_length
from probe.capture.layers import _Call, _is_source
from probe.capture.patterns import mha_weights, sdpa_weights
from probe.capture.residual import ADD, ADD_INPLACE

if TYPE_CHECKING:
    from probe.capture.tracer import Tracer

try:  # the higher-order op flex_attention runs; its scores never exist outside the kernel
    from torch._higher_order_ops.flex_attention import flex_attention as _FLEX
except ImportError:  # pragma: no cover - older torch
    _FLEX = None

_SOFTMAX = {F.softmax, torch.softmax, Tensor.softmax, torch.special.softmax}
_SDPA = F.scaled_dot_product_attention
_MHA_FN = F.multi_head_attention_forward
_ADDS = ADD | ADD_INPLACE
# the ops the mode handles itself; everything else goes to the residual tracking only
_SEEN = frozenset(_SOFTMAX | {_SDPA, _MHA_FN} | ({_FLEX} if _FLEX is not None else set()))
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


def _cached_length(past: Any) -> int:
    """:func:`~probe.capture.inputs.past_length` of a forward's ``past_key_values``; 0 when there is
    none or its layout is unknown (then only the inputs' lengths apply)."""
    if past is None:
        return 0
    try:
        return past_length(past)
    except Exception:
        return 0


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
        if func not in _SEEN:
            # every other op: only the residual tracking of the layer running now looks at it
            lay = tr.layer
            if lay is None or lay.stream is None:
                return func(*args, **kwargs)
            if func in _ADDS:
                return lay.stream.on_add(func, args, kwargs, tr.source_id())
            out = func(*args, **kwargs)
            if (
                isinstance(out, Tensor)
                or isinstance(out, (tuple, list))
                and not isinstance(out, torch.Size)
                or func is Tensor.__setitem__
            ):  # sizes, flags and numbers carry no label: skip the bookkeeping
                lay.stream.after_op(func, args, kwargs, out, tr.source_id())
            return out
        if func in _SOFTMAX:
            out = func(*args, **kwargs)
            tr.on_softmax(args, kwargs, out)
            tr.after_op(func, args, kwargs, out)
            return out
        if func is _SDPA:
            out = func(*args, **kwargs)
            if tr.wants_pattern():
                buf, clean = tr.scratch()
                w = sdpa_weights(*args, **kwargs, out=buf, clean=clean, empty=tr.sink.empty, dtype=tr.dtype)
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
        # flex_attention (in _SEEN only where torch has it): runs while torch.compile traces it;
        # only recorded (dynamo replays appends)
        tr.blind.append("flex_attention")
        return func(*args, **kwargs)


class _Hooks:
    """The :class:`~probe.capture.tracer.Tracer`'s hooks: installing them, module entries and exits,
    suspending the mode around torch's fused modules and recomputing their weights."""

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
        # probe's own bookkeeping below calls tensor methods: off the mode stack, they cost a
        # C call each instead of a trip through the mode's Python __torch_function__
        self._mode.quiet += 1
        self._suspend()
        try:
            parent = self.stack[-1] if self.stack else None
            inputs = _tensors(args, kwargs)
            call = _Call(module, parent, _first_tensor(args, kwargs), inputs)
            if parent is None:
                self.root_calls += 1
                self.lengths |= _lengths(inputs)
                cached = _cached_length(kwargs.get("past_key_values"))
                if cached:  # keys of a KV-cached call: the cached positions plus the new ones
                    self.cached = cached
                    self.lengths |= {cached + n for n in self.lengths}
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
            self._resume()
            self._mode.quiet -= 1

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._replaying:
            return
        self._mode.quiet += 1
        self._suspend()
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
            self._resume()
            self._mode.quiet -= 1

    def _n_params(self, module: nn.Module) -> int:
        n = self._param_counts.get(id(module))
        if n is None:
            n = self._param_counts[id(module)] = sum(p.numel() for p in module.parameters())
        return n

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
