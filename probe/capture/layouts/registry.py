"""The layout registry: each family's own attention layout, recognised and mapped back to ``[query, key]``.

Most models hand probe their attention as one softmax (or SDPA call) whose last two axes are the
queries and the keys. Some compute it in a layout of their own: chunks (Canine), a band
(Longformer/LED), blocks (LongT5, Pegasus-X), several streams (ProphetNet), extra columns
(DeepSeek-V4), hash-sorted chunks (Reformer), windows of a picture's patch grid (Swin). Each such
layout is one :class:`Layout` in one file of :mod:`probe.capture.layouts`, registered with
:func:`register`; the :class:`~probe.capture.hooks.record.Recorder` asks the registered layouts, in
``priority`` order, about each softmax and SDPA call (:func:`on_softmax`, :func:`on_sdpa`) and
each other op a layout reads (:data:`probe.capture.layouts.OPS`, :func:`op_layout`). A layout
*claims* the event by its module call (:meth:`Layout.claim`), then maps it to ``[batch, heads,
q, k]`` and hands it to the recorder's consumer (:func:`attention`), or refuses it
(:func:`refuse`: the capture is refused, naming the layer). A new family is one new file.
"""

from __future__ import annotations

from typing import Any

from probe.capture.calls import Attention, Call

# what the layouts are handed: the recorder of the capture running (its attention events,
# :class:`probe.capture.hooks.attentions.AttentionEvents`; :class:`probe.capture.hooks.record.Recorder`)
Recorder = Any

LAYOUTS: list[Layout] = []  # registered, in priority order


class Layout:
    """One family's attention layout. Subclasses set ``name`` and ``priority`` (the order layouts
    are asked in, lower first: a module that looks like two layouts goes to the first), say which
    events they read (``reads``: ``"softmax"``, ``"sdpa"``; ``ops``: other torch ops), recognise
    their call (:meth:`claim`) and map what it computed (:meth:`softmax`, :meth:`sdpa`,
    :meth:`op`)."""

    name: str = ""
    priority: int = 100
    reads: frozenset[str] = frozenset({"softmax"})
    ops: frozenset = frozenset()

    def claim(self, stack: list[Call], out: Any) -> Call | None:
        """The module call running this layout that the event belongs to (``out``: the softmax's
        output, None for SDPA and other ops), or None when it is not this layout's."""
        raise NotImplementedError

    def softmax(self, rec: Recorder, call: Call, out: Any) -> bool:
        """Read the softmax output ``out`` of ``call``: map it and hand it on, or refuse it; True.
        False hands it to the recorder's plain path (a plain ``[batch, heads, q, k]`` softmax)."""
        raise NotImplementedError

    def sdpa(self, rec: Recorder, call: Call, args: tuple, kwargs: dict) -> bool:
        """Read an SDPA call that ran inside ``call`` (its weights recomputed from ``args``); True
        when read, False for the recorder's plain SDPA path."""
        return False

    def op(self, rec: Recorder, call: Call, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run one of ``ops`` inside ``call``, read it, and return its output."""
        raise NotImplementedError


def register(layout: Layout) -> Layout:
    """Add ``layout`` to the registry (kept in priority order) and return it."""
    if any(x.name == layout.name for x in LAYOUTS):
        raise ValueError(f"a layout named {layout.name!r} is registered already")
    LAYOUTS.append(layout)
    LAYOUTS.sort(key=lambda x: x.priority)
    return layout


def on_softmax(rec: Recorder, out: Any) -> bool:
    """Whether a softmax output ``out`` was a registered layout's (then mapped back or refused)."""
    for layout in LAYOUTS:
        if "softmax" in layout.reads:
            call = layout.claim(rec.stack, out)
            if call is not None:
                return layout.softmax(rec, call, out)
    return False


def on_sdpa(rec: Recorder, args: tuple, kwargs: dict) -> bool:
    """Whether an SDPA call that ran was a registered layout's (then mapped back or refused)."""
    for layout in LAYOUTS:
        if "sdpa" in layout.reads:
            call = layout.claim(rec.stack, None)
            if call is not None:
                return layout.sdpa(rec, call, args, kwargs)
    return False


def op_layout(stack: list[Call], func: Any) -> tuple[Layout, Call] | None:
    """The layout that reads the op ``func`` running now, and its call; None when none does."""
    for layout in LAYOUTS:
        if func in layout.ops:
            call = layout.claim(stack, None)
            if call is not None:
                return layout, call
    return None


# -- what a layout does with what it read ---------------------------------------------------------
def skipped(rec: Recorder) -> bool:
    """True (the event counted, nothing computed) when the layer running now is not captured."""
    if rec.wants():
        return False
    rec.note_event()
    return True


def attention(rec: Recorder, qk: tuple[int, int], kind: str | None, impl: str = "softmax") -> Attention:
    """The open Attention of the sublayer running now for a ``qk``-shaped pattern (an event), its
    ``kind`` set; the caller sets what else goes beside the pattern, then hands it on with
    ``rec.consumer.weights(a, pattern, impl)``."""
    a = rec.open_attention(qk, impl)
    if kind is not None:
        a.kind = kind
    return a


def hand_on(rec: Recorder, pattern: Any, kind: str | None, impl: str = "softmax") -> Attention:
    """Hand a mapped ``[batch, heads, q, k]`` ``pattern`` to the consumer as one attention event."""
    a = attention(rec, tuple(pattern.shape[-2:]), kind, impl)
    rec.consumer.weights(a, pattern, impl)
    return a


def refuse(rec: Recorder, why: str | None = None) -> None:
    """Refuse the layer running now: attention in a layout probe cannot map exactly. The capture
    is then refused, naming the layer (and ``why``, once per capture)."""
    rec.note_unseen()
    if why is not None and why not in rec.forward.unseen_why:
        rec.forward.unseen_why.append(why)


__all__ = [
    "LAYOUTS",
    "Layout",
    "attention",
    "hand_on",
    "on_sdpa",
    "on_softmax",
    "op_layout",
    "refuse",
    "register",
    "skipped",
]
