"""What the pages draw, as plain data for the templates: coloured grids, a histogram in SVG, and
texts with the positions and keys of an example marked."""

from __future__ import annotations

import html
import json
import math
from typing import Any

from matplotlib import colormaps

from probe.report.labels import display

WINDOW = 12  # tokens kept on each side of a marked token when a text is shown in part
SHOWN_WHOLE = 240  # texts up to this many tokens are shown whole


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def colour(v: float, lo: float, hi: float) -> tuple[str, str]:
    """``(background, text colour)`` of ``v`` on viridis between ``lo`` and ``hi`` (grey for NaN)."""
    if not _finite(v):
        return "#d9d9d9", "#555555"
    t = 0.5 if hi <= lo else min(1.0, max(0.0, (v - lo) / (hi - lo)))
    r, g, b, _ = colormaps["viridis"](t)
    light = 0.299 * r + 0.587 * g + 0.114 * b > 0.55
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}", "#111111" if light else "#ffffff"


def fmt(v: Any, digits: int = 3) -> str:
    """A number as the pages print it (``nan`` for a missing one)."""
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.{digits}g}" if abs(v) >= 1000 else f"{v:.{digits}f}"
    return "" if v is None else str(v)


def grid_view(layers: list[int], heads: list[int], cells: dict, href: Any, titles: Any = None) -> dict:
    """Rows of coloured cells (``href(layer, head)`` each cell's link), with the colour scale."""
    vals = [v for v in cells.values() if _finite(v)]
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
    rows = []
    for layer in layers:
        row = []
        for head in heads:
            v = cells.get((layer, head), math.nan)
            bg, fg = colour(v, lo, hi)
            title = titles(layer, head) if titles else f"layer {layer} head {head}: {fmt(v)}"
            row.append({"layer": layer, "head": head, "value": fmt(v, 2), "bg": bg, "fg": fg,
                        "href": href(layer, head), "title": title})  # fmt: skip
        rows.append({"layer": layer, "cells": row})
    scale = [colour(lo + (hi - lo) * i / 10, lo, hi)[0] for i in range(11)]
    return {"heads": heads, "rows": rows, "lo": fmt(lo), "hi": fmt(hi), "scale": scale}


def histogram_svg(dist: dict, mark: float | None = None, width: int = 480, height: int = 120) -> str:
    """An SVG bar chart of ``dist`` (from ``Explorer.distribution``) with ``mark`` (the mean) drawn."""
    bins, lo, hi = dist["bins"], dist["lo"], dist["hi"]
    if not dist["n"]:
        return '<p class="note">no text has a value of this statistic for this head</p>'
    top = max(bins) or 1
    bw = width / len(bins)
    bars = []
    for i, c in enumerate(bins):
        h = (height - 20) * c / top
        x0 = lo + (hi - lo) * i / len(bins)
        x1 = lo + (hi - lo) * (i + 1) / len(bins)
        bars.append(
            f'<rect x="{i * bw:.1f}" y="{height - 20 - h:.1f}" width="{max(bw - 1, 1):.1f}" height="{h:.1f}">'
            f"<title>{fmt(x0)} to {fmt(x1)}: {c} texts</title></rect>"
        )
    if mark is not None and _finite(mark) and hi > lo:
        x = width * (mark - lo) / (hi - lo)
        bars.append(f'<line class="mean" x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="{height - 20}"></line>')
    labels = (
        f'<text x="0" y="{height - 4}">{html.escape(fmt(lo))}</text>'
        f'<text x="{width}" y="{height - 4}" text-anchor="end">{html.escape(fmt(hi))}</text>'
    )
    return (
        f'<svg class="hist" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="distribution over texts">{"".join(bars)}{labels}</svg>'
    )


def _piece(token: str) -> str:
    """A token as running text: whitespace kept, an empty or whitespace-only token made visible."""
    if token == "" or token.strip() == "" and "\n" not in token:
        return display(token, None)
    return token.replace("\n", "↵\n").replace("\t", "⇥")


def _shown(n: int, marked: set[int]) -> list[int | None]:
    """The token indices to show (None: an elision): all of a short text, else windows around ``marked``."""
    if n <= SHOWN_WHOLE:
        return list(range(n))
    if not marked:
        return [*range(SHOWN_WHOLE), None]
    keep = sorted({j for m in marked for j in range(m - WINDOW, m + WINDOW + 1) if 0 <= j < n})
    out: list[int | None] = []
    for a, b in zip([-2, *keep], keep, strict=False):
        if b != a + 1:
            out.append(None)
        out.append(b)
    if keep[-1] < n - 1:
        out.append(None)
    return out


def shade(w: float) -> int:
    """The shade class (0-10) of an attention weight: tenths, rounded up (0 only for 0)."""
    return 0 if not w > 0 else min(10, math.ceil(w * 10))


def tokens_view(tokens: list[str], example: dict | None) -> dict:
    """The text's tokens with an example marked: ``pieces`` (``i``, ``text``, ``cls``, ``alpha``:
    the largest weight a shown position puts on it) and ``data`` (JSON for the page's script:
    each position's keys, weights and targets)."""
    per: dict[int, tuple] = {}
    weight: dict[int, float] = {}
    target: set[int] = set()
    if example:
        for q, ks, ws, ts in zip(
            example["positions"], example["keys"], example["weights"], example["targets"], strict=True
        ):
            per[q] = (ks, ws, ts)
            for k, w in zip(ks, ws, strict=True):
                weight[k] = max(weight.get(k, 0.0), w)
            target.update(ts)
    pieces = []
    for i in _shown(len(tokens), set(per) | set(weight) | target):
        if i is None:
            pieces.append({"i": -1, "text": " … ", "cls": "gap", "alpha": 0})
            continue
        cls = ["tok"] + (["q"] if i in per else []) + (["tgt"] if i in target else [])
        level = shade(weight.get(i, 0.0))
        cls += [f"a{level}"] if level else []
        pieces.append(
            {"i": i, "text": _piece(tokens[i]), "cls": " ".join(cls), "alpha": round(weight.get(i, 0.0), 3)}
        )
    data = {str(q): {"k": v[0], "w": [round(w, 4) for w in v[1]], "t": v[2]} for q, v in per.items()}
    return {"pieces": pieces, "data": json.dumps(data, separators=(",", ":"))}


__all__ = ["colour", "fmt", "grid_view", "histogram_svg", "shade", "tokens_view"]
