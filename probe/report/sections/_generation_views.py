"""The data behind the generation section's hover views (``static/generation_hover.js`` draws them).

A view is one text's output as chips: hover (tap, or Tab to) a generated token and every token it
could read is shaded by its weight. ``self``: the stack that generated, its keys the prompt and
the output before the token (``probe.lookback``'s rows); ``cross``: an encoder-decoder's
cross-attention, its keys the source tokens (the alignment as it was written). Each layer is a
block ``[steps, keys]`` of the rows that wrote the tokens, quantised as in the picture section
(:func:`probe.report.sections._image_hover.quantise`: a float32 maximum and sum per row, then
``round(w / max * 255)`` as uint8), deflated and base64'd: the head mean, and each head where the
budget allows (:data:`CELLS` quantised weights over the report: every layer's mean first, then
heads from the last layer down). A weight the cache did not keep (a top-k cache's other keys, a
rows cache's rows not kept) is drawn as 0 and the view says so.
"""

from __future__ import annotations

import base64
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from probe.analysis.generation import Steps, writer_rows
from probe.report.labels import display
from probe.report.sections._image_hover import quantise

CELLS = 2_000_000  # quantised weights embedded over the whole section
MAX_STEPS = (
    512  # a view's hoverable tokens: the last MAX_STEPS generated (the earlier ones shown, not mapped)
)


@dataclass
class GenView:
    """One hover view: ``kind`` "self" or "cross", the text's :class:`Steps`, the layers read."""

    kind: str
    cache: Any
    st: Steps
    layers: list[int]
    n_heads: int
    keys: list[int]  # the key positions shown as chips (real positions)
    key_labels: list[str]
    mapped: list[int]  # the generated tokens (steps) that carry maps
    lookback: Any = None  # a probe.Lookback (self views): the ratio per head and step for the readout
    mean_layers: list[int] = field(default_factory=list)
    head_layers: list[int] = field(default_factory=list)

    @property
    def per_map(self) -> int:
        return len(self.mapped) * len(self.keys)


def self_view(cache: Any, st: Steps, layers: list[int], n_heads: int, lb: Any) -> GenView:
    """The view of the generating stack: keys are the real positions of the sequence read."""
    real = [p for p, k in enumerate(st.kinds) if k is not None]
    labels = [display(st.tokens[p], None) for p in real]
    steps = list(range(st.n_steps))[-MAX_STEPS:]
    return GenView("self", cache, st, layers, n_heads, real, labels, steps, lb)


def cross_view(cache: Any, st: Steps, layers: list[int], n_heads: int) -> GenView:
    """The cross-attention view of an encoder-decoder: keys are the source's real tokens."""
    q, k = cache.axes(st.stack, "cross", st.batch)
    steps = list(range(st.n_steps))[-MAX_STEPS:]
    return GenView(
        "cross", cache, st, layers, n_heads, k.positions, [display(t, None) for t in k.tokens], steps
    )


def plan(views: list[GenView], cells: int = CELLS) -> None:
    """Every layer's head mean of each view while it fits (evenly spaced layers, the last always,
    when not all fit), then every head of a layer from the last layer down: the picture views'
    own plan (:func:`probe.report.sections._image_hover.plan`) on these views."""
    from probe.report.sections._image_hover import plan as plan_maps

    plan_maps(views, cells)


def _block(maps: torch.Tensor) -> str:
    return base64.b64encode(zlib.compress(quantise(maps), 9)).decode("ascii")


def _num(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)


def view_data(v: GenView) -> dict[str, Any]:
    """The JSON-ready description of ``v`` (after :func:`plan`)."""
    keys = torch.tensor(v.keys, dtype=torch.long)
    layers, unknown = [], False
    for layer in v.mean_layers:
        r = writer_rows(v.cache, v.st, layer, v.kind, v.mapped)[:, :, keys]  # [H, Q, K]
        unknown = unknown or bool(r.isnan().any())
        r = r.nan_to_num(0.0)
        entry: dict[str, Any] = {"layer": layer, "mean": _block(r.mean(0)), "heads": None}
        if layer in v.head_layers:
            entry["heads"] = [_block(r[h]) for h in range(r.shape[0])]
        if v.lookback is not None:
            li = v.lookback.layers.index(layer)
            ratio = v.lookback.ratio[li][: r.shape[0]][:, v.mapped]  # [H, Q]: the layer's own heads
            with_mean = torch.cat([ratio, ratio.nanmean(0, keepdim=True) if ratio.numel() else ratio[:1]])
            entry["ratio"] = [[_num(float(x)) for x in row] for row in with_mean]
        layers.append(entry)
    st = v.st
    index = {p: i for i, p in enumerate(v.keys)}
    return {
        "kind": v.kind,
        "keys": v.key_labels,
        # where each generated token sits among the chips (self views: its own key chip; the last
        # token, never read, is appended after them), and which key chips it could read
        "out": [display(t, None) for t in st.output],
        "outKey": [index.get(p, -1) for p in [*st.generated, -1]],
        "reach": [index[st.writers[t]] + 1 if v.kind == "self" else len(v.keys) for t in range(st.n_steps)],
        "nPrompt": sum(1 for p in v.keys if p in set(st.prompt)) if v.kind == "self" else 0,
        "mapped": v.mapped,
        "nHeads": v.n_heads,
        "layers": layers,
        "unknownAsZero": unknown,
    }


__all__ = ["CELLS", "GenView", "MAX_STEPS", "cross_view", "plan", "self_view", "view_data"]
