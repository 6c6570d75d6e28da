"""Pictures cut into tiles: Idefics3's and SmolVLM's ``[batch, images, C, H, W]`` pixels.

Idefics3 (and SmolVLM, built the same way) splits each picture into tiles plus one global view of
the whole picture, and hands the forward ``pixel_values`` of ``[batch, images, C, H, W]``: per
text its tiles, padded with all-zero slots to the batch's longest list. The model drops the
all-zero slots (:func:`real_tiles`) and runs its vision tower over the remaining tiles, one
sequence per tile, in batch-major order; ``pixel_attention_mask`` marks each tile's padded
pixels, whose patches the tower masks as keys. Its connector then merges each ``s x s`` block of
neighbouring patches into one token (``pixel_shuffle`` with the config's ``scale_factor``), and
the merged tokens of tile after tile replace the text's image tokens in order, across the batch.

:func:`tile_positions` names both sides: the vision tower's stack gets each tile's patch grid
(:func:`probe.capture.positions.patches.image_positions`), the text's stack each text's image tokens laid
on their tile's merged grid, each grid naming its ``tile`` (the vision stack's batch index).
Which merged token covers which patches is read off the connector's own ``pixel_shuffle``, run
on the patch indices (:func:`shuffle_blocks`): a connector that does not merge whole row-major
blocks gets no grid, and ``positions_note`` says why.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from probe.capture.calls import LayerRecord
from probe.capture.positions.grids import attach, text_stacks
from probe.capture.positions.patches import image_positions, image_token_id, patch_conv, text_image_positions


def real_tiles(pixels: Tensor) -> Tensor:
    """``[batch, images]`` bools: the slots of 5-D ``pixel_values`` that hold a tile, as
    Idefics3's ``get_image_features`` decides (a slot whose values are all zero is padding; when
    every slot is, it keeps the first, as SmolVLM does)."""
    flat = pixels.detach().flatten(2)
    real = (flat != 0).any(-1)
    if not bool(real.any()):
        real = real.clone()
        real.view(-1)[0] = True
    return real


def tile_metadata(pixels: Any) -> dict[str, Any]:
    """``{"tiles": [[text, slot], ...]}`` for 5-D ``pixel_values``: each tile the vision tower
    runs, in its order (the vision stack's batch); empty for other pixel layouts."""
    if not isinstance(pixels, Tensor) or pixels.dim() != 5:
        return {}
    return {"tiles": real_tiles(pixels).nonzero().tolist()}


def _connector(model: nn.Module) -> tuple[Any, int] | None:
    """``(pixel_shuffle, scale_factor)`` of the model's connector, or None without one."""
    s = getattr(getattr(model, "config", None), "scale_factor", None)
    if not isinstance(s, int) or isinstance(s, bool) or s < 1:
        return None
    for m in model.modules():
        shuffle = getattr(m, "pixel_shuffle", None)
        if callable(shuffle) and not isinstance(m, nn.PixelShuffle):
            return shuffle, s
    return None


def shuffle_blocks(shuffle: Any, rows: int, cols: int, s: int) -> bool:
    """Whether ``shuffle`` (the connector's ``pixel_shuffle(x, scale_factor)``) turns a
    ``rows x cols`` patch grid into the ``rows/s x cols/s`` grid of whole ``s x s`` blocks in
    row-major order: run on the patch indices, merged token ``(I, J)`` must hold exactly the
    patches of rows ``I*s ..`` and columns ``J*s ..``."""
    if rows % s or cols % s:
        return False
    idx = torch.arange(rows * cols, dtype=torch.float64).view(1, rows * cols, 1)
    try:
        out = shuffle(idx, s)
    except (RuntimeError, ValueError):  # Idefics3's reshape takes only a square grid
        return False
    g_rows, g_cols = rows // s, cols // s
    if tuple(out.shape) != (1, g_rows * g_cols, s * s):
        return False
    grid = torch.arange(rows * cols).view(rows, cols)
    for t, got in enumerate(out[0].long()):
        I, J = divmod(t, g_cols)
        want = grid[I * s : (I + 1) * s, J * s : (J + 1) * s].flatten()
        if sorted(got.tolist()) != sorted(want.tolist()):
            return False
    return True


def _self_lengths(r: LayerRecord) -> list[tuple[int, int]]:
    return [(shape[0], shape[3]) for role, _h, shape, *_ in r.patterns if role == "self"]


def tile_positions(
    meta: dict[str, Any], model: nn.Module, records: list[LayerRecord], stack_of: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Per stack, what its positions are (see the module docstring): the vision tower's stack (one
    sequence per tile) gets ``{"kinds", "grid"}``, the text's stack ``{"rows": [...]}`` with
    each text's tiles as grids of merged tokens (``tile``: the vision stack's batch index), and
    the image tokens read ``tile k (r, c)``. What cannot be laid exactly is said in
    ``meta["positions_note"]``."""
    _b, _i, C, H, W = meta["pixel_shape"]
    n_tiles = len(meta["tiles"])
    found: dict[str, dict[str, Any]] = {}
    tower = None
    for r in records:
        s = stack_of[r.container]
        for batch, length in _self_lengths(r):
            if s in found or batch != n_tiles:
                continue
            pos = image_positions(model, [n_tiles, C, H, W], length)
            if pos is not None:
                found[s], tower = pos, pos["grid"]
    if tower is None:
        meta["positions_note"] = (
            f"probe found no vision stack running the {n_tiles} tiles of {H}x{W} pixels as a patch grid"
        )
        return found
    why = _lay_text(meta, model, records, stack_of, tower, found)
    if why:
        meta["positions_note"] = f"probe could not lay the image tokens on the tiles' merged grids: {why}"
    return found


def merged_grid(model: nn.Module, tower: dict[str, Any], pixel_shape: list[int]) -> tuple[Any, str | None]:
    """``(grid, None)``: a tile's grid of merged tokens (each ``s x s`` patches of the tower's
    ``grid``), as the connector's ``pixel_shuffle`` merges them; ``(None, why)`` where it does not
    merge whole row-major blocks."""
    conn = _connector(model)
    if conn is None:
        return None, "the model has no pixel_shuffle connector with an integer scale_factor"
    shuffle, s = conn
    if tower["offset"]:
        return (
            None,
            "the vision tower puts learned tokens before the patches, which the connector would merge",
        )
    if not shuffle_blocks(shuffle, tower["rows"], tower["cols"], s):
        return None, (
            f"its connector's pixel_shuffle does not merge the {tower['rows']}x{tower['cols']} patch "
            f"grid into whole {s}x{s} blocks in row-major order"
        )
    conv = patch_conv(model, pixel_shape[2])
    grid = {
        "rows": tower["rows"] // s,
        "cols": tower["cols"] // s,
        "patch": [int(conv.stride[0]) * s, int(conv.stride[1]) * s],
        "image": list(tower["image"]),
        "offset": 0,
    }
    return grid, None


def lay_tiles(
    model: nn.Module, tower: dict[str, Any], pixel_shape: list[int], ids: list[list[int]], n_tiles: int
) -> tuple[Any, str | None]:
    """``(laid, None)``: each text's positions (``kinds``, ``labels``, ``grids``, each grid naming
    its ``tile``, the vision stack's batch index) with its image tokens on the tiles' merged
    grids, in order across the texts; ``(None, why)`` where they cannot be laid exactly."""
    merged, why = merged_grid(model, tower, pixel_shape)
    if merged is None:
        return None, why
    token = image_token_id(model)
    laid = [text_image_positions(row, token, merged, unit="tile") for row in ids]
    if any(row is None for row in laid):
        n = merged["rows"] * merged["cols"]
        return None, f"a run of image tokens is not a whole number of tiles of {n} merged tokens"
    used = sum(len(row["grids"]) for row in laid)
    if used != n_tiles:
        return None, f"the texts hold {used} tiles' image tokens but the pixels {n_tiles} tiles"
    k = 0
    for row in laid:
        for g in row["grids"]:
            g["tile"], k = k, k + 1
    return laid, None


def _lay_text(
    meta: dict[str, Any],
    model: nn.Module,
    records: list[LayerRecord],
    stack_of: dict[str, str],
    tower: dict[str, Any],
    found: dict[str, dict[str, Any]],
) -> str | None:
    """Lay each text's image tokens on the tiles' merged grids (into ``found``); why not, or None."""
    token, ids = image_token_id(model), meta.get("ids")
    if token is None or not ids:
        return "the model has no image token id, or the inputs no input_ids"
    laid, why = lay_tiles(model, tower, meta["pixel_shape"], ids, len(meta["tiles"]))
    if laid is None:
        return why
    attach(meta, text_stacks(records, stack_of, found, len(ids[0])), found, laid)
    return None


__all__ = ["real_tiles", "shuffle_blocks", "tile_metadata", "tile_positions"]
