"""Watching the forward: module hooks keep a call stack, a ``TorchFunctionMode`` sees the ops.

The :class:`Watcher` installs a pre- and a post-hook on every module and keeps the stack of
module calls running (:class:`~probe.capture.calls.Call`), telling the
:class:`~probe.capture.hooks.layers.LayerTracker` about each call that starts and each layer that
returns, and the :class:`~probe.capture.hooks.record.Recorder` about each sublayer that returns.

The mode's ``__torch_function__`` runs for every torch call while a capture is on, so it stays
lean: softmaxes, ``F.scaled_dot_product_attention`` and ``flex_attention`` go to the recorder;
a direct ``F.multi_head_attention_forward`` call runs with the mode off and its per-head weights
recomputed after it (:mod:`probe.capture.layouts.fused`); inside a layer every other op goes to the layer's
:class:`~probe.capture.hooks.residual.LayerStream`; everything else runs untouched.

``nn.MultiheadAttention`` and torch's encoder layers, whose fast paths switch off under any
torch-function mode, run with the mode suspended; their weights are recomputed after the call
(:mod:`probe.capture.layouts.fused`). ``nn.TransformerEncoderLayer`` also leaves its fast path when a
hook sits on it or inside it, so those subtrees get no per-module hooks: a global hook pair,
filtered to these layers, sees their calls instead.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from probe.capture.calls import (
    Call,
    Forward,
    first_tensor,
    layer_cache_length,
    output_tensor,
    positional_inputs,
    tensors,
)
from probe.capture.hooks.layers import LayerTracker
from probe.capture.hooks.record import FLEX, SDPA, SOFTMAX, Recorder
from probe.capture.hooks.residual import ADD, ADD_INPLACE
from probe.capture.layouts import OPS as LAYOUT_OPS
from probe.capture.layouts.fused import mha_function_weights, replay_encoder_layer

_ADDS = ADD | ADD_INPLACE
_MHA_FN = F.multi_head_attention_forward
# torch modules whose fast paths are disabled by any active torch-function mode
_SUSPEND = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)
# the ops the mode hands to the recorder (or re-enters for); everything else goes to the residual tracking
_SEEN = frozenset(SOFTMAX | {SDPA, _MHA_FN} | ({FLEX} if FLEX is not None else set()))


class _Mode(TorchFunctionMode):
    """Routes the ops of a running forward (see the module docstring).

    It refers to the stack, the layer tracker and the recorder, never back to the watcher that
    holds it (a cycle would keep the model's tensors alive until a garbage collection). The ops
    it hands on are module-level sets, not a table on the mode: ``torch.compile`` (which
    ``flex_attention`` runs under) traces this method, and cannot hash keys it reaches there.
    """

    def __init__(self, stack: list[Call], layers: LayerTracker, recorder: Recorder) -> None:
        super().__init__()
        self.stack = stack
        self.layers = layers
        self.recorder = recorder
        self.quiet = 0  # > 0 while probe's own hooks run: their tensor calls pass straight through

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.quiet or not self.stack:
            return func(*args, **kwargs)
        if self.recorder.flex_calls and not torch.compiler.is_compiling():
            self.recorder.flush()  # flex_attention calls torch.compile traced, now run
        if func in LAYOUT_OPS and self.recorder.reads_op(func):
            return self.recorder.layout_op(func, args, kwargs)  # Reformer's exp(x - logsumexp(x))
        if func not in _SEEN:
            # every other op: only the residual tracking of the layer running now looks at it
            layers = self.layers
            lay = layers.layer
            if lay is None:
                out = func(*args, **kwargs)
                layers.upstream.between(args, kwargs, out)  # what is computed from the last layer's output
                return out
            if lay.stream is None:
                return func(*args, **kwargs)
            if func in _ADDS:
                return lay.stream.on_add(func, args, kwargs, layers.source_id)
            out = func(*args, **kwargs)
            if (
                isinstance(out, Tensor)
                or isinstance(out, (tuple, list))
                and not isinstance(out, torch.Size)
                or func is Tensor.__setitem__
            ):  # sizes, flags and numbers carry no label: skip the bookkeeping
                lay.stream.after_op(func, args, kwargs, out, layers.source_id)
            return out
        if func in SOFTMAX:
            return self.recorder.softmax(func, args, kwargs)
        if func is SDPA:
            return self.recorder.sdpa(func, args, kwargs)
        if func is _MHA_FN:
            # called directly, not by an nn.MultiheadAttention (WavLM): the mode is off inside (re-
            # entering it would dispatch the call to itself again), its weights recomputed after
            out = func(*args, **kwargs)
            with torch.no_grad():
                w = mha_function_weights(func, args, kwargs)
            if w is not None:
                self.recorder.pattern(w, "mha")
            self.layers.after_op(func, args, kwargs, out)
            return out
        return self.recorder.flex(func, args, kwargs)  # in _SEEN only where torch has it


class Watcher:
    """Hooks ``model`` for one capture; :meth:`install` before the forward, :meth:`remove` after."""

    def __init__(
        self, model: nn.Module, stack: list[Call], layers: LayerTracker, recorder: Recorder, forward: Forward
    ) -> None:
        self.model = model
        self.stack = stack
        self.layers = layers
        self.recorder = recorder
        self.forward = forward
        self._mode = _Mode(stack, layers, recorder)
        self._handles: list[Any] = []
        self._suspended = 0
        self._fast_layers: set[int] = set()
        self._replaying = False
        self._thread = threading.get_ident()  # hooks see every thread's calls: follow this one's

    # -- lifecycle -----------------------------------------------------------------------------
    def install(self) -> None:
        """Hook every module and push the mode."""
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
        if self._fast_layers:  # global hooks live outside the per-module dicts
            module_hooks = nn.modules.module
            self._handles.append(module_hooks.register_module_forward_pre_hook(self._global_pre))
            self._handles.append(
                module_hooks.register_module_forward_hook(
                    self._global_post, with_kwargs=True, always_call=True
                )
            )
        self._mode.__enter__()

    def remove(self, *exc: Any) -> None:
        """Pop the mode and remove every hook (also after an error in the forward)."""
        try:
            if self._suspended:
                torch._C._push_on_torch_function_stack(self._mode)
                self._suspended = 0
            self._mode.__exit__(*exc)
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self.layers.layer = self.layers.layer_call = None
            self.stack.clear()

    def _global_pre(self, module: nn.Module, args: tuple) -> None:
        if id(module) in self._fast_layers:
            self._pre(module, args, {})

    def _global_post(self, module: nn.Module, args: tuple, *rest: Any) -> None:
        if id(module) in self._fast_layers:
            self._post(module, args, *rest)  # (kwargs, output); only (output) when forward raised

    # -- hooks ---------------------------------------------------------------------------------
    # Both hooks take the kwargs as optional: torch registers a hook in one dictionary and its
    # with-kwargs flag in a second one, so a forward running in another thread between the two
    # writes calls it without them (such a call is another thread's: ignored); a global forward
    # hook gets only the output when the forward raised.
    def _pre(self, module: nn.Module, args: tuple, *rest: Any) -> None:
        if self._replaying or threading.get_ident() != self._thread:
            return
        kwargs = rest[0] if rest else {}
        # probe's own bookkeeping below calls tensor methods: off the mode stack, they cost a
        # C call each instead of a trip through the mode's Python __torch_function__
        self._mode.quiet += 1
        self._suspend()
        try:
            parent = self.stack[-1] if self.stack else None
            inputs = tensors(args, kwargs)
            call = Call(module, parent, first_tensor(args, kwargs), inputs)
            call.positional = positional_inputs(kwargs) if kwargs else []
            if kwargs and parent is not None:
                call.kv_prefix = layer_cache_length(module, kwargs)
            if parent is None:
                self.forward.note_root(inputs, kwargs)
            self.layers.enter(call)
            self.stack.append(call)
            if isinstance(module, _SUSPEND):
                call.suspended = True
                self._suspend()
        finally:
            self._resume()
            self._mode.quiet -= 1

    def _post(self, module: nn.Module, args: tuple, *rest: Any) -> None:
        if self._replaying or threading.get_ident() != self._thread:
            return
        kwargs, output = rest if len(rest) == 2 else ({}, rest[-1])
        self._mode.quiet += 1
        self._suspend()
        try:
            if not self.stack or self.stack[-1].module is not module:
                return  # a call that began before capture started
            call = self.stack[-1]
            if self.recorder.flex_calls or self.recorder.flex_done:  # flex_attention ran inside this call
                self.recorder.flush()
            if call.suspended:
                self._resume()
                self._fused_returned(call, args, kwargs, output)
            self.stack.pop()
            if call.attn is not None:
                self.recorder.close(call.attn)
            if call is self.layers.layer_call:
                self.layers.end(call, output_tensor(output))
        finally:
            self._resume()
            self._mode.quiet -= 1

    def _fused_returned(self, call: Call, args: tuple, kwargs: dict, output: Any) -> None:
        """A module that ran with the mode suspended returned: recompute what it hid."""
        module = call.module
        if isinstance(module, nn.MultiheadAttention) and call.events == 0:
            self.recorder.mha_module(module, args, kwargs)
        elif isinstance(module, nn.TransformerEncoderLayer) and call.events == 0:
            self._replaying = True  # the layer's own modules run again: not part of the capture
            try:
                replay = replay_encoder_layer(module, args, kwargs, output)
            finally:
                self._replaying = False
            self.recorder.pattern(replay.weights, "mha")
            self.layers.fused(replay.x, replay.after_attn, replay.out)
        # computed with the mode off: label the output as this sublayer's
        self.layers.mark_output(call, output)

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
