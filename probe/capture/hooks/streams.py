"""Several whole softmaxes in one call of one module: attentions of their own, not head parts.

A sublayer's softmaxes of one shape normally are the parts of one attention (one softmax per head
module, joined along the heads). A module that itself runs two or more softmaxes of the same
``[batch, heads, q, k]`` shape, each over all of its heads, computes several attentions: LiLT's
self-attention runs one for its layout stream and one for its text stream, over the same summed
scores. Each is stored as an attention of its own (``self_attn.0``, ``self_attn.1``, in the order
they ran), its ``kind`` saying which softmax of the module call it is.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from probe.capture.calls import Attention, Call

STREAM_MARK = "softmax {i} of {n} that one call of this module computes"
LILT_KINDS = (
    "LiLT's layout stream: softmax 1 of 2 that one call of this module computes (the summed text "
    "and layout scores, read with the layout values)",
    "LiLT's text stream: softmax 2 of 2 that one call of this module computes (the summed text "
    "and layout scores, read with the text values; what eager output_attentions returns)",
)


def caller(stack: list[Call]) -> Call | None:
    """The innermost module call running now, past ``nn.Softmax``/``nn.Dropout`` modules that a
    model builds on the fly (LiLT's ``nn.Softmax(dim=-1)(scores)``)."""
    for c in reversed(stack):
        if not isinstance(c.module, (nn.Softmax, nn.Dropout)):
            return c
    return None


def is_new_stream(a: Attention, call: Call | None, shape: tuple[int, ...] | None) -> bool:
    """Whether a softmax of ``shape`` computed directly in ``call`` is an attention of its own
    rather than more heads of ``a``: ``a``'s last part came from the same call with the same
    shape, over several heads (``[batch, heads, q, k]``, heads > 1), and ``a`` is no differential
    attention (whose two softmaxes are its parts)."""
    return (
        call is not None
        and shape is not None
        and len(shape) == 4
        and shape[1] > 1
        and a.diff_lambda is None
        and a.caller is call
        and a.last_shape == shape
    )


def is_other_module(a: Attention, call: Call | None, shape: tuple[int, ...] | None) -> bool:
    """Whether a softmax of ``shape`` over several heads (``[batch, heads, q, k]``, heads > 1)
    computed in ``call`` is another attention module's than ``a``'s last part, which had the
    same shape: a second attention inside one sublayer (MobileViT's inner transformer layers, a
    language model run whole inside one module), not more heads of ``a``. Per-head modules
    (``[batch, q, k]`` or one head each) are parts of one attention and are not this."""
    return (
        call is not None
        and a.caller is not None
        and shape is not None
        and len(shape) == 4
        and shape[1] > 1
        and a.diff_lambda is None
        and a.last_shape == shape
        and a.caller.module is not call.module
    )


def join(previous: Attention, new: Attention, module: Any) -> None:
    """Put ``new`` in ``previous``'s group of streams and name every member's kind."""
    group = previous.streams if previous.streams is not None else [previous]
    group.append(new)
    n = len(group)
    lilt = n == 2 and hasattr(module, "layout_query")
    for i, a in enumerate(group):
        a.streams = group
        a.kind = LILT_KINDS[i] if lilt else STREAM_MARK.format(i=i + 1, n=n)


def distinct_streams(kinds: list[str | None]) -> bool:
    """Whether attentions of one module, with these kinds, are that module's distinct softmaxes."""
    return all(
        k is not None and " of " in k and "that one call of this module computes" in k for k in kinds
    ) and len(set(kinds)) == len(kinds)
