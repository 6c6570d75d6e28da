"""Recording attention: each attention event, the sublayer it belongs to, and its pattern consumer.

The :class:`Recorder` handles the ops the watcher's mode hands it (every ``softmax``,
``F.scaled_dot_product_attention`` and ``flex_attention`` call) and the weights of torch's fused
modules recomputed after they return. A softmax over the last dimension is a pattern when its
last two axes are sequence lengths (lengths of the model's inputs or of a layer's stream):
routers over experts, output probabilities and softmaxes over features are not. Each event of a
layer being captured is counted, then assigned to an :class:`~probe.capture.calls.Attention`,
one per sublayer call (several softmaxes of separate head modules are its parts; a differently
shaped attention in the same call opens a new one). When the sublayer returns the Attention is
closed: judged *self* or *cross*, then handed to the consumer (both in
:mod:`probe.capture.hooks.attentions`, which the layouts share).

The pattern-consumer seam
-------------------------
What becomes of the weights is the consumer's business, one object with three calls
(:class:`~probe.capture.hooks.attentions.PatternConsumer`), each receiving the open
:class:`~probe.capture.calls.Attention`:

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

The default consumer, :class:`~probe.capture.consumers.keep.KeepPatterns`, stores every pattern
whole. A consumer that keeps statistics, selected rows or the top-k keys implements the same three calls
(reading row blocks in ``sdpa`` and slicing rows out of ``weights``) and is handed to the
:class:`~probe.capture.engine.tracer.Tracer` in its place.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from probe.capture.calls import Forward
from probe.capture.hooks.attentions import AttentionEvents, PatternConsumer
from probe.capture.hooks.layers import LayerTracker
from probe.capture.layouts import on_sdpa, on_softmax, op_layout
from probe.capture.layouts.fused import mha_weights
from probe.capture.patterns import flex_weights

try:  # the higher-order op flex_attention runs; its scores never exist outside the kernel
    from torch._higher_order_ops.flex_attention import flex_attention as FLEX
except ImportError:  # pragma: no cover - older torch
    FLEX = None

SOFTMAX = frozenset({F.softmax, torch.softmax, Tensor.softmax, torch.special.softmax})
SDPA = F.scaled_dot_product_attention
SINK_KIND = "softmax over the keys and a learned sink column; sink holds the column's mass"


class Recorder(AttentionEvents):
    """The attention ops of one capture (softmax, SDPA, flex_attention, torch's fused modules, the
    ops a layout reads), read against ``layers``, each attention handed to ``consumer`` (the
    events themselves: :class:`~probe.capture.hooks.attentions.AttentionEvents`)."""

    def __init__(self, layers: LayerTracker, forward: Forward, consumer: PatternConsumer) -> None:
        super().__init__(layers, forward, consumer)
        self.flex_calls: list[tuple[tuple, dict, Any]] = []  # flex_attention calls traced, not yet seen
        self.flex_done: list[Tensor] = []  # the queries of flex_attention calls recomputed as they ran

    # -- the ops the watcher's mode hands on: each handler runs the op and returns its output --
    def softmax(self, func: Any, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        if self._mixes_streams(out):
            self.layers.after_op(func, args, kwargs, out)
            return out
        if not on_softmax(self, out):  # a family's own layout: mapped back or refused
            self.plain_softmax(args, kwargs, out)
        self.layers.after_op(func, args, kwargs, out)
        return out

    def plain_softmax(self, args: tuple, kwargs: dict, out: Any) -> None:
        """A softmax that is no registered layout's (:mod:`probe.capture.layouts`): a pattern, a
        pattern with a sink column, a layout probe does not read (refused), or no attention."""
        kind = self._over_sequence(args, kwargs, out)
        if kind is None:
            if self._attention_shaped(args, kwargs, out):
                self.note_unseen()
        elif not self.wants():
            self.note_event()
        elif kind == "sink":
            # the keys plus one learned sink column (GPT-OSS): the pattern over the real keys,
            # the sink's mass beside it
            a = self.open_attention((out.shape[-2], out.shape[-1] - 1), "softmax")
            a.sinks.append(out[..., -1])
            a.kind = SINK_KIND
            self.consumer.weights(a, out[..., :-1], "softmax")
        else:
            self.hand_weights(out, "softmax")

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
            self.note_unseen()
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
        if on_sdpa(self, args, kwargs):
            pass  # a family's own layout (Swin's windows): mapped back or refused
        elif self.wants():
            query = args[0] if args else kwargs["query"]
            key = args[1] if len(args) > 1 else kwargs["key"]
            whole = (*query.shape[:-2], query.size(-2), key.size(-2)) if query.dim() == 4 else None
            self.consumer.sdpa(
                self.open_attention((query.size(-2), key.size(-2)), "sdpa", whole=whole), args, kwargs
            )
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
            self.flex_done.append(args[0])
        return out

    def flush(self) -> None:
        """Recompute the weights of the flex_attention calls traced by torch.compile since the
        last flush (the watcher calls this at the next op or module return after them)."""
        calls, done = list(self.flex_calls), self.flex_done
        self.flex_calls.clear()
        self.flex_done = []
        for args, kwargs, out in calls:
            if not any(args[0] is q for q in done):
                self._flex(args, kwargs, out)

    def _flex(self, args: tuple, kwargs: dict, out: Any) -> None:
        if self.wants():
            query, key = args[0], args[1]
            attn = self.open_attention((query.size(-2), key.size(-2)), "flex")
            self.consumer.weights(attn, flex_weights(*args, **kwargs), "flex")
        else:
            self.note_event()
        self.layers.after_op(FLEX, args, kwargs, out)

    # -- the other ops some layout reads (Reformer's logsumexp), handed on by the watcher's mode --
    def reads_op(self, func: Any) -> bool:
        """Whether a registered layout reads the op ``func`` inside the module running now."""
        return op_layout(self.stack, func) is not None

    def layout_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run ``func`` where :meth:`reads_op` said a layout reads it; that layout reads it, and
        the op's output is returned."""
        layout, call = op_layout(self.stack, func)
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
            self.hand_weights(w, "mha")

    def pattern(self, weights: Tensor, impl: str) -> None:
        """A pattern computed outside the mode (a replayed fused layer's weights)."""
        if self.wants():
            self.hand_weights(weights, impl)
        else:
            self.note_event()


__all__ = ["FLEX", "SDPA", "SINK_KIND", "SOFTMAX", "PatternConsumer", "Recorder"]
