"""BertViz's and CircuitsVis's views of a cache as HTML pages.

What they draw, :func:`bertviz_inputs` and :func:`circuitsvis_inputs`, is read off the cache by
:mod:`probe.cache.viewers` (re-exported here); this module renders it with the viewers themselves
(optional: the ``interop`` extra) and writes the page.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from probe.cache.viewers import bertviz_inputs, circuitsvis_inputs
from probe.errors import ProbeError
from probe.files import write_text_atomic

HTML_VIEWS = ("head", "model")
_INSTALL = "install it with `pip install -c constraints.txt -e '.[interop]'`"


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
