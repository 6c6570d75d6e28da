"""The pictures of a vision-language generation: which positions of the sequence the model read
are image tokens, on which patch grid, as :func:`probe.capture` names them for one forward.

The model's ``generate`` runs the vision tower on its own (positional pixels, before the first
forward of the language model), so the stepped capture sees no pixel inputs beside the text.
:func:`name_pictures` names the positions afterwards from the prompt's own inputs, through the
pixels' :class:`~probe.capture.positions.pictures.PictureLayout`: the tower's patches from the
pixels' shape (checked against the tower's captured length) and the prompt's image tokens laid
on that grid, on the merged grids of Qwen2-VL's ``image_grid_thw``, or on Idefics3's tiles, each
pixel-shuffled into merged tokens. The generated positions are text. Where the grid cannot be
laid exactly, ``metadata["positions_note"]`` says so and only the kinds are kept.
:func:`as_decoder` calls the generating stack of a ``keep="stats"`` generation ``decoder``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from probe.capture.engine.assemble import rename_stack
from probe.capture.inputs.images import pictures_seen
from probe.capture.positions.grids import grid_labels, relabel
from probe.capture.positions.patches import image_token_id
from probe.capture.positions.pictures import picture_layout


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
    layout = picture_layout(pixels, inputs.get("image_grid_thw"))
    named = ((meta["stacks"]["decoder"].get("positions") or {}).get("rows") or [{}])[0]
    if named.get("grids") and len(named["kinds"]) == len(read):  # a capture of the sequence named them
        unit = "tile" if all("tile" in g for g in named["grids"]) else None
        laid = {
            "kinds": named["kinds"][:P],
            "grids": named["grids"],
            "labels": grid_labels(P, named["grids"], unit),
        }
    else:
        laid = layout.prompt(model, meta, tensors, inputs, read[:P], token) if layout is not None else None
    if layout is not None:
        meta.update(layout.prompt_record(inputs))
        if layout.seen:
            meta["image_png"] = pictures_seen(pixels, processor)  # each picture (each tile)
    if laid is None:
        meta["positions_note"] = (
            f"probe could not lay the prompt's image tokens on the pictures' patch grid (pixels "
            f"{list(pixels.shape)}): the generated words' maps over the picture are not given, their "
            "share on image tokens is"
        )
        return
    N = len(read) - P
    decoder = dict(meta["stacks"]["decoder"].get("positions") or {})
    decoder["rows"] = [{"kinds": laid["kinds"] + ["text"] * N, "grids": laid["grids"]}]
    meta["stacks"]["decoder"] = dict(meta["stacks"]["decoder"], positions=decoder)
    if meta.get("tokens"):
        meta["tokens"] = [relabel(meta["tokens"][0], laid["labels"] + [None] * N)]


__all__ = ["as_decoder", "name_pictures"]
