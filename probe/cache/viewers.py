"""A cache in the shapes BertViz and CircuitsVis take: ``Cache.to_bertviz()`` and
``Cache.to_circuitsvis()`` (:mod:`probe.export` re-exports both and writes the viewers' pages).

:func:`bertviz_inputs` gives the keyword arguments of BertViz's ``head_view`` and ``model_view``:
a tuple with one ``[1, heads, query, key]`` float32 tensor per layer plus the tokens, or for an
encoder-decoder ``encoder_attention`` / ``decoder_attention`` / ``cross_attention`` with
``encoder_tokens`` and ``decoder_tokens``. :func:`circuitsvis_inputs` gives those of CircuitsVis's
``attention_heads``: one ``[heads, query, key]`` tensor (the layers' heads one after another),
the tokens, and a name per head (``L0H3``). Both take one text of the cache (``batch``) with its
padding left out, so every row and column is a real token, and both read weights exactly as
cached (converted to float32).

BertViz numbers layers and heads by their position in what it is given, so it needs every layer
from 0 and every head (a cache captured with ``--layers``/``--heads`` is refused rather than shown
with wrong numbers); CircuitsVis shows the head names, so any subset is fine.
"""

from __future__ import annotations

from typing import Any

import torch

from probe.cache.axes import is_encoder_decoder
from probe.errors import ProbeError


def _text_pattern(cache, stack: str, layer: int, kind: str, batch: int) -> torch.Tensor:
    """``[heads, query, key]`` float32 of one text, real tokens only."""
    q, k = cache.axes(stack, kind, batch)
    p = cache.pattern(stack, layer, kind, batch=batch).float()
    return p[:, q.positions][:, :, k.positions]


def _check_text(cache, batch: int) -> None:
    if isinstance(batch, bool) or not isinstance(batch, int) or not 0 <= batch < cache.n_texts:
        raise ProbeError(f"batch {batch!r} is out of range: the cache holds {cache.n_texts} text(s)")


def _all_layers_and_heads(cache, stack: str, kind: str) -> list[int]:
    """The layers of a stack's ``kind`` pattern, when they are 0..n-1 with every head; else a
    one-line error (BertViz would number a subset wrongly)."""
    layers = cache.pattern_layers(stack, kind)
    total = ((cache.metadata.get("stacks") or {}).get(stack) or {}).get("layers", len(layers))
    if layers != list(range(len(layers))) or len(layers) != total:
        raise ProbeError(
            f"BertViz numbers layers by position, and this cache holds layers {layers} of the {stack}'s "
            f"{total}: capture every layer (no --layers) to open it in BertViz, or use --circuitsvis, "
            "which names each head"
        )
    captured = cache.metadata.get("heads_captured")
    if captured is not None and list(captured) != list(range(len(captured))):
        raise ProbeError(
            f"BertViz numbers heads by position, and this cache holds heads {list(captured)}: capture "
            "every head (no --heads) to open it in BertViz, or use --circuitsvis, which names each head"
        )
    return layers


def bertviz_inputs(cache, batch: int = 0) -> dict[str, Any]:
    """Keyword arguments for ``bertviz.head_view`` / ``bertviz.model_view`` of text ``batch``.

    Decoder-only or encoder-only: ``{"attention": (tensor [1, heads, T, T], ...), "tokens":
    [...]}``, one tensor per layer. Encoder-decoder: ``encoder_attention``, ``decoder_attention``
    and ``cross_attention`` (those the cache holds) with ``encoder_tokens`` and
    ``decoder_tokens``. Use: ``head_view(**bertviz_inputs(cache))``.
    """
    _check_text(cache, batch)
    stacks = cache.stacks
    encdec = is_encoder_decoder(cache.metadata, stacks)

    def per_layer(stack: str, kind: str) -> tuple[torch.Tensor, ...]:
        layers = _all_layers_and_heads(cache, stack, kind)
        return tuple(_text_pattern(cache, stack, i, kind, batch)[None] for i in layers)

    if not encdec:
        stack = cache.pattern_stack()
        return {"attention": per_layer(stack, "self"), "tokens": cache.axes(stack, "self", batch)[0].tokens}
    out: dict[str, Any] = {}
    parts = (("encoder_attention", "encoder", "self"), ("decoder_attention", "decoder", "self"))
    for name, stack, kind in (*parts, ("cross_attention", "decoder", "cross")):
        if cache.pattern_layers(stack, kind):
            out[name] = per_layer(stack, kind)
    if not out:
        raise ProbeError("this cache holds no attention patterns; capture a model with probe.capture")
    if "encoder_attention" in out or "cross_attention" in out:  # the source side's tokens
        stack, kind = ("encoder", "self") if "encoder_attention" in out else ("decoder", "cross")
        out["encoder_tokens"] = cache.axes(stack, kind, batch)[1].tokens
    if "decoder_attention" in out or "cross_attention" in out:  # the target side's
        kind = "self" if "decoder_attention" in out else "cross"
        out["decoder_tokens"] = cache.axes("decoder", kind, batch)[0].tokens
    return out


def circuitsvis_inputs(
    cache, *, stack: str | None = None, layers: list[int] | None = None, batch: int = 0
) -> dict[str, Any]:
    """Keyword arguments for ``circuitsvis.attention.attention_heads`` of text ``batch``:
    ``{"attention": tensor [heads, T, T], "tokens": [...], "attention_head_names": ["L0H0", ...]}``
    with the heads of ``layers`` (default: every captured layer) of ``stack``'s self-attention
    (default: the decoder, or the only stack), layer by layer.

    CircuitsVis draws square patterns over one token list, so cross-attention (target queries over
    source keys) has no place here: BertViz (``cross_attention``) or probe's own report shows it.
    """
    _check_text(cache, batch)
    stack = cache.pattern_stack(stack, "self")
    have = cache.pattern_layers(stack, "self")
    if not have:
        raise ProbeError(f"this cache has no self-attention in the {stack} stack")
    layers = have if layers is None else list(layers)
    missing = [i for i in layers if i not in have]
    if missing:
        raise ProbeError(f"layers {missing} are not in this cache's {stack} stack; it has layers {have}")
    blocks, names = [], []
    for i in layers:
        blocks.append(_text_pattern(cache, stack, i, "self", batch))
        names += [f"L{i}H{h}" for h in cache.head_ids(stack, i, "self")]
    tokens = cache.axes(stack, "self", batch)[0].tokens
    return {"attention": torch.cat(blocks), "tokens": tokens, "attention_head_names": names}


__all__ = ["bertviz_inputs", "circuitsvis_inputs"]
