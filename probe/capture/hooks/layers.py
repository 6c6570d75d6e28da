"""Tracking layers and their residual stream: which call is a layer, its sublayers, its residuals.

A layer starts when an element of an ``nn.ModuleList`` (or a one-type ``nn.Sequential``) is
entered, or is adopted when attention is seen outside any list; it ends when that call returns.
Its index is its index in that list, so ``blocks.3`` is ``list[3]`` also when some elements
compute no attention (hybrids); those keep ``resid_pre``/``resid_post`` only. Its sublayers are
the child calls that carry weights (attention, MLP, experts, a projection; not a norm). Inside a
layer every op the watcher sees goes to the layer's :class:`~probe.capture.hooks.residual.LayerStream`,
which follows the data flow; at the end the stream is split into ``resid_pre``, one delta per
sublayer kind and ``resid_post`` (:mod:`probe.capture.hooks.deltas`), handed to the
:class:`~probe.capture.hooks.store.Store`, and one :class:`LayerRecord` is kept for the engine to name.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn

from probe.cache.selection import Selection
from probe.capture.calls import Call, Forward, Layer, LayerRecord, fields_of, output_tensor
from probe.capture.hooks.deltas import channels_last, layer_residuals
from probe.capture.hooks.parallel import Group, list_elements, parallel_lists
from probe.capture.hooks.pooling import pooling_heads
from probe.capture.hooks.residual import LayerStream
from probe.capture.hooks.store import Store
from probe.errors import ProbeError


def _dead() -> None:
    return None


def _same(x: Tensor | None, y: Tensor | None) -> bool:
    """Whether ``x`` holds exactly the values of ``y`` (the same tensor, or an equal one)."""
    if x is None or y is None:
        return False
    if x is y:
        return True
    if x.is_nested or y.is_nested or x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
        return False
    return bool(torch.equal(x, y))


def _is_source(module: nn.Module) -> bool:
    """Whether a child of a layer is a sublayer (attention, MLP, experts, a projection), not a norm."""
    if next(module.children(), None) is not None:
        return True
    return any(p.dim() >= 2 for p in module.parameters(recurse=False))


class LayerTracker:
    """Layers and sublayers of one capture of ``model``, read off the watcher's call ``stack``.

    ``layer``/``layer_call`` are the layer running now (None between layers); ``records`` the
    captured layers with attention; ``kept`` each list with attention -> its number of elements.
    """

    def __init__(
        self, model: nn.Module, stack: list[Call], selection: Selection, store: Store, forward: Forward
    ) -> None:
        self.model = model
        self.stack = stack  # the watcher's: read here, never written
        self.selection = selection
        self.store = store
        self.forward = forward
        self.names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        # list element -> (the list's name, its index there), list -> length, and the children of
        # elements whose forward the model may call directly (see probe.capture.hooks.parallel)
        self.container_of, self.container_len, self.element_of = list_elements(model)
        self.group_of = parallel_lists(model)
        for k in self.group_of:  # grouped by index: no element of them is a layer of its own
            self.container_of.pop(k, None)
        self.pool_notes: dict[str, str] = {}  # attention pooling heads: one-layer lists of their own
        for mid, (name, note) in pooling_heads(model).items():
            if mid not in self.container_of:
                self.container_of[mid], self.container_len[name], self.pool_notes[name] = (name, 0), 1, note
        self.layer: Layer | None = None
        self.layer_call: Call | None = None
        self.records: list[LayerRecord] = []
        # list elements without attention: (list, index, module, resid_pre, resid_post, call, skipped)
        self.plain: list[tuple[str, int, str, Tensor, Tensor, int, str]] = []
        self.kept: dict[str, int] = {}
        self._sources: dict[type, bool] = {}
        self._param_counts: dict[int, int] = {}
        # layers as the model runs them: calls per list and per module, lists that run a module
        # more than once (numbered by call), and lists whose every layer's input is the previous
        # one's output (the chain ``resid_post[l] == resid_pre[l + 1]``)
        self.list_calls: dict[str, int] = {}
        self.module_calls: dict[int, int] = {}
        self.looped: set[str] = set()
        self.chain: dict[str, bool] = {}
        self.order: list[str] = []  # the lists in the order their first layer ran
        self._prev: tuple[str, int, Tensor | None] | None = None  # the last layer's list, index, output
        self._derived: dict[int, weakref.ref] = {}  # computed from its output outside any layer
        self._learned: set[int] = set()  # those of them computed through a learned weight

    def name_of(self, module: nn.Module) -> str:
        return self.names.get(id(module), "?")

    # -- calls entering ------------------------------------------------------------------------
    def enter(self, call: Call) -> None:
        """A module call starts (not yet on the stack): a layer, a sublayer, or neither."""
        module, parent = call.module, call.parent
        if self.layer is not None and self.layer.direct and id(module) in self.container_of:
            self.end(self.layer_call, call.primary)  # a list element run with its hooks after all
        if self.group_of and id(module) in self.group_of:
            self._group_element(call, *self.group_of[id(module)])
        elif id(module) in self.element_of and parent is not None:
            self._unhooked_element(call, *self.element_of[id(module)])
        if self.layer is None and id(module) in self.container_of:
            self._start(call, *self.container_of[id(module)])
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

    def _n_params(self, module: nn.Module) -> int:
        n = self._param_counts.get(id(module))
        if n is None:
            n = self._param_counts[id(module)] = sum(p.numel() for p in module.parameters())
        return n

    def _group_element(self, call: Call, group: Group, _list: int, index: int) -> None:
        """Element ``index`` of a group's list starts: it opens layer ``index`` (its parent's call
        runs it), closing the layer of another index still open."""
        lay = self.layer
        if lay is not None and lay.group is group and lay.index != index:
            self.end(self.layer_call, call.primary)
        if self.layer is None and call.parent is not None:
            self._start(call.parent, group.name, index, entry=call)
            self.layer.group = group
            self.layer.module = ", ".join(f"{p}.{index}" for p in group.paths)

    def _unhooked_element(self, call: Call, element: nn.Module, container: str, index: int) -> None:
        """A child of element ``index`` of ``container`` starts while the element itself is not
        running as a module call (its ``forward`` was called directly, so no hook saw it): the
        child opens layer ``index``, run by its parent's call, closing the previous element's."""
        if any(c.module is element for c in self.stack):
            return  # the element runs as a call of its own: an ordinary layer
        lay = self.layer
        if lay is not None and lay.container == container and lay.index != index and lay.direct:
            lay.last_out = call.primary
            self.end(self.layer_call, call.primary)
        if self.layer is None:
            self._start(call.parent, container, index, entry=call)
            self.layer.direct = True
            self.layer.module = self.name_of(element)

    def _start(self, call: Call, container: str, index: int, entry: Call | None = None) -> None:
        """Layer ``index`` of ``container`` is the call ``call`` (entered with ``entry``, the first
        element of a group layer whose parent's call is ``call``; on the stack already)."""
        entry = entry or call
        index, upstream = self._as_run(entry, container, index)
        wanted = self.selection.wants_layer(index)
        depth = len(self.stack) if entry is call else self.stack.index(call)
        layer = Layer(container=container, index=index, wanted=wanted, depth=depth)
        layer.call = self.module_calls[id(entry.module)] - 1
        layer.upstream = upstream
        layer.blind = len(self.forward.blind)
        layer.calls[id(call)] = call
        call.layer = layer
        self.layer, self.layer_call = layer, call
        p = entry.primary
        if wanted and p is not None and p.is_nested:
            layer.resid_pre = p  # torch's nested-tensor path: made dense once the layer has run
        elif wanted and p is not None and p.is_floating_point() and p.dim() > 0:
            layer.stream = LayerStream(p)
            layer.resid_pre = layer.stream.pre
            if p.dim() >= 2:
                self.forward.lengths.update(p.shape[:-1])

    def _as_run(self, call: Call, container: str, index: int) -> tuple[int, Tensor | None]:
        """The layer's index as the model runs it, and its upstream sequence (see :class:`Layer`).

        A list that runs one of its modules a second time (ALBERT's shared layer, a loop) is
        numbered by call from then on; the chain of a list holds while each layer's input is the
        previous layer's output."""
        n = self.module_calls.get(id(call.module), 0)
        self.module_calls[id(call.module)] = n + 1
        k = self.list_calls.get(container, 0)
        self.list_calls[container] = k + 1
        if n:
            self.looped.add(container)
        if container in self.looped:
            index = k
        p, prev = call.primary, self._prev
        out = prev[2] if prev is not None else None
        if container not in self.chain:
            self.chain[container] = True
            self.order.append(container)
        elif not (prev is not None and prev[:2] == (container, index - 1) and _same(p, out)):
            self.chain[container] = False
        upstream = None
        if out is not None and p is not None:
            pooled = self._derived.get(id(p), _dead)() is p and id(p) not in self._learned
            if p is out or pooled:
                upstream = out
        self._derived, self._learned = {}, set()
        return index, upstream

    def between(self, args: tuple, kwargs: dict, out: Any) -> None:
        """An op ran outside any layer: note what it computed from the last layer's output, and
        whether through a learned weight matrix (BLT projects byte states into patch queries: a new
        sequence, not the same one pooled as Funnel's)."""
        src = self._prev[2] if self._prev is not None else None
        if src is None:
            return
        d = self._derived  # id -> weak reference: nothing here outlives the model's own use
        flat = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (tuple, list)) else (a,))]
        found = [t for t in flat if isinstance(t, Tensor) and (t is src or d.get(id(t), _dead)() is t)]
        if not found:
            return
        learned = any(isinstance(t, nn.Parameter) and t.dim() >= 2 for t in flat) or any(
            id(t) in self._learned for t in found
        )
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor):
                d[id(t)] = weakref.ref(t)
                (self._learned.add if learned else self._learned.discard)(id(t))

    def forget(self) -> None:
        """The forward is over: drop the last layer's output and what was computed from it."""
        self._prev, self._derived, self._learned = None, {}, set()

    def current(self) -> Layer:
        """The layer running now; attention outside any list adopts the top-level child computing it."""
        if self.layer is None:
            self._adopt()
        return self.layer

    def _adopt(self) -> None:
        call = self.stack[1] if len(self.stack) > 1 else self.stack[0]
        depth = self.stack.index(call)
        container = self.names.get(id(self.model), "") + ":single"
        self._start(call, container, 0)
        # its next calls (a block run in a loop) start layers when they are entered
        self.container_of.setdefault(id(call.module), (container, 0))
        self.container_len.setdefault(self.layer.container, 1)
        self.layer.depth = depth
        self.layer.resid_pre = self.layer.stream = None  # adopted mid-call: its input was not watched
        p = call.primary
        if p is not None and not p.is_nested and p.is_floating_point() and p.dim() > 0:
            self.layer.stream = LayerStream(p)
            self.layer.resid_pre = self.layer.stream.pre

    # -- inside a layer ------------------------------------------------------------------------
    def source_id(self) -> int | None:
        """The sublayer (child call of the layer) running now, as a key into the layer's calls."""
        lay = self.layer
        if lay is None:
            return None
        for c in self.stack[lay.depth + 1 :]:
            if not c.wrapper:
                return id(c) if c.source else None
        return id(self.layer_call)  # computed in the layer's own forward

    def sublayer_call(self) -> Call:
        """The call attention seen now belongs to: the layer's child running now (past wrappers)."""
        lc = self.layer_call
        for i, c in enumerate(self.stack):
            if c is lc:
                for sub in self.stack[i + 1 :]:
                    if not sub.wrapper:
                        return sub
                return self.stack[-1]
        return self.stack[-1]

    def after_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Label what an op the recorder handled (a softmax, SDPA) produced in the layer's stream."""
        lay = self.layer
        if lay is not None and lay.stream is not None:
            lay.stream.after_op(func, args, kwargs, out, self.source_id())

    def mark_output(self, call: Call, output: Any) -> None:
        """Label ``output``, what a sublayer computed with the watcher's mode off, as its output."""
        lay = self.layer
        src = self.source_id()
        if lay is not None and lay.stream is not None and src is not None:
            stream = any(lay.stream.label(t)[0] for t in call.inputs)
            lay.stream.mark(output_tensor(output), stream, src)

    def fused(self, x: Tensor, after_attn: Tensor, out: Tensor) -> None:
        """The layer ran as one fused kernel: its input ``x`` and the stream after its attention
        and at its output, as replayed (:mod:`probe.capture.layouts.fused`)."""
        lay = self.layer
        if lay is not None and lay.wanted:
            if lay.resid_pre is None or lay.resid_pre.is_nested:  # the padded form of a nested input
                lay.resid_pre = x.detach().clone()
            lay.fused = (after_attn, out)

    # -- layers ending -------------------------------------------------------------------------
    def end(self, call: Call, out: Tensor | None) -> None:
        """The layer call ``call`` returned ``out``: record it and let its tensors go."""
        layer = call.layer
        self.layer, self.layer_call = None, None
        if layer is None:
            return
        if layer.direct:  # its output is known only as the next element's input (None for the last)
            out, layer.last_out = layer.last_out, None
        self._prev = (layer.container, layer.index, out)
        last = layer.index + 1 >= self.container_len.get(layer.container, 0)
        if last:
            # the list's last layer: what runs next computes no pattern
            self.store.let_go()
        try:
            self._close(layer, call, out)
        finally:
            # Layer.calls -> Call.layer -> Layer is a cycle: left alone, it keeps the layer's
            # stream tensors (inputs, residual adds) alive until a garbage collection, so a
            # streamed capture would hold every layer's residuals to the end
            call.layer = None
            layer.calls.clear()
            layer.attns.clear()
            layer.stream = layer.fused = layer.resid_pre = None
        if last:
            self.store.trim()

    def _close(self, layer: Layer, call: Call, out: Tensor | None) -> None:
        if len(self.forward.blind) > layer.blind:
            raise ProbeError(
                f"layer {self.name_of(call.module)} computes attention with {self.forward.blind[-1]}, "
                'which probe cannot look into; load the model with attn_implementation="sdpa" (or '
                '"eager") to capture it'
            )
        if not layer.events:
            # a list element with no attention (a Mamba or MLP-only block of a hybrid): its
            # stream is kept, named once the lists with attention are known
            if layer.wanted and layer.resid_pre is not None and not layer.resid_pre.is_nested:
                if out is not None and not out.is_nested and out.shape == layer.resid_pre.shape:
                    name = layer.module or self.name_of(call.module)
                    skipped = "; ".join(sorted(layer.skipped))
                    self.plain.append(
                        (
                            layer.container,
                            layer.index,
                            name,
                            layer.resid_pre,
                            out.detach(),
                            layer.call,
                            skipped,
                        )
                    )
            return
        c = layer.container
        self.kept[c] = self.list_calls[c] if c in self.looped else self.container_len.get(c, layer.index + 1)
        if not layer.wanted:
            return
        stored = [x for a in layer.attns for x in (a, *a.also) if x.handle is not None or x.fields]
        patterns = [(a.role or "self", fields_of(a), a.shape, sorted(a.impl), a.causal) for a in stored]
        kinds = [a.kind for a in stored]
        items, notes = layer_residuals(layer, call, out, self.name_of)
        if layer.direct:
            q = next((a.qk[0] for a in layer.attns if a.role != "cross"), None)
            items = channels_last(items, q, notes)
            if out is None:
                notes["residual_note"] = (
                    "the model calls this list element's forward directly (no module hook sees it): "
                    "its output is known only as the next element's input, and this is the last one"
                )
        if any(a.split is not None for a in layer.attns):
            first = any(a.source_first for a in layer.attns)
            order = (
                "the source's keys then the layer's own"
                if first
                else "the layer's own keys then the source's"
            )
            notes["merged_attention"] = (
                f"self_attn and cross_attn are one softmax over {order} keys: each query's two rows "
                "together sum to 1"
            )
        residuals = [(n, self.store.put(t)) for n, t in items]
        module = layer.module or self.name_of(call.module)
        if layer.skipped:
            notes["not_attention"] = "; ".join(sorted(layer.skipped))
        if c in self.pool_notes:
            notes["pooling"] = self.pool_notes[c]
        for role in ("self", "cross"):
            n = len({a.module for a in stored if a.role == role})  # sublayers, not softmaxes
            defs = notes.get("deltas", {})
            if n > 1 and f"{role}_attn" in defs:  # LongCat-Flash: one delta for its two attentions
                defs[f"{role}_attn"] += f" (the sum of the layer's {n} {role}-attention sublayers' outputs)"
        modules = [a.module for a in stored]
        record = LayerRecord(c, layer.index, module, patterns, residuals, notes, kinds, layer.call, modules)
        self.records.append(record)

    def plain_records(self) -> list[LayerRecord]:
        """Records of list elements without attention in lists that have attention (hybrids)."""
        out = []
        for container, index, name, pre, post, n, skipped in self.plain:
            if container not in self.kept:
                continue
            handles = [("resid_pre", self.store.put(pre)), ("resid_post", self.store.put(post))]
            note = "no attention in this layer: only resid_pre and resid_post are stored"
            notes = {"residual_note": note} | ({"not_attention": skipped} if skipped else {})
            out.append(LayerRecord(container, index, name, [], handles, notes, n))
        self.plain.clear()
        return out
