"""Dynamic, merged image grids: Qwen2-VL's ``image_grid_thw``.

Qwen2-VL (and the models built like it) cuts each picture at its own resolution into ``h x w``
patches of ``patch_size`` pixels (``image_grid_thw``: one ``(t, h, w)`` row per picture, in
patches), runs them through its vision tower, and merges each ``m x m`` block of neighbouring
patches (``spatial_merge_size``) into one token of the language model: a picture becomes
``(h / m) x (w / m)`` image tokens, in row-major order of the merged grid, each covering
``m · patch_size`` pixels square. :func:`merged_positions` lays the language model's image tokens
on those grids, one per picture in the order of ``image_grid_thw``; pictures of different sizes
get grids of different sizes. Where the text's image tokens do not add up to the pictures' merged
grids, it says so (``positions_note``) rather than guess.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from probe.capture.calls import LayerRecord
from probe.capture.positions.grids import attach, lay_text, text_stacks
from probe.capture.positions.patches import image_token_id


def merge_config(model: nn.Module) -> tuple[int, int] | None:
    """``(patch_size, spatial_merge_size)`` of the model's vision tower config, or None."""
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    ps, m = getattr(vision, "patch_size", None), getattr(vision, "spatial_merge_size", None)
    return (int(ps), int(m)) if isinstance(ps, int) and isinstance(m, int) else None


def merged_grids(thw: list[list[int]], patch: int, merge: int) -> list[dict[str, Any]] | None:
    """One grid per picture (``rows``, ``cols``, ``patch`` and ``image`` in pixels; ``offset`` set
    later), or None when a picture is not one frame cut into whole merge blocks."""
    out = []
    for t, h, w in thw:
        if t != 1 or h % merge or w % merge:
            return None
        out.append(
            {
                "rows": h // merge,
                "cols": w // merge,
                "patch": [patch * merge, patch * merge],
                "image": [h * patch, w * patch],
                "offset": 0,
            }
        )
    return out


def lay_pictures(
    ids: list[int], token: int, grids: list[dict[str, Any]]
) -> tuple[dict[str, Any], int] | None:
    """A text's kinds, labels (``img k (r, c)``) and grids, taking pictures from ``grids`` in order
    for each run of image tokens (a run may hold several pictures back to back); ``(row, used)``
    or None when the runs do not add up to whole pictures."""
    row = lay_text(ids, token, lambda k: grids[k] if k < len(grids) else None, unit="img")
    return None if row is None else (row, len(row["grids"]))


def merged_positions(
    meta: dict[str, Any], model: nn.Module, records: list[LayerRecord], stack_of: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Per stack over the text (``ids``), each text's image tokens laid on its pictures' merged
    grids (``{"rows": [...]}``, as :func:`probe.capture.positions.patches.text_image_positions` gives);
    the image tokens' display labels become ``img k (r, c)``. A text's pictures are the next
    rows of ``image_grid_thw`` (texts in batch order)."""
    token, mc, ids = image_token_id(model), merge_config(model), meta.get("ids")
    grids = merged_grids(meta["image_grid_thw"], *mc) if mc is not None else None
    if token is None or grids is None or not ids:
        meta["positions_note"] = (
            "probe could not lay the image tokens on the pictures' merged grids (no image token id, "
            "no vision patch_size/spatial_merge_size, or a picture that is not whole merge blocks)"
        )
        return {}
    rows, used = [], 0
    for text in ids:
        laid = lay_pictures(text, token, grids[used:])
        if laid is None:
            meta["positions_note"] = (
                f"probe could not lay text {len(rows)}'s image tokens on the merged grids of the "
                f"{len(grids)} pictures of image_grid_thw (the runs of image tokens are not whole pictures)"
            )
            return {}
        rows.append(laid[0])
        used += laid[1]
    if used != len(grids):
        meta["positions_note"] = (
            f"the texts hold {used} pictures' image tokens but image_grid_thw has {len(grids)} pictures"
        )
        return {}
    found: dict[str, dict[str, Any]] = {}
    attach(meta, text_stacks(records, stack_of, found, len(ids[0])), found, rows)
    return found


__all__ = ["lay_pictures", "merge_config", "merged_grids", "merged_positions"]
