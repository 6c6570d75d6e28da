"""The tracer: one capture's parts, assembled.

How a capture works, in one pass over the unmodified model (``docs/architecture-capture.md``
has the picture):

* :class:`~probe.capture.hooks.watch.Watcher` watches the model's calls (module hooks keep a call
  stack) and ops (a ``TorchFunctionMode`` routes each torch call), suspending the mode around
  torch's fused modules, whose fast paths switch off under any mode.
* :class:`~probe.capture.hooks.layers.LayerTracker` says which call is a layer (the outermost element
  of an ``nn.ModuleList`` or one-type ``nn.Sequential`` on the stack; else the top-level child
  computing attention) and which of its child calls are sublayers, follows the layer's residual
  stream (:mod:`probe.capture.hooks.residual`) and hands it off as ``resid_pre``, deltas and
  ``resid_post`` (:mod:`probe.capture.hooks.deltas`) when the layer returns.
* :class:`~probe.capture.hooks.record.Recorder` turns softmax, SDPA and fused-module events into one
  :class:`~probe.capture.calls.Attention` per attention sublayer call, judges it self or cross,
  and hands it to a *pattern consumer* (the seam, documented in :mod:`probe.capture.hooks.record`):
  by default :class:`~probe.capture.consumers.keep.KeepPatterns`, which recomputes SDPA weights
  (:mod:`probe.capture.patterns`), restores ``[batch, heads, q, k]``, cuts ``heads=``, judges
  causality and stores the pattern.
* :class:`~probe.capture.hooks.store.Store` hands every tensor to the sink, converted to ``dtype=``,
  with reused pattern buffers for streamed captures.

What the tracer learnt is then named by :mod:`probe.capture.engine.naming` (stacks, keys, metadata).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from probe.cache.selection import Selection
from probe.capture.calls import Call, Forward, LayerRecord
from probe.capture.consumers.keep import KeepPatterns
from probe.capture.consumers.kept import Keep
from probe.capture.consumers.kinds import Kinds, ScaleFn
from probe.capture.consumers.rows import consumer as kept_consumer
from probe.capture.hooks.layers import LayerTracker
from probe.capture.hooks.record import PatternConsumer, Recorder
from probe.capture.hooks.store import Store
from probe.capture.hooks.watch import Watcher


class Tracer:
    """Hooks ``model`` for one capture into ``sink``; ``with tracer: model(...)``.

    ``consumer`` receives every attention (default: :class:`~probe.capture.consumers.keep.KeepPatterns`,
    whole patterns stored; ``keep`` (:class:`~probe.capture.consumers.kept.Keep`) picks the rows or top-k
    consumer of :mod:`probe.capture.consumers.rows` instead, its rows resolved against ``metadata``'s masks).
    ``kinds``: derived pattern kinds, ``{name: scale(attn) -> [batch, heads, keys]}``, kept by the
    same consumer beside the weights (:mod:`probe.capture.consumers.kinds`).
    After the forward: :attr:`records`, :meth:`plain_records`,
    :attr:`kept`, :attr:`impls`, :attr:`stored_dtypes` and the :attr:`forward`'s facts.
    """

    def __init__(
        self,
        model: nn.Module,
        sink: Any,
        *,
        selection: Selection | None = None,
        dtype: torch.dtype | None = None,
        consumer: PatternConsumer | None = None,
        keep: Keep | None = None,
        metadata: dict[str, Any] | None = None,
        kinds: dict[str, ScaleFn] | None = None,
    ) -> None:
        selection = selection or Selection()
        stack: list[Call] = []
        self.forward = Forward()
        self.store = Store(sink, dtype)
        self.layers = LayerTracker(model, stack, selection, self.store, self.forward)
        if consumer is None and keep is not None:
            consumer = kept_consumer(keep, self.store, selection, metadata or {})
        consumer = consumer if consumer is not None else KeepPatterns(self.store, selection)
        if kinds:  # derived pattern kinds kept beside the weights by the same consumer
            consumer = Kinds(consumer, kinds)
        self.consumer = consumer
        self.recorder = Recorder(self.layers, self.forward, consumer)
        self.watcher = Watcher(model, stack, self.layers, self.recorder, self.forward)

    def __enter__(self) -> Tracer:
        self.watcher.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.watcher.remove(*exc)
        finally:
            self.layers.upstream.forget()

    @property
    def records(self) -> list[LayerRecord]:
        """The captured layers that computed attention, in the order they returned."""
        return self.layers.records

    def plain_records(self) -> list[LayerRecord]:
        """The list elements without attention in lists with attention (their residuals stored now)."""
        return self.layers.plain_records()

    @property
    def kept(self) -> dict[str, int]:
        """Each layer list with attention -> its number of elements."""
        return self.layers.kept

    @property
    def chain(self) -> dict[str, bool]:
        """Each layer list -> whether every layer's input was the previous layer's output."""
        return self.layers.chain

    @property
    def looped(self) -> set[str]:
        """The layer lists that ran a module more than once (their layers are numbered by call)."""
        return self.layers.looped

    @property
    def order(self) -> list[str]:
        """The layer lists in the order their first layer ran."""
        return self.layers.order

    @property
    def impls(self) -> set[str]:
        return self.recorder.impls

    @property
    def stored_dtypes(self) -> set[str]:
        return self.store.dtypes
