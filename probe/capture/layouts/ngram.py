"""ProphetNet's n-gram self-attention: the main stream and each predict stream stored apart.

ProphetNet's decoder runs ``1 + ngram`` streams of ``T`` positions through one self-attention
module (``ProphetNetNgramSelfAttention``): the main stream attends over its own keys (a plain
``[batch, heads, T, T]`` softmax, stored as the layer's first self-attention, ``self_attn.0``),
and every predict stream ``n`` over ``[the main stream's T keys | its own stream's T keys]``, one
softmax ``[batch, ngram, heads, T, 2T]`` for all of them. Predict stream ``n`` (1-based) is
stored as ``self_attn.<n>``, ``[batch, heads, T, 2T]``: column ``j < T`` is main-stream position
``j``, column ``T + j`` the stream's own position ``j``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from probe.capture.calls import Call
from probe.capture.layouts.registry import Layout, attention, refuse, register, skipped

MAIN_KIND = "ProphetNet main stream: its queries over its own keys, [batch, heads, T, T]"


def predict_kind(n: int, ngram: int) -> str:
    """The metadata ``kind`` of predict stream ``n`` of ``ngram``."""
    return (
        f"ProphetNet predict stream {n} of {ngram}: its queries over [the main stream's T keys | "
        "its own stream's T keys], [batch, heads, T, 2T]"
    )


def ngram_of(module: nn.Module) -> int | None:
    """The number of predict streams of a ProphetNet n-gram self-attention module, else None."""
    n = getattr(module, "ngram", None)
    ok = isinstance(n, int) and hasattr(module, "get_predict_relative_pos_embeddings")
    return n if ok else None


class NgramStreams(Layout):
    """The predict streams' softmax ``[batch, ngram, heads, T, 2T]`` of an n-gram module (the
    innermost call): each stream handed on as an attention of its own. A 4-d softmax (the main
    stream's) is left to the plain path; any other shape is refused."""

    name = "prophetnet-ngram"
    priority = 40

    def claim(self, stack: list[Call], out: Any) -> Call | None:
        return stack[-1] if stack and ngram_of(stack[-1].module) is not None else None

    def softmax(self, rec, call: Call, out: Any) -> bool:
        ngram = ngram_of(call.module)
        if not isinstance(out, Tensor) or out.dim() == 4:
            return False
        if out.dim() != 5 or out.shape[1] != ngram or out.shape[-1] != 2 * out.shape[-2]:
            refuse(rec)
            return True
        if skipped(rec):
            return True
        sub = rec.layers.sublayer_call()
        main = sub.attn
        if main is not None and main.kind is None and main.qk == (out.shape[-2],) * 2:
            main.kind = MAIN_KIND
        for n in range(ngram):
            if sub.attn is not None:
                rec.close(sub.attn)  # each stream an attention of its own, never one merged
                sub.attn = None
            a = attention(rec, tuple(out.shape[-2:]), predict_kind(n + 1, ngram))
            a.self_only = True  # its keys are the layer's own streams, not a source's
            rec.consumer.weights(a, out[:, n], "softmax")
        return True


NGRAM = register(NgramStreams())
