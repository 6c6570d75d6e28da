"""The data behind the picture section's hover views (``static/image_hover.js`` draws them).

Two kinds of view, one per picture:

- ``patch``: an image model's stack (or a vision-language model's vision tower) with a patch
  grid; the queries are the tokens that are not patches ([CLS], [DIST], registers), then each
  patch, and a query's map is its row of the layer's pattern over the patches
  (``probe.attention_map(cache, layer, head, (r, c))``, or ``query="cls"``).
- ``text``: a vision-language model's language stack (positions ``{"rows": [...]}``); each real
  text position is a query, and its map is its row over one picture's image tokens
  (``probe.attention_map(cache, layer, head, query=i, stack=..., image=...)``).

Every map is embedded quantised: its maximum and its sum as float32, and its weights as uint8
steps of its own maximum, ``round(w / max * 255)`` (so ``q / 255 * max`` is within ``max / 510``
of the stored weight, and each map is drawn on its own scale, as the figures draw them). A layer
is one deflated, base64 block ``[max f32 x Q][sum f32 x Q][q u8 x Q x P]`` for the mean over heads,
and one block of the same layout per head where the budget allows. The budget (:data:`MAP_CELLS`
quantised weights over the whole report) goes first to the head-mean maps (evenly spaced layers,
the last always, when not all fit), then to every head of the layers from the last down.
"""

from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

MAP_CELLS = 2_000_000  # quantised weights embedded over the whole report (means first, then heads)
MAX_WORDS = 512  # a text view's queries: its last MAX_WORDS words (the earlier ones are shown, not mapped)


@dataclass
class HoverView:
    """One hover view: the queries of one picture, the picture it lays their maps on."""

    kind: str  # "patch" or "text"
    cache: Any
    stack: str
    batch: int  # the batch row of the stack's patterns
    grid: dict[str, Any]
    queries: list[int]  # sequence positions of the queries, in the order the page lists them
    labels: list[str]  # one per query
    layers: list[int]  # every layer holding a pattern
    n_heads: int
    picture: int  # index into the cache's image_png
    label: str
    chips: list[dict[str, Any]] = field(default_factory=list)  # text views: the text beside the picture
    words_left_out: int = 0  # text views: earlier words shown but not mapped (MAX_WORDS)
    mean_layers: list[int] = field(default_factory=list)  # planned by plan()
    head_layers: list[int] = field(default_factory=list)

    @property
    def per_map(self) -> int:
        """Quantised weights of one layer's maps for every query (one head or the mean)."""
        return len(self.queries) * self.grid["rows"] * self.grid["cols"]


PREFIX_LABELS = {"class": "[CLS]", "distillation": "[DIST]"}  # registers read "reg i"


def patch_view(cache: Any, stack: str, pos: dict[str, Any], batch: int, label: str) -> HoverView:
    """The patch view of picture ``batch`` of a stack with one grid (an image model): its queries
    the tokens that are not patches ([CLS], [DIST], registers), shown as chips beside the picture,
    then every patch, row-major."""
    g = pos["grid"]
    n = g["rows"] * g["cols"]
    # a stack whose stages have grids of their own (Swin: positions["layer_grids"]): the layers on this grid
    own = pos.get("layer_grids") or {}
    layers = [i for i in cache.pattern_layers(stack) if own.get(str(i), g) == g]
    inside = range(g["offset"], g["offset"] + n)
    prefix = [i for i, kind in enumerate(pos["kinds"]) if i not in inside]
    labels, regs = [], 0
    for i in prefix:
        kind = pos["kinds"][i]
        labels.append(PREFIX_LABELS.get(kind, f"reg {regs}" if kind == "register" else f"{kind} {i}"))
        regs += kind == "register"
    chips = [
        {"q": q, "t": t, "here": False, "pos": i} for q, (i, t) in enumerate(zip(prefix, labels, strict=True))
    ]
    return HoverView(
        "patch",
        cache,
        stack,
        batch,
        g,
        prefix + list(inside),
        labels,  # the patches' names are made by the page
        layers,
        max((len(cache.head_ids(stack, layer)) for layer in layers), default=0),  # layers may differ
        batch,
        label,
        chips,
    )


def text_views(cache: Any, stack: str, pos: dict[str, Any], texts: int, names: list[str]) -> list[HoverView]:
    """The text views of a vision-language stack: one per picture of each of the first ``texts``
    texts, the text's real text positions the queries, its chips the text with each picture's
    image tokens shown as one chip."""
    from probe.report.labels import display

    out, first = [], 0
    layers = cache.pattern_layers(stack)
    n_heads = max(len(cache.head_ids(stack, layer)) for layer in layers)  # layers may differ
    for b, row in enumerate(pos["rows"]):
        grids = row.get("grids") or []  # a generation's kinds may come without the grids
        if b >= texts:
            break
        base, first = first, first + len(grids)  # the cache's pictures are the texts' in order
        kinds = row["kinds"]
        # the real positions (a padded batch's pads left out) and their tokens, as the text was given
        mask = (cache.metadata.get("attention_mask") or [[1] * len(kinds)] * (b + 1))[b]
        tokens = (
            cache.tokens[b] if cache.tokens and b < len(cache.tokens) else [str(i) for i in range(len(kinds))]
        )
        shown = {p: display(tokens[p], None) for p in range(len(kinds)) if mask[p]}
        words = [p for p in shown if kinds[p] == "text"]
        if not words:
            continue
        queries = words[-MAX_WORDS:]  # a long text: its last words (in a causal model they see the pictures)
        index = {p: i for i, p in enumerate(queries)}
        starts = {g["offset"]: i for i, g in enumerate(grids)}
        for i, g in enumerate(grids):
            chips, p = [], 0
            while p < len(kinds):
                if p in starts:
                    j = starts[p]
                    chips.append({"q": None, "t": f"[picture {j}]", "here": j == i, "pos": None})
                    p += grids[j]["rows"] * grids[j]["cols"]
                    continue
                if p in shown and kinds[p] == "text":
                    chips.append({"q": index.get(p), "t": shown[p], "here": False, "pos": p})
                p += 1
            name = names[base + i] if base + i < len(names) else f"picture {base + i}"
            text = f"text {b}, " if len(pos["rows"]) > 1 else ""
            out.append(
                HoverView(
                    "text",
                    cache,
                    stack,
                    b,
                    g,
                    queries,
                    [shown[q] for q in queries],
                    layers,
                    n_heads,
                    base + i,
                    f"{text}{name}",
                    chips,
                    words_left_out=len(words) - len(queries),
                )
            )
    return out


def _spread(layers: list[int], k: int) -> list[int]:
    """``k`` of ``layers`` evenly spaced, the last always among them."""
    n = len(layers)
    if k >= n:
        return list(layers)
    if k <= 1:
        return [layers[-1]]
    return [layers[i] for i in sorted({round(j * (n - 1) / (k - 1)) for j in range(k)})]


def plan(views: list[HoverView], cells: int | None = None) -> None:
    """Choose each view's embedded layers within ``cells`` quantised weights (default
    :data:`MAP_CELLS`): the head-mean maps first (each view gets an equal share; evenly spaced
    layers when not all fit, at least the last), then every head of a layer, from the last layer
    down, view by view, while they fit."""
    cells = MAP_CELLS if cells is None else cells
    left = cells
    share = cells // max(1, len(views))
    for v in views:
        k = max(1, min(len(v.layers), share // max(1, v.per_map)))
        v.mean_layers = _spread(v.layers, k)
        left -= k * v.per_map
    depth = max((len(v.layers) for v in views), default=0)
    for d in range(1, depth + 1):
        for v in views:
            if d > len(v.layers) or v.n_heads < 2:
                continue
            layer = v.layers[-d]
            need = v.n_heads * v.per_map
            if layer in v.mean_layers and need <= left:
                v.head_layers.append(layer)
                left -= need


def quantise(maps: torch.Tensor) -> bytes:
    """``maps`` ``[Q, P]`` (weights) as ``[max f32 x Q][sum f32 x Q][round(w / max * 255) u8 x Q x P]``."""
    m = maps.double()
    mx = m.amax(-1).clamp(min=0)
    safe = torch.where(mx > 0, mx, torch.ones_like(mx))
    q = (m / safe[:, None] * 255).round().clamp(0, 255)
    q = torch.where(mx[:, None] > 0, q, torch.zeros_like(q))
    head = np.concatenate([mx.numpy().astype("<f4"), m.sum(-1).numpy().astype("<f4")]).tobytes()
    return head + q.to(torch.uint8).numpy().tobytes()


def dequantise(block: bytes, n_queries: int, n_patches: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The inverse of :func:`quantise` after inflating: ``(maps [Q, P] float64, max, sum)``."""
    head = np.frombuffer(block[: 8 * n_queries], dtype="<f4").astype(np.float64)
    mx, total = head[:n_queries], head[n_queries:]
    q = np.frombuffer(block[8 * n_queries :], dtype=np.uint8).reshape(n_queries, n_patches)
    return q / 255.0 * mx[:, None], mx, total


def _block(maps: torch.Tensor) -> str:
    return base64.b64encode(zlib.compress(quantise(maps), 9)).decode("ascii")


def view_data(v: HoverView) -> dict[str, Any]:
    """The JSON-ready description of view ``v`` (after :func:`plan`)."""
    g = v.grid
    n = g["rows"] * g["cols"]
    q = torch.tensor(v.queries)
    layers = []
    for layer in v.mean_layers:
        p = v.cache.pattern(v.stack, layer, batch=v.batch).double()  # [head, T, T]
        sub = p[:, q][:, :, g["offset"] : g["offset"] + n]  # [head, Q, P]
        entry = {"layer": layer, "mean": _block(sub.mean(0)), "heads": None}
        if layer in v.head_layers:
            entry["heads"] = [_block(sub[h]) for h in range(sub.shape[0])]
        layers.append(entry)
    return {
        "kind": v.kind,
        "rows": g["rows"],
        "cols": g["cols"],
        "patch": list(g["patch"]),
        "image": list(g["image"]),
        "labels": v.labels,
        "nPrefix": len(v.queries) - n if v.kind == "patch" else 0,
        "positions": v.queries,
        "nHeads": v.n_heads,
        "layers": layers,
    }


def embedded_bytes(data: dict[str, Any]) -> int:
    """Base64 characters of the maps in one view's data."""
    return sum(len(e["mean"]) + sum(len(h) for h in e["heads"] or []) for e in data["layers"])


__all__ = [
    "HoverView",
    "MAP_CELLS",
    "dequantise",
    "patch_view",
    "plan",
    "quantise",
    "text_views",
    "view_data",
]


def view_script(name: str) -> str:
    """A hover view's script for the page: ``static/layer_views.js`` (the layer and head selection
    every hover view shares; it defines itself once per page) followed by ``static/<name>``."""
    from importlib import resources

    static = resources.files("probe.report").joinpath("static")
    return (
        static.joinpath("layer_views.js").read_text("utf-8") + "\n" + static.joinpath(name).read_text("utf-8")
    )
