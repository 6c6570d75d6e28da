"""What is kept of each layer that returned: its attentions' fields and its residuals, as a record.

The :class:`~probe.capture.hooks.layers.LayerTracker` follows which call is a layer; when a layer
returns it hands the layer here (:meth:`LayerRecords.close`): a layer that ran a kernel probe
cannot see is refused, a list element without attention keeps its stream for later (named once the
lists with attention are known, :meth:`LayerRecords.plain_records`), and a captured layer's
residual stream is split into ``resid_pre``, deltas and ``resid_post``
(:func:`~probe.capture.hooks.deltas.layer_residuals`), handed to the
:class:`~probe.capture.hooks.store.Store`, and kept as one :class:`~probe.capture.calls.LayerRecord`
for the engine to name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from probe.capture.calls import Attention, Call, Forward, LayerRecord, fields_of
from probe.capture.hooks.deltas import channels_last, layer_residuals
from probe.capture.hooks.store import Store
from probe.errors import ProbeError


class LayerRecords:
    """The records of one capture's layers: ``records`` (captured layers with attention, in the
    order they returned), ``kept`` (each list with attention -> its number of elements) and the
    list elements without attention (:meth:`plain_records`)."""

    def __init__(self, store: Store, forward: Forward, name_of: Callable[[nn.Module], str]) -> None:
        self.store = store
        self.forward = forward
        self.name_of = name_of
        self.records: list[LayerRecord] = []
        # list elements without attention: (list, index, module, resid_pre, resid_post, call, skipped)
        self.plain: list[tuple[str, int, str, Tensor, Tensor, int, str]] = []
        self.kept: dict[str, int] = {}

    def close(self, layer: Any, call: Call, out: Tensor | None, length: int, pool_note: str | None) -> None:
        """Layer ``layer`` (a :class:`~probe.capture.hooks.layers.Layer`), the call ``call``,
        returned ``out``; its list has ``length`` elements (or calls), ``pool_note`` says what an
        attention pooling head is."""
        if len(self.forward.blind) > layer.blind:
            raise ProbeError(
                f"layer {self.name_of(call.module)} computes attention with {self.forward.blind[-1]}, "
                'which probe cannot look into; load the model with attn_implementation="sdpa" (or '
                '"eager") to capture it'
            )
        if not layer.events:
            self._plain(layer, call, out)
            return
        self.kept[layer.container] = length
        if layer.wanted:
            self.records.append(self._record(layer, call, out, pool_note))

    def _plain(self, layer: Any, call: Call, out: Tensor | None) -> None:
        """A list element with no attention (a Mamba or MLP-only block of a hybrid): its stream is
        kept, named once the lists with attention are known."""
        if not layer.wanted or layer.resid_pre is None or layer.resid_pre.is_nested:
            return
        if out is None or out.is_nested or out.shape != layer.resid_pre.shape:
            return
        name = layer.module or self.name_of(call.module)
        skipped = "; ".join(sorted(layer.skipped))
        self.plain.append(
            (layer.container, layer.index, name, layer.resid_pre, out.detach(), layer.call, skipped)
        )

    def _record(self, layer: Any, call: Call, out: Tensor | None, pool_note: str | None) -> LayerRecord:
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
        _note_merged(layer.attns, notes)
        residuals = [(n, self.store.put(t)) for n, t in items]
        module = layer.module or self.name_of(call.module)
        if layer.skipped:
            notes["not_attention"] = "; ".join(sorted(layer.skipped))
        if pool_note is not None:
            notes["pooling"] = pool_note
        for role in ("self", "cross"):
            n = len({a.module for a in stored if a.role == role})  # sublayers, not softmaxes
            defs = notes.get("deltas", {})
            if n > 1 and f"{role}_attn" in defs:  # LongCat-Flash: one delta for its two attentions
                defs[f"{role}_attn"] += f" (the sum of the layer's {n} {role}-attention sublayers' outputs)"
        modules = [a.module for a in stored]
        c = layer.container
        return LayerRecord(c, layer.index, module, patterns, residuals, notes, kinds, layer.call, modules)

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


def _note_merged(attns: list[Attention], notes: dict[str, Any]) -> None:
    """A layer whose self- and cross-attention are one softmax says so in its notes."""
    if not any(a.split is not None for a in attns):
        return
    first = any(a.source_first for a in attns)
    order = "the source's keys then the layer's own" if first else "the layer's own keys then the source's"
    notes["merged_attention"] = (
        f"self_attn and cross_attn are one softmax over {order} keys: each query's two rows together sum to 1"
    )


__all__ = ["LayerRecords"]
