"""The attentions of the layer running now: one per sublayer call, opened as events arrive, closed
and judged self or cross when the sublayer returns, handed to the pattern consumer.

:class:`AttentionEvents` is what the :class:`~probe.capture.hooks.record.Recorder` (the op
handlers) and the layouts of :mod:`probe.capture.layouts` share: whether the layer running now is
captured (:meth:`~AttentionEvents.wants`), counting events, opening the
:class:`~probe.capture.calls.Attention` of the sublayer running now
(:meth:`~AttentionEvents.open_attention`: several softmaxes of separate head modules are its
parts; a differently shaped attention in the same call opens a new one) and closing it
(:meth:`~AttentionEvents.close`: its role judged by :func:`is_cross`, a merged self+cross softmax
split by :func:`merged_split`). :class:`PatternConsumer` is the seam a consumer implements (see
:mod:`probe.capture.hooks.record`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from probe.capture.calls import Attention, Forward
from probe.capture.hooks.layers import LayerTracker
from probe.capture.hooks.residual import LayerStream
from probe.capture.hooks.streams import caller, is_new_stream, is_other_module, join

DIFF_KIND = (
    "differential attention: each head is a1 - lambda * a2 of two softmaxes (query heads h and "
    "h + heads), the pattern is the combined map and parts holds [a1, a2]"
)


def differential_lambda(module: nn.Module) -> float | None:
    """λ of a differential-attention module (DiffLlama's ``lambda_q1/k1/q2/k2`` and
    ``lambda_init``), computed as the module does; None for any other module."""
    names = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "lambda_init")
    if not all(hasattr(module, n) for n in names):
        return None
    with torch.no_grad():
        l1 = torch.exp(torch.sum(module.lambda_q1 * module.lambda_k1, dim=-1, dtype=torch.float32))
        l2 = torch.exp(torch.sum(module.lambda_q2 * module.lambda_k2, dim=-1, dtype=torch.float32))
        dtype = module.lambda_q1.dtype
        return float(l1.to(dtype) - l2.to(dtype) + module.lambda_init)


class PatternConsumer(Protocol):
    """Receives the attention of every layer being captured (see :mod:`probe.capture.hooks.record`)."""

    def weights(self, attn: Attention, pattern: Tensor, impl: str) -> None: ...

    def sdpa(self, attn: Attention, args: tuple, kwargs: dict) -> None: ...

    def close(self, attn: Attention) -> None: ...


def _sources(attn: Attention, stream: LayerStream | None, upstream: Tensor | None) -> list[Tensor]:
    """Stream-shaped tensors handed to ``attn``'s sublayer besides its own stream: not derived from
    the layer's ``stream`` (BLOOM passes its residual in) and not the ``upstream`` sequence the
    layer's input was computed from (Funnel pools its queries from it): an encoder's output."""
    p0 = attn.primary
    if p0 is None or p0.is_nested or p0.dim() != 3:
        return []
    return [
        t
        for t in attn.inputs
        if t is not p0
        and t is not upstream
        and not any(t is p for p in attn.positional)
        and not t.is_nested
        and t.dim() == 3
        and t.is_floating_point()
        and t.shape[0] == p0.shape[0]
        and t.shape[-1] == p0.shape[-1]
        and t.data_ptr() != p0.data_ptr()
        and not (stream is not None and stream.label(t)[0])  # the layer's own stream
    ]


def is_cross(
    attn: Attention, cached: int, stream: LayerStream | None, upstream: Tensor | None = None
) -> bool:
    """Whether ``attn`` is cross-attention: its queries and keys differ in length (other than by a
    KV cache's ``cached`` positions, or because the queries were pooled from the ``upstream``
    sequence the keys cover), or its sublayer was handed a second stream-shaped tensor that is not
    derived from the layer's own ``stream`` (:func:`_sources`)."""
    q, k = attn.qk
    cross = q != k
    if cross and upstream is not None and upstream.dim() == 3 and k in upstream.shape[:2]:
        if any(t is upstream for t in attn.inputs):
            return False  # keys over the sequence this layer's stream was pooled from (Funnel)
    p0 = attn.primary
    if cross and cached and k == cached + q:
        # a KV-cached call: keys are the cached positions plus the new ones, the same sequence,
        # unless a second sequence of that length was fed in (an encoder's output)
        cross = any(
            t.is_floating_point() and t.dim() == 3 and k in t.shape[:2] and t is not p0 for t in attn.inputs
        )
    if not cross and _sources(attn, stream, upstream):
        return True
    return cross


# attention modules whose one softmax runs over a source's keys followed by their own, read from
# their code: Idefics2's perceiver resampler attends from its latents over
# ``torch.concat([context, latents])`` (the image features first)
SOURCE_FIRST = frozenset({"Idefics2PerceiverAttention"})


def merged_split(
    attn: Attention, cached: int, stream: LayerStream | None, upstream: Tensor | None = None
) -> int | None:
    """The number of own keys when ``attn`` is one softmax over the layer's own keys (``cached`` +
    queries) followed by a source's keys (T5Gemma 2's merged self+cross attention), else None."""
    q, k = attn.qk
    own = cached + q
    if k <= own:
        return None
    for t in _sources(attn, stream, upstream):
        if k == own + t.shape[1]:
            return own
    return None


class AttentionEvents:
    """The attention events of one capture, read against ``layers`` (the layer and sublayer
    running now), each attention handed to ``consumer``; ``impls``: how the patterns were
    computed (softmax, sdpa, mha, flex)."""

    def __init__(self, layers: LayerTracker, forward: Forward, consumer: PatternConsumer) -> None:
        self.layers = layers
        self.stack = layers.stack
        self.forward = forward
        self.consumer = consumer
        self.impls: set[str] = set()

    def wants(self) -> bool:
        """Whether the attention about to be seen belongs to a layer being captured."""
        if not self.stack:
            return False
        return self.layers.current().wanted

    def note_event(self) -> None:
        """Count an attention event on every call running and on the layer."""
        for c in self.stack:
            c.events += 1
        self.layers.current().events += 1

    def hand_weights(self, pattern: Tensor, impl: str) -> None:
        """A whole ``pattern`` (a softmax output, weights recomputed) handed to the consumer."""
        qk = tuple(pattern.shape[-2:])
        self.consumer.weights(self.open_attention(qk, impl, tuple(pattern.shape)), pattern, impl)

    def open_attention(
        self,
        qk: tuple[int, int],
        impl: str,
        shape: tuple[int, ...] | None = None,
        *,
        whole: tuple[int, ...] | None = None,
    ) -> Attention:
        """The open Attention of the sublayer running now for a ``qk``-shaped pattern (an event);
        ``shape``: the whole shape of a softmax output, to tell a module's second whole softmax
        (an attention of its own, :mod:`probe.capture.hooks.streams`) from more heads of the first;
        ``whole``: an SDPA call's ``[batch, heads, q, k]``, to tell another module's attention
        from more heads (:func:`~probe.capture.hooks.streams.is_other_module`; softmaxes: ``shape``)."""
        whole = shape if whole is None else whole
        self.note_event()
        layer = self.layers.current()
        sub = self.layers.sublayer_call()
        a = sub.attn
        call = caller(self.stack)
        previous = a if a is not None and a.qk == qk and is_new_stream(a, call, shape) else None
        if a is None or a.qk != qk or previous is not None or is_other_module(a, call, whole):
            if a is not None:
                # a second, differently shaped attention in the same sublayer, or a second whole
                # softmax of the same module call: recorded on its own
                self.close(a)
            a = Attention(inputs=sub.inputs, primary=sub.primary, qk=qk)
            a.positional = sub.positional
            a.source_first_module = type(sub.module).__name__ in SOURCE_FIRST
            a.module = self.layers.name_of(sub.module)
            a.kv_prefix = max((c.kv_prefix for c in self.stack), default=0)
            a.diff_lambda = differential_lambda(sub.module)
            if a.diff_lambda is not None:
                a.kind = DIFF_KIND
            if previous is not None:
                join(previous, a, call.module)
            sub.attn = a
            layer.attns.append(a)
        a.caller, a.last_shape = call, whole
        a.impl.add(impl)
        self.impls.add(impl)
        return a

    def close(self, attn: Attention) -> None:
        """Everything of ``attn`` arrived (its sublayer returned): judge its role, hand it on."""
        if attn.closed:
            return
        attn.closed = True
        attn.caller = None  # the module call (and through it its inputs) is not kept past here
        layer = self.layers.layer
        stream = layer.stream if layer is not None else None
        upstream = layer.upstream if layer is not None else None
        cached = self.forward.cached
        attn.split = merged_split(attn, cached, stream, upstream)
        if attn.split is not None and attn.source_first_module:
            attn.split, attn.source_first = attn.qk[1] - attn.split, True  # the source's keys count
        if attn.split is None and attn.kv_prefix and attn.kv_prefix != cached:
            # keys = the positions another stack put in the layer's cache earlier in this forward
            # (DiffusionGemma's encoder prompt), then the layer's own: source first, then self
            q, k = attn.qk
            if k == attn.kv_prefix + q:
                attn.split, attn.source_first = attn.kv_prefix, True
        # Pegasus-X's global tokens, ProphetNet's predict streams: the layer's own keys
        cross = attn.split is None and not attn.self_only and is_cross(attn, cached, stream, upstream)
        attn.role = "cross" if cross else "self"
        self.consumer.close(attn)

    def note_unseen(self) -> None:
        """Note the layer running now (by its list and index) as computing attention probe did not
        recognise; the capture is refused for it (:func:`probe.capture.engine.naming.check_forward`)."""
        layer = self.layers.layer
        if layer is None:
            return
        name = f"{layer.container}.{layer.index}"
        if name not in self.forward.unseen:
            self.forward.unseen.append(name)


__all__ = [
    "DIFF_KIND",
    "SOURCE_FIRST",
    "AttentionEvents",
    "PatternConsumer",
    "differential_lambda",
    "is_cross",
    "merged_split",
]
