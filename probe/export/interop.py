"""A cache in the shapes BertViz and CircuitsVis take, and their views written as HTML files.

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

import json
import os
from pathlib import Path
from typing import Any

import torch

from probe.cache.axes import is_encoder_decoder
from probe.errors import ProbeError
from probe.files import write_text_atomic

HTML_VIEWS = ("head", "model")
_INSTALL = "install it with `pip install -c constraints.txt -e '.[interop]'`"


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


# -- HTML files --------------------------------------------------------------------------------------
def _escape_json_line(html: str, marker: str) -> str:
    """Make the JSON that follows ``marker`` (up to the end of its line) safe inside <script>:
    ``<`` as ``\\u003c`` and U+2028/9 escaped, so no token can close the script or inject markup."""
    i = html.index(marker) + len(marker)
    j = html.find("\n", i)
    j = len(html) if j < 0 else j
    safe = html[i:j].replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    return html[:i] + safe + html[j:]


def _document(title: str, body: str, note: str) -> str:
    from html import escape

    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{escape(title)}</title>\n</head>\n<body>\n<!-- {escape(note)} -->\n"
        f"{body}\n</body>\n</html>\n"
    )


def _title(cache) -> str:
    model = (cache.metadata.get("model") or {}).get("name") or "model"
    return f"{model}: attention"


def bertviz_html(cache, *, view: str = "head", batch: int = 0) -> str:
    """BertViz's ``head_view`` or ``model_view`` of text ``batch`` as a complete HTML page.

    The page is BertViz's own: when opened it loads require.js, d3 and jQuery from
    cdnjs.cloudflare.com, so it needs an internet connection (probe's report does not)."""
    if view not in HTML_VIEWS:
        raise ProbeError(f"view must be 'head' or 'model', not {view!r}")
    try:
        import bertviz
    except ImportError:
        raise ProbeError(f"writing a BertViz view needs the bertviz package; {_INSTALL}") from None
    show = bertviz.head_view if view == "head" else bertviz.model_view
    html = show(**bertviz_inputs(cache, batch), html_action="return").data
    html = _escape_json_line(html, "const params = ")
    note = f"BertViz {view}_view made by probe; it loads its scripts from cdnjs.cloudflare.com"
    return _document(_title(cache), html, note)


def circuitsvis_html(
    cache, *, stack: str | None = None, layers: list[int] | None = None, batch: int = 0
) -> str:
    """CircuitsVis's ``attention_heads`` of text ``batch`` as a complete HTML page that works
    offline (CircuitsVis's own script is inlined)."""
    try:
        from circuitsvis.attention import attention_heads
    except ImportError:
        raise ProbeError(f"writing a CircuitsVis view needs the circuitsvis package; {_INSTALL}") from None
    rendered = attention_heads(**circuitsvis_inputs(cache, stack=stack, layers=layers, batch=batch))
    html = _escape_json_line(rendered.local_src, "CircuitsVis.AttentionHeads,\n")
    return _document(_title(cache), html, "CircuitsVis attention_heads made by probe; works offline")


def write_html(path: str | os.PathLike, text: str) -> Path:
    """Write an HTML view to ``path`` atomically (a ``.html`` name is expected); returns the path."""
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ProbeError(f"{path}: give an .html file name for the view")
    return write_text_atomic(path, text)


def params_json(html: str, marker: str) -> Any:
    """The JSON value a view page carries right after ``marker`` (BertViz: ``"const params = "``,
    CircuitsVis: ``"CircuitsVis.AttentionHeads,\n"``): what the page will draw, for checking it."""
    i = html.index(marker) + len(marker)
    return json.JSONDecoder().raw_decode(html[i:].lstrip())[0]


__all__ = [
    "bertviz_inputs",
    "circuitsvis_inputs",
    "bertviz_html",
    "circuitsvis_html",
    "write_html",
    "params_json",
    "HTML_VIEWS",
]
