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
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from probe.cache.selection import Selection
from probe.capture.calls import Attention, Call, Forward, LayerRecord, output_tensor
from probe.capture.hooks.parallel import Group, list_elements, parallel_lists
from probe.capture.hooks.pooling import pooling_heads
from probe.capture.hooks.records import LayerRecords
from probe.capture.hooks.residual import LayerStream
from probe.capture.hooks.store import Store


@dataclass
class Layer:
    """One layer call being captured."""

    container: str
    index: int
    wanted: bool
    depth: int = 0  # position of the layer's call on the stack
    resid_pre: Tensor | None = None
    stream: LayerStream | None = None
    attns: list[Attention] = field(default_factory=list)
    events: int = 0
    blind: int = 0  # attention calls seen before this layer that probe cannot look into
    fused: tuple[Tensor, Tensor] | None = None  # (stream after attention, output) of a fused layer
    calls: dict[int, Call] = field(default_factory=dict)  # sublayer id -> its Call
    # the previous layer's output when this layer's input was computed from it outside any layer
    # (Funnel pools its queries from it and attends over it: its keys are this layer's own sequence)
    upstream: Tensor | None = None
    call: int = 0  # which call of its module this is (a module run several times in one forward)
    group: Group | None = None  # parallel per-sublayer lists: this layer is element ``index`` of each
    module: str | None = None  # the module path the metadata names (default: the layer call's)
    direct: bool = False  # a list element whose forward was called directly (started by a child)
    last_out: Tensor | None = None  # a direct layer's output: the next element's input
    skipped: set[str] = field(default_factory=set)  # softmaxes seen that are not attention, described


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


def count_parameters(module: nn.Module) -> int:
    """``sum(p.numel() for p in module.parameters())`` (each module and parameter once, by
    identity), walked with one loop instead of ``parameters()``' nested generators: a capture
    asks it of every sublayer of every layer."""
    seen_modules: set[int] = set()
    seen: set[int] = set()
    todo = [module]
    n = 0
    while todo:
        m = todo.pop()
        if id(m) in seen_modules:
            continue
        seen_modules.add(id(m))
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        todo.extend(c for c in m._modules.values() if c is not None)
    return n


def _is_source(module: nn.Module) -> bool:
    """Whether a child of a layer is a sublayer (attention, MLP, experts, a projection), not a norm."""
    if any(c is not None for c in module._modules.values()):
        return True
    return any(p is not None and p.dim() >= 2 for p in module._parameters.values())


class Upstream:
    """The last layer's output and what the model computed from it outside any layer since: a
    layer's input that is that output (or pooled from it) makes that output the layer's upstream
    sequence (see :class:`Layer`), and a layer whose input equals it keeps its list's chain."""

    def __init__(self) -> None:
        self.prev: tuple[str, int, Tensor | None] | None = None  # the last layer's list, index, output
        self.derived: dict[int, weakref.ref] = {}  # computed from its output outside any layer
        self.learned: set[int] = set()  # those of them computed through a learned weight

    def ended(self, container: str, index: int, out: Tensor | None) -> None:
        """Layer ``index`` of ``container`` returned ``out``."""
        self.prev = (container, index, out)

    def follows(self, container: str, index: int, p: Tensor | None) -> bool:
        """Whether layer ``index`` of ``container``, given ``p``, is the next layer of the last one's
        list and ``p`` holds the last layer's output."""
        prev = self.prev
        return prev is not None and prev[:2] == (container, index - 1) and _same(p, prev[2])

    def take(self, p: Tensor | None) -> Tensor | None:
        """The upstream sequence of a layer given ``p`` (the last layer's output when ``p`` is it or
        was pooled from it without a learned weight), None otherwise; what was derived is dropped."""
        out = self.prev[2] if self.prev is not None else None
        upstream = None
        if out is not None and p is not None:
            pooled = self.derived.get(id(p), _dead)() is p and id(p) not in self.learned
            if p is out or pooled:
                upstream = out
        self.derived, self.learned = {}, set()
        return upstream

    def between(self, args: tuple, kwargs: dict, out: Any) -> None:
        """An op ran outside any layer: note what it computed from the last layer's output, and
        whether through a learned weight matrix (BLT projects byte states into patch queries: a new
        sequence, not the same one pooled as Funnel's)."""
        src = self.prev[2] if self.prev is not None else None
        if src is None:
            return
        d = self.derived  # id -> weak reference: nothing here outlives the model's own use
        flat = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (tuple, list)) else (a,))]
        found = [t for t in flat if isinstance(t, Tensor) and (t is src or d.get(id(t), _dead)() is t)]
        if not found:
            return
        learned = any(isinstance(t, nn.Parameter) and t.dim() >= 2 for t in flat) or any(
            id(t) in self.learned for t in found
        )
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor):
                d[id(t)] = weakref.ref(t)
                (self.learned.add if learned else self.learned.discard)(id(t))

    def forget(self) -> None:
        """The forward is over: drop the last layer's output and what was computed from it."""
        self.prev, self.derived, self.learned = None, {}, set()


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
        self.book = LayerRecords(store, forward, self.name_of)  # what is kept of each layer that returned
        self.records, self.kept = self.book.records, self.book.kept  # (the same list and dict)
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
        self.upstream = Upstream()  # the last layer's output, and what was computed from it since

    def name_of(self, module: nn.Module) -> str:
        return self.names.get(id(module), "?")

    def plain_records(self) -> list[LayerRecord]:
        """Records of list elements without attention in lists that have attention (hybrids)."""
        return self.book.plain_records()

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
            n = self._param_counts[id(module)] = count_parameters(module)
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
        p = call.primary
        if container not in self.chain:
            self.chain[container] = True
            self.order.append(container)
        elif not self.upstream.follows(container, index, p):
            self.chain[container] = False
        return index, self.upstream.take(p)

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
            lay.stream.after_op(func, args, kwargs, out, self.source_id)

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
        self.upstream.ended(layer.container, layer.index, out)
        last = layer.index + 1 >= self.container_len.get(layer.container, 0)
        if last:
            # the list's last layer: what runs next computes no pattern
            self.store.let_go()
        c = layer.container
        length = self.list_calls[c] if c in self.looped else self.container_len.get(c, layer.index + 1)
        try:
            self.book.close(layer, call, out, length, self.pool_notes.get(c))
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
