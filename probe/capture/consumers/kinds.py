"""Derived pattern kinds: each attention's weights with their key columns scaled, kept beside them.

A *kind* is a name and a function ``scale(attn) -> [batch, heads, keys] tensor | None`` that the
caller supplies (the capture never computes one itself: ``probe.intervene.contrib`` gives
``"contribution"``, the norm of what each head writes from each key, Kobayashi et al. 2020).
:class:`Kinds` wraps any pattern consumer (whole patterns, rows, top-k, the row blocks of a
reader): the weights go to it as ever. When an attention closes (its sublayer returned, so the
caller's own hooks have seen the values it mixed), each kind's ``scale`` is asked for, and the
same consumer is handed the same events again for a *shadow* :class:`~probe.capture.calls.Attention`
whose ``scale`` is set: whatever the consumer keeps of the weights, it keeps of
``weights[b, h, i, j] * scale[b, h, j]`` too, honouring the same ``layers=``/``heads=``
selection. What the shadow stored joins the attention's fields under the kind's names:
``<kind>`` for a whole pattern (a block reader's handle likewise), ``<kind>_<field>`` for the
others (``contribution_rows``, ``contribution_topk_values``; a rows capture's ``row_index`` is
the weights' own and is not stored twice).

An attention whose pattern is not one softmax of ``[batch, heads, q, k]`` weights (a
differential attention, a merged self+cross softmax, a sink column or global tokens beside the
keys, several SDPA calls) gets no derived kind; neither does one whose ``scale`` returns None.
Each is listed in :attr:`Kinds.skipped` with the reason. ``scaled`` is the one multiplication
every consumer applies (:mod:`probe.capture.consumers.scale`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from probe.cache.format import ATTN_FIELDS
from probe.capture.calls import Attention
from probe.capture.consumers.keep import batch_size, restore_layout
from probe.errors import ProbeError

ScaleFn = Callable[[Attention], "Tensor | None"]


def _why_not(attn: Attention) -> str | None:
    """Why ``attn``'s pattern cannot take a derived kind (None: it can)."""
    if attn.diff_lambda is not None:
        return "a differential attention's heads are differences of softmaxes"
    if attn.split is not None or attn.also:
        return "one softmax runs over the layer's own keys and a source's"
    if attn.sinks or attn.fields.get("sink") is not None:
        return "a learned sink column takes part of each row"
    if attn.extra:
        return "global tokens beside the keys take part of each row"
    return None


class Kinds:
    """A pattern consumer that hands ``inner`` the weights and, for each ``kinds`` name, the
    weights scaled by ``kinds[name](attn)`` (see the module docstring)."""

    def __init__(self, inner: Any, kinds: dict[str, ScaleFn]) -> None:
        for name in kinds:
            if name not in ATTN_FIELDS or ATTN_FIELDS[name] != ATTN_FIELDS["pattern"] or name == "pattern":
                raise ProbeError(
                    f"{name!r} is not a pattern kind of the cache format; a new kind is a field of "
                    "probe.cache.format.ATTN_FIELDS laid out as 'pattern' (and its _rows, _topk_* fields)"
                )
        self.inner = inner
        self.kinds = dict(kinds)
        self.events: dict[int, list[tuple]] = {}
        self.skipped: list[tuple[str, str, str]] = []  # (sublayer module, kind, reason)

    def weights(self, attn: Attention, pattern: Tensor, impl: str) -> None:
        self.events.setdefault(id(attn), []).append(("weights", pattern.detach(), impl))
        self.inner.weights(attn, pattern, impl)

    def sdpa(self, attn: Attention, args: tuple, kwargs: dict) -> None:
        self.events.setdefault(id(attn), []).append(("sdpa", args, kwargs))
        self.inner.sdpa(attn, args, kwargs)

    def close(self, attn: Attention) -> None:
        events = self.events.pop(id(attn), [])
        self.inner.close(attn)
        if not events or (attn.handle is None and not attn.fields):
            return
        why = _why_not(attn) or _mixed(events)
        for name, fn in self.kinds.items():
            if why is not None:
                self.skipped.append((attn.module or "?", name, why))
                continue
            scale = fn(attn)
            if scale is None:
                continue
            self._shadow(attn, name, scale, events)

    def _shadow(self, attn: Attention, name: str, scale: Tensor, events: list[tuple]) -> None:
        """The inner consumer's keep of the scaled weights, its fields joined to ``attn``'s."""
        shadow = Attention(inputs=attn.inputs, primary=attn.primary, qk=attn.qk, impl=set(attn.impl))
        shadow.module, shadow.kv_prefix, shadow.scale = attn.module, attn.kv_prefix, scale
        if events[0][0] == "weights":
            parts = [p for _, p, _ in events]
            whole = restore_layout(parts, batch_size(attn.primary, attn.qk[0]))
            self.inner.weights(shadow, whole, events[0][2])
        else:
            _, args, kwargs = events[0]
            self.inner.sdpa(shadow, args, kwargs)
        shadow.role, shadow.closed = attn.role, True
        self.inner.close(shadow)
        if shadow.handle is not None:
            attn.fields[name] = shadow.handle
        for field, h in shadow.fields.items():
            if field != "row_index":
                attn.fields[f"{name}_{field}"] = h

    @property
    def readers(self) -> dict:
        """The inner consumer's readers by handle (a :class:`BlockConsumer`'s), shadows' included."""
        return self.inner.readers


def _mixed(events: list[tuple]) -> str | None:
    kinds = {e[0] for e in events}
    if len(kinds) > 1:
        return "its heads were computed partly by softmax, partly by SDPA"
    if kinds == {"sdpa"} and len(events) > 1:
        return "its heads come from several SDPA calls"
    return None


__all__ = ["Kinds", "ScaleFn"]
