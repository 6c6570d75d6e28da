"""Exports of a cache for other tools: the views of BertViz and CircuitsVis (:mod:`probe.export.interop`).

Reads caches only, like the report; the viewers themselves are optional (``pip install
'probe[interop]'``) and imported only when a page is written.
"""

from probe.export.interop import (
    HTML_VIEWS,
    bertviz_html,
    bertviz_inputs,
    circuitsvis_html,
    circuitsvis_inputs,
    params_json,
    write_html,
)

__all__ = [
    "bertviz_inputs",
    "circuitsvis_inputs",
    "bertviz_html",
    "circuitsvis_html",
    "write_html",
    "params_json",
    "HTML_VIEWS",
]
