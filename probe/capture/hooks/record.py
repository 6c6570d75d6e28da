"""Recording attention: each attention event, the sublayer it belongs to, and its pattern consumer.

The :class:`Recorder` handles the ops the watcher's mode hands it (every ``softmax``,
``F.scaled_dot_product_attention`` and ``flex_attention`` call) and the weights of torch's fused
modules recomputed after they return. A softmax over the last dimension is a pattern when its
last two axes are sequence lengths (lengths of the model's inputs or of a layer's stream):
routers over experts, output probabilities and softmaxes over features are not. Each event of a
layer being captured is counted, then assigned to an :class:`~probe.capture.calls.Attention`,
one per sublayer call (several softmaxes of separate head modules are its parts; a differently
shaped attention in the same call opens a new one). When the sublayer returns the Attention is
closed: judged *self* or *cross* (:func:`is_cross`), then handed to the consumer.

The pattern-consumer seam
-------------------------
What becomes of the weights is the consumer's business, one object with three calls
(:class:`PatternConsumer`), each receiving the open :class:`~probe.capture.calls.Attention`:

* ``weights(attn, pattern, impl)``: a pattern that exists whole (a softmax output, the model's
  own tensor; or weights recomputed for a fused module), ``[batch, (heads,) q, k]`` or torch's
  ``[batch·heads, q, k]``. Consumers must not modify it.
* ``sdpa(attn, args, kwargs)``: an SDPA call that ran; its weights do not exist yet. The consumer
  recomputes what it needs from the call's own arguments: whole with
  :func:`~probe.capture.patterns.sdpa_weights`, or row block by row block with
  :func:`~probe.capture.patterns.sdpa_blocks` (never holding the whole pattern).
* ``close(attn)``: the sublayer returned; every part has arrived and ``attn.role`` is set. A
  consumer that stores a pattern sets ``attn.handle`` (its sink handle), ``attn.shape`` and
  ``attn.causal``; the layer's record lists the Attentions with a handle.

The default consumer, :class:`~probe.capture.consumers.keep.KeepPatterns`, stores every pattern whole. A
consumer that keeps statistics, selected rows or the top-k keys implements the same three calls
(reading row blocks in ``sdpa`` and slicing rows out of ``weights``) and is handed to the
:class:`~probe.capture.engine.tracer.Tracer` in its place.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from probe.capture import layouts
from probe.capture.calls import Attention, Forward
from probe.capture.hooks.layers import LayerTracker
from probe.capture.hooks.residual import LayerStream
from probe.capture.hooks.streams import caller, is_new_stream, is_other_module, join
from probe.capture.layouts.fused import mha_weights
from probe.capture.patterns import flex_weights

try:  # the higher-order op flex_attention runs; its scores never exist outside the kernel
    from torch._higher_order_ops.flex_attention import flex_attention as FLEX
except ImportError:  # pragma: no cover - older torch
    FLEX = None

SOFTMAX = frozenset({F.softmax, torch.softmax, Tensor.softmax, torch.special.softmax})
SDPA = F.scaled_dot_product_attention
SINK_KIND = "softmax over the keys and a learned sink column; sink holds the column's mass"


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
    """Receives the attention of every layer being captured (see the module docstring)."""

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


class Recorder:
    """Attention events of one capture, read against ``layers``, handed to ``consumer``."""

    def __init__(self, layers: LayerTracker, forward: Forward, consumer: PatternConsumer) -> None:
        self.layers = layers
        self.stack = layers.stack
        self.forward = forward
        self.consumer = consumer
        self.impls: set[str] = set()  # how the patterns were computed: softmax, sdpa, mha, flex
        self.flex_calls: list[tuple[tuple, dict, Any]] = []  # flex_attention calls traced, not yet seen
        self._flex_done: list[Tensor] = []  # the queries of flex_attention calls recomputed as they ran

    # -- the ops the watcher's mode hands on: each handler runs the op and returns its output --
    def softmax(self, func: Any, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        if self._mixes_streams(out):
            self.layers.after_op(func, args, kwargs, out)
            return out
        if not layouts.on_softmax(self, out):  # a family's own layout: mapped back or refused
            self._softmax(args, kwargs, out)
        self.layers.after_op(func, args, kwargs, out)
        return out

    def _softmax(self, args: tuple, kwargs: dict, out: Any) -> None:
        """A softmax that is no registered layout's (:mod:`probe.capture.layouts`): a pattern, a
        pattern with a sink column, a layout probe does not read (refused), or no attention."""
        kind = self._over_sequence(args, kwargs, out)
        if kind is None:
            if self._attention_shaped(args, kwargs, out):
                self._unseen()
        elif not self.wants():
            self.note_event()
        elif kind == "sink":
            # the keys plus one learned sink column (GPT-OSS): the pattern over the real keys,
            # the sink's mass beside it
            a = self._open((out.shape[-2], out.shape[-1] - 1), "softmax")
            a.sinks.append(out[..., -1])
            a.kind = SINK_KIND
            self.consumer.weights(a, out[..., :-1], "softmax")
        else:
            self._weights(out, "softmax")

    def _mixes_streams(self, out: Any) -> bool:
        """Whether a softmax mixes the parallel streams of a hyper-connected layer (GLM-5-Next's and
        DeepSeek-V4's ``comb``, ``[batch, T, n, n]`` for a stream ``[batch, T, n, d]``): weights
        over streams, not keys. Noted in the layer's metadata, never stored. Where ``n`` equals the
        sequence length the two cannot be told apart by shape: refused (unseen)."""
        lay = self.layers.layer
        if lay is None or lay.stream is None or len(lay.stream.shape) != 4 or not isinstance(out, Tensor):
            return False
        b, t, n, _ = lay.stream.shape
        if out.dim() != 4 or tuple(out.shape) != (b, t, n, n):
            return False
        if n == t:
            self._unseen()
        else:
            lay.skipped.add(
                f"a softmax over the layer's {n} parallel streams (hyper-connections), not over keys"
            )
        return True

    @staticmethod
    def _attention_shaped(args: tuple, kwargs: dict, out: Any) -> bool:
        """Whether a softmax not read as a pattern still looks like attention: over the last axis
        of a floating tensor of 4 or more axes (``[batch, heads, q, k]``-like, or a chunked layout
        such as ``[batch, T, heads, window]`` or ``[batch, blocks, heads, block, 3 * block]``).
        Routers and output probabilities have 2 or 3 axes."""
        if not isinstance(out, Tensor) or out.dim() < 4 or not out.is_floating_point():
            return False
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return dim in (-1, out.dim() - 1)

    def _unseen(self) -> None:
        """Note the layer running now (by its list and index) as computing attention probe did not
        recognise; the capture is refused for it (:func:`probe.capture.engine.naming.check_forward`)."""
        layer = self.layers.layer
        if layer is None:
            return
        name = f"{layer.container}.{layer.index}"
        if name not in self.forward.unseen:
            self.forward.unseen.append(name)

    def _over_sequence(self, args: tuple, kwargs: dict, out: Any) -> str | None:
        """Whether a softmax's output is attention: over its last axis, the last two sequence
        lengths (``"pattern"``), or the keys and one more column, a sink (``"sink"``); else None."""
        if not isinstance(out, Tensor) or out.dim() < 3:
            return None
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if dim is None or dim not in (-1, out.dim() - 1):
            return None
        lengths = self.forward.lengths
        q, k = out.shape[-2], out.shape[-1]
        if q not in lengths:
            return None
        if k in lengths:
            return "pattern"
        # one column more than a sequence's keys: a sink column joined to the scores
        return "sink" if k - 1 in lengths else None

    def sdpa(self, func: Any, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        if layouts.on_sdpa(self, args, kwargs):
            pass  # a family's own layout (Swin's windows): mapped back or refused
        elif self.wants():
            query = args[0] if args else kwargs["query"]
            key = args[1] if len(args) > 1 else kwargs["key"]
            whole = (*query.shape[:-2], query.size(-2), key.size(-2)) if query.dim() == 4 else None
            self.consumer.sdpa(self._open((query.size(-2), key.size(-2)), "sdpa", whole=whole), args, kwargs)
        else:
            self.note_event()  # a layer left out by `layers=`: count it, skip the work
        self.layers.after_op(func, args, kwargs, out)
        return out

    def flex(self, func: Any, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        if torch.compiler.is_compiling():
            # flex_attention runs its operator under torch.compile, which traces this body: one
            # list append, which dynamo replays with the call's real arguments once the compiled
            # call returned; flush() recomputes the weights at the next op or module return. Only
            # the attention output is kept: keeping the log-sum-exp output alive as well made
            # inductor's flex lowering fail (IndexError) when transformers compiles it
            self.flex_calls.append((args, kwargs, out[:1] if isinstance(out, tuple) else out))
        else:
            # the operator itself, run eagerly (or by a compiled graph run eagerly): recomputed
            # now; the replayed append of the same call, if one follows, is skipped
            self._flex(args, kwargs, out)
            self._flex_done.append(args[0])
        return out

    def flush(self) -> None:
        """Recompute the weights of the flex_attention calls traced by torch.compile since the
        last flush (the watcher calls this at the next op or module return after them)."""
        calls, done = list(self.flex_calls), self._flex_done
        self.flex_calls.clear()
        self._flex_done = []
        for args, kwargs, out in calls:
            if not any(args[0] is q for q in done):
                self._flex(args, kwargs, out)

    def _flex(self, args: tuple, kwargs: dict, out: Any) -> None:
        if self.wants():
            query, key = args[0], args[1]
            attn = self._open((query.size(-2), key.size(-2)), "flex")
            self.consumer.weights(attn, flex_weights(*args, **kwargs), "flex")
        else:
            self.note_event()
        self.layers.after_op(FLEX, args, kwargs, out)

    # -- the other ops some layout reads (Reformer's logsumexp), handed on by the watcher's mode --
    def reads_op(self, func: Any) -> bool:
        """Whether a registered layout reads the op ``func`` inside the module running now."""
        return layouts.op_layout(self.stack, func) is not None

    def layout_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run ``func`` where :meth:`reads_op` said a layout reads it; that layout reads it, and
        the op's output is returned."""
        layout, call = layouts.op_layout(self.stack, func)
        return layout.op(self, call, func, args, kwargs)

    # -- torch's fused modules, after they returned (the watcher calls these) ------------------
    def mha_module(self, module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> None:
        """An ``nn.MultiheadAttention`` call that ran with the mode off: its weights recomputed."""
        if not self.wants():
            self.note_event()
            return
        with torch.no_grad():
            w = mha_weights(module, args, kwargs)
        if w is not None:
            self._weights(w, "mha")

    def pattern(self, weights: Tensor, impl: str) -> None:
        """A pattern computed outside the mode (a replayed fused layer's weights)."""
        if self.wants():
            self._weights(weights, impl)
        else:
            self.note_event()

    # -- events --------------------------------------------------------------------------------
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

    def _weights(self, pattern: Tensor, impl: str) -> None:
        qk = tuple(pattern.shape[-2:])
        self.consumer.weights(self._open(qk, impl, tuple(pattern.shape)), pattern, impl)

    def _open(
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
