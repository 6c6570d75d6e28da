"""The pictures of a vision-language generation: which positions of the sequence the model read
are image tokens, on which patch grid, as :func:`probe.capture` names them for one forward.

The model's ``generate`` runs the vision tower on its own (positional pixels, before the first
forward of the language model), so the stepped capture sees no pixel inputs beside the text.
:func:`name_pictures` names the positions afterwards from the prompt's own inputs: the tower's
patches from the pixels' shape (:func:`probe.capture.positions.patches.image_positions`, checked against
the tower's captured length) and the prompt's image tokens laid on that grid
(:func:`~probe.capture.positions.patches.text_image_positions`), on the merged grids of Qwen2-VL's
``image_grid_thw`` (:mod:`probe.capture.positions.merged`), or on Idefics3's tiles, each pixel-shuffled
into merged tokens (:mod:`probe.capture.positions.tiles`). The generated positions are text. Where the
grid cannot be laid exactly, ``metadata["positions_note"]`` says so and only the kinds are kept.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from probe.cache.format import parse_key
from probe.capture.engine.assemble import rename_stack
from probe.capture.inputs.images import pictures_seen
from probe.capture.positions.merged import lay_pictures, merge_config, merged_grids
from probe.capture.positions.patches import image_positions, image_token_id, text_image_positions
from probe.capture.positions.tiles import lay_tiles, tile_metadata


def _length(tensors: dict[str, Tensor], stack: str) -> int | None:
    """The positions a stack read: its residual stream's, else a pattern's keys."""
    for k, t in tensors.items():
        try:
            s, _layer, name = parse_key(k)
        except ValueError:
            continue
        if s == stack and name == "resid_pre" and t.dim() == 3:
            return int(t.shape[1])
    for k, t in tensors.items():
        if k.startswith(stack + ".") and k.endswith(".pattern") and t.dim() == 4:
            return int(t.shape[-1])
    return None


def _tower(model: nn.Module, meta: dict[str, Any], tensors: dict[str, Tensor], shape: list[int]) -> Any:
    """The vision tower's positions (``kinds``, ``grid``) named on its stack; its grid, or None."""
    for stack in meta.get("stacks", {}):
        if stack in ("decoder", "encoder"):
            continue
        length = _length(tensors, stack)
        pos = image_positions(model, shape, length) if length else None
        if pos is not None:
            meta["stacks"][stack] = dict(
                meta["stacks"][stack], positions={"kinds": pos["kinds"], "grid": pos["grid"]}
            )
            return pos["grid"]
    return None


def _labels(grids: list[dict[str, Any]], n: int) -> list[str | None]:
    """The display label of each of ``n`` positions: ``patch (r, c)`` (``img k (r, c)`` with
    several pictures) on the grids, None elsewhere."""
    labels: list[str | None] = [None] * n
    for g, at in enumerate(grids):
        name = f"tile {at['tile']}" if "tile" in at else "patch" if len(grids) == 1 else f"img {g}"
        for k in range(at["rows"] * at["cols"]):
            if at["offset"] + k < n:
                labels[at["offset"] + k] = f"{name} ({k // at['cols']}, {k % at['cols']})"
    return labels


def as_decoder(tensors: dict[str, Tensor], meta: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A capture of a vision-language model's whole sequence (``keep="stats"`` of a generation)
    names its language stack by module path; the stack that generated is called ``decoder`` in
    a generation's cache, as the stepped capture calls it. Other models: unchanged."""
    stacks = meta.get("stacks") or {}
    text = [s for s, v in stacks.items() if (v.get("positions") or {}).get("rows")]
    if "decoder" in stacks or len(text) != 1:
        return tensors, meta
    old = text[0]
    tensors = {("decoder" + k[len(old) :] if k.startswith(old + ".") else k): v for k, v in tensors.items()}
    meta = rename_stack(meta, old, "decoder")
    if "stats" in meta:  # the statistics name each attention "stack/layer/kind"
        meta["stats"] = _renamed_keys(meta["stats"], old + "/", "decoder/")
    return tensors, meta


def _renamed_keys(x: Any, old: str, new: str) -> Any:
    if isinstance(x, dict):
        return {
            (new + k[len(old) :] if k.startswith(old) else k): _renamed_keys(v, old, new)
            for k, v in x.items()
        }
    if isinstance(x, list):
        return [_renamed_keys(v, old, new) for v in x]
    return x


def name_pictures(
    model: nn.Module,
    meta: dict[str, Any],
    tensors: dict[str, Tensor],
    inputs: dict[str, Any],
    read: list[int],
    prompt_length: int,
    processor: Any = None,
) -> None:
    """Name, in ``meta``, the pictures of a generation whose prompt ``inputs`` held
    ``pixel_values`` (see the module docstring); ``read``: the ids of the sequence the decoder
    read, the first ``prompt_length`` of them the prompt. Does nothing without pixels."""
    pixels, token = inputs.get("pixel_values"), image_token_id(model)
    P = prompt_length
    if not isinstance(pixels, Tensor) or token is None or token not in read[:P]:
        return
    shape = list(pixels.shape)
    thw = inputs.get("image_grid_thw")
    laid = None
    named = ((meta["stacks"]["decoder"].get("positions") or {}).get("rows") or [{}])[0]
    if named.get("grids") and len(named["kinds"]) == len(read):  # a capture of the sequence named them
        laid = {"kinds": named["kinds"][:P], "grids": named["grids"], "labels": _labels(named["grids"], P)}
    elif isinstance(thw, Tensor):  # Qwen2-VL: each picture at its own size, merged patches
        mc = merge_config(model)
        grids = merged_grids(thw.tolist(), *mc) if mc is not None else None
        got = lay_pictures(read[:P], token, grids) if grids else None
        laid = got[0] if got is not None and got[1] == len(grids) else None
    elif len(shape) == 5:  # Idefics3, SmolVLM: tiles, pixel-shuffled into merged tokens
        meta.update(tile_metadata(pixels), pixel_shape=shape)
        n = len(meta["tiles"])
        tower = _tower(model, meta, tensors, [n, *shape[2:]])
        got = lay_tiles(model, tower, shape, [read[:P]], n)[0] if tower is not None else None
        laid = got[0] if got else None
    else:
        grid = _tower(model, meta, tensors, shape) if len(shape) == 4 else None
        laid = text_image_positions(read[:P], token, grid) if grid is not None else None
    if isinstance(thw, Tensor):
        meta["image_grid_thw"] = thw.tolist()
    elif len(shape) == 4:
        meta["image_shape"] = shape
    if len(shape) in (4, 5):
        meta["image_png"] = pictures_seen(pixels, processor)  # each picture (each tile)
    if laid is None:
        meta["positions_note"] = (
            f"probe could not lay the prompt's image tokens on the pictures' patch grid (pixels "
            f"{shape}): the generated words' maps over the picture are not given, their share on "
            "image tokens is"
        )
        return
    N = len(read) - P
    decoder = dict(meta["stacks"]["decoder"].get("positions") or {})
    decoder["rows"] = [{"kinds": laid["kinds"] + ["text"] * N, "grids": laid["grids"]}]
    meta["stacks"]["decoder"] = dict(meta["stacks"]["decoder"], positions=decoder)
    if meta.get("tokens"):
        labels = laid["labels"] + [None] * N
        meta["tokens"] = [[lab or t for lab, t in zip(labels, meta["tokens"][0], strict=True)]]


__all__ = ["as_decoder", "name_pictures"]
