"""Attention on the picture: a query's weights over an image's patch grid, and attention rollout.

A cache of an image model records, per stack, what each position is (``metadata["stacks"][stack]
["positions"]``: kinds and the patch grid, see docs/cache-format.md). :func:`attention_map` reads
one query row of a layer's pattern and lays its weights on the patches over ``[rows, cols]``
(row-major, as the model cut the picture); the class and register columns are left out and the
weights are not renormalised, so a map sums to the share of the query's attention that reached
the picture.

``query="rollout"`` is attention rollout (Abnar & Zuidema 2020): each layer's head-mean weights
mixed half and half with the identity (the residual path), rows renormalised, multiplied from the
first layer up to ``layer``; the map is the class token's row of that product.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from probe.cache.pictures import picture_stacks
from probe.cache.queries import CacheKeyError
from probe.errors import ProbeError


def image_stack(cache: Any, stack: str | None = None) -> tuple[str, dict[str, Any]]:
    """``(stack, positions)`` of the image stack: ``stack`` if given, else the first with a grid."""
    found = [(s, p) for s, p in picture_stacks(cache.metadata) if stack is None or s == stack]
    if found:
        return found[0]
    note = cache.metadata.get("positions_note")
    where = f"the {stack} stack has no" if stack is not None else "no stack of this cache has an"
    raise ProbeError(
        f"{where} image patch grid{f' ({note})' if note else ''}; attention_map needs a capture "
        "of an image model's pixel_values"
    )


def _span(xs: list[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``0-3``; layers with gaps listed (``1, 3``); none -> ``none``."""
    if not xs:
        return "none"
    return f"{xs[0]}-{xs[-1]}" if xs == list(range(xs[0], xs[-1] + 1)) else ", ".join(map(str, xs))


def _check_layer(cache: Any, stack: str | None, layer: Any) -> None:
    """``layer`` an integer from 0 (not an index from the end), said with the stack's layers."""
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise ProbeError(f"layer must be an integer index, not {layer!r}")
    if layer < 0:
        have = cache.layer_indices(stack) if stack in cache.stacks else []
        span = f" (the {stack} stack has layers {_span(have)})" if have else ""
        raise ProbeError(f"layer={layer}: layers count from 0{span}; give one of those")


def _pick_head(rows: Tensor, head: Any, stack: str, layer: int) -> Tensor:
    """Head ``head`` of ``rows`` ``[head, T]`` (negative counts from the last, as in
    :meth:`probe.Cache.pattern`), or the mean over heads when ``head`` is None."""
    if head is None:
        return rows.double().mean(0)
    n = rows.shape[0]
    if isinstance(head, bool) or not isinstance(head, int):
        raise ProbeError(f"head must be an integer index or None (the mean over heads), not {head!r}")
    if not -n <= head < n:
        raise ProbeError(
            f"head={head} is out of range: layer {layer} of the {stack} has {n} heads; choose 0-{n - 1}"
        )
    return rows[head]


def _query_index(query: Any, pos: dict[str, Any]) -> int:
    grid, kinds = pos["grid"], pos["kinds"]
    if query == "cls":
        if "class" not in kinds:
            raise ProbeError(
                "these positions have no class token; give a sequence index or a (row, col) as query"
            )
        return kinds.index("class")
    if isinstance(query, tuple) and len(query) == 2 and all(isinstance(v, int) for v in query):
        r, c = query
        if not (0 <= r < grid["rows"] and 0 <= c < grid["cols"]):
            raise ProbeError(f"patch {query} is outside the {grid['rows']}x{grid['cols']} grid")
        return grid["offset"] + r * grid["cols"] + c
    if isinstance(query, int) and not isinstance(query, bool):
        if not 0 <= query < len(kinds):
            raise ProbeError(f"query {query} is outside the sequence of {len(kinds)} positions")
        return query
    raise ProbeError(f"query must be 'cls', 'rollout', a sequence index or a (row, col) patch, not {query!r}")


def _on_grid(row: Tensor, grid: dict[str, Any]) -> Tensor:
    n = grid["rows"] * grid["cols"]
    return row[..., grid["offset"] : grid["offset"] + n].reshape(*row.shape[:-1], grid["rows"], grid["cols"])


def rollout(cache: Any, layer: int, stack: str, batch: int = 0) -> Tensor:
    """Attention rollout ``[T, T]`` from the first layer up to ``layer`` (see the module docstring)."""
    have = cache.pattern_layers(stack)
    missing = [i for i in range(layer + 1) if i not in have]
    if missing:
        held = _span(have)
        raise ProbeError(
            f"rollout up to layer {layer} multiplies the self-attention of layers 0-{layer}; this cache "
            f"holds the {stack}'s layers {held} (capture every layer up to {layer}, or ask for a lower one)"
        )
    out = None
    for i in range(layer + 1):
        a = cache.pattern(stack, i, batch=batch).double().mean(0)  # [T, T], mean over heads
        a = 0.5 * a + 0.5 * torch.eye(a.shape[-1], dtype=a.dtype)
        a = a / a.sum(-1, keepdim=True)
        out = a if out is None else a @ out
    return out.float()


def image_grid(
    cache: Any, stack: str | None = None, batch: int = 0, image: int = 0
) -> tuple[str, dict[str, Any]]:
    """``(stack, {"kinds", "grid"})``: the image stack (:func:`image_stack`) and the positions of
    picture ``image`` in text ``batch`` (an image model's one grid; a text's own for a
    vision-language model)."""
    stack, pos = image_stack(cache, stack)
    if "rows" not in pos and image != 0:  # an image model: one picture per batch row
        raise ProbeError(
            f"image={image}: the {stack} stack reads one picture per input; choose the picture with batch="
        )
    return stack, (_text_row(pos, batch, image) if "rows" in pos else pos)


def _text_row(pos: dict[str, Any], batch: int, image: int) -> dict[str, Any]:
    """A vision-language stack's positions: text ``batch``'s kinds and the grid of its ``image``."""
    rows = pos["rows"]
    if not 0 <= batch < len(rows):
        raise ProbeError(f"batch {batch} is outside the {len(rows)} texts")
    grids = rows[batch].get("grids")
    if not grids:
        raise ProbeError(
            f"text {batch}'s image positions are not laid on a patch grid in this cache (see its "
            "metadata's positions_note); the share on image tokens is there, a map is not"
        )
    if not 0 <= image < len(grids):
        raise ProbeError(f"image {image}: text {batch} holds {len(grids)} images")
    return {"kinds": rows[batch]["kinds"], "grid": grids[image]}


def attention_map(
    cache: Any,
    layer: int,
    head: int | None = None,
    query: Any = "cls",
    stack: str | None = None,
    batch: int = 0,
    image: int = 0,
    index: int | None = None,
) -> Tensor:
    """What one query of ``layer`` reads of the picture: a ``[rows, cols]`` tensor over the patches.

    ``query``: ``"cls"`` (the class token), a sequence index, a ``(row, col)`` patch, or
    ``"rollout"`` (attention rollout up to ``layer``, read from the class token). ``head=None``
    takes the mean over heads (rollout always does). ``stack`` defaults to the first stack with an
    image grid; a vision-language model's language stack (``stack=`` its name) maps what a text
    position (``query=`` its index) reads of picture ``image`` of text ``batch``. A stack without
    a grid of its own whose cross-attention reads an image stack (DETR's decoder: its object
    queries over the encoder's feature map) maps that cross-attention: ``query=`` an index of its
    queries. A stack whose layers have grids of their own (Swin's stages: ``positions
    ["layer_grids"]``) maps each layer on its own grid, and ``index`` picks one of a layer's several
    attentions (Swin's blocks in a stage). The weights are the stored ones, not renormalised.
    """
    _check_layer(cache, stack or image_stack(cache)[0], layer)
    cross = _cross_source(cache, stack, layer)
    if cross is not None:
        return _cross_map(cache, stack, layer, head, query, cross, batch)
    stack, pos = image_grid(cache, stack, batch, image)
    staged = (pos.get("layer_grids") or {}).get(str(layer))
    if staged is not None:  # this layer's own grid: every position a patch of it
        n = staged["rows"] * staged["cols"]
        pos = {"kinds": ["patch"] * n, "grid": staged}
    if query == "rollout":
        if head is not None:
            raise ProbeError("rollout mixes every head of every layer; leave head=None")
        if pos.get("layer_grids") or staged is not None:
            raise ProbeError(
                "rollout multiplies layers of one sequence; this stack's layers have grids of their own"
            )
        return _on_grid(rollout(cache, layer, stack, batch)[_query_index("cls", pos)], pos["grid"])
    q = _query_index(query, pos)
    rows = _query_rows(cache, stack, layer, q, batch, index)  # [head, T]
    return _on_grid(_pick_head(rows, head, stack, layer).float(), pos["grid"])


def _query_rows(cache: Any, stack: str, layer: int, q: int, batch: int, index: int | None) -> Tensor:
    """Query ``q``'s row of every head ``[head, T]``: from the whole pattern, or from the rows a
    ``keep="rows"`` cache kept (a generation keeps each generated token's row)."""
    try:
        return cache.pattern(stack, layer, batch=batch, index=index)[:, q]
    except CacheKeyError:
        kept = getattr(cache, "kept", None)
        if not (isinstance(kept, dict) and "rows" in kept):
            raise
    kept = cache.row_index(stack, layer, index=index)[batch].tolist()
    if q not in kept:
        raise ProbeError(
            f"query {q}'s row was not kept in this cache (it kept rows {kept[:8]}"
            f"{' ...' if len(kept) > 8 else ''} of text {batch}); ask for one of those, or capture "
            "whole patterns"
        )
    return cache.rows(stack, layer, batch=batch, index=index)[:, kept.index(q)]


def _cross_source(cache: Any, stack: str | None, layer: int) -> dict[str, Any] | None:
    """The grid a cross-attention of ``stack`` reads, when ``stack`` has no grid of its own and
    exactly one other stack has an image grid as long as that cross-attention's keys."""
    stacks = cache.metadata.get("stacks") or {}
    if stack is None or stack not in stacks or (stacks[stack] or {}).get("positions"):
        return None
    if ("cross", None) not in cache.attentions(stack, layer):
        return None
    K = cache.shape(f"{stack}.blocks.{layer}.cross_attn.pattern")[-1]
    grids = [
        p["grid"]
        for s, info in stacks.items()
        if s != stack
        and isinstance(p := (info or {}).get("positions"), dict)
        and "grid" in p
        and len(p["kinds"]) == K
    ]
    return grids[0] if len(grids) == 1 else None


def _cross_map(cache, stack, layer, head, query, grid, batch) -> Tensor:
    if query == "rollout" or query == "cls" or isinstance(query, tuple):
        raise ProbeError(
            f"the {stack} stack reads the picture through cross-attention: give query= the index of "
            "one of its query positions"
        )
    P = cache.pattern(stack, layer, "cross", batch=batch)  # [head, Q, K]
    if not (isinstance(query, int) and not isinstance(query, bool) and 0 <= query < P.shape[1]):
        raise ProbeError(f"query {query!r} is not one of the {P.shape[1]} query positions of {stack}")
    return _on_grid(_pick_head(P[:, query], head, stack, layer).float(), grid)


__all__ = ["attention_map", "image_grid", "image_stack", "rollout"]
