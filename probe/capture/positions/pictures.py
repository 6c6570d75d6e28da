"""Which picture layout: one :class:`PictureLayout` per kind of pixel input, asked in one place.

A model's pixels come in one of three layouts, each named by its own module:

* :class:`PatchGrid`: ``pixel_values`` ``[batch, C, H, W]``, one patch grid per picture
  (ViT, CLIP, LLaVA; :mod:`~probe.capture.positions.patches`), the metadata's ``image_shape``;
* :class:`Tiles`: ``[batch, images, C, H, W]``, pictures cut into tiles, each pixel-shuffled
  into merged tokens (Idefics3, SmolVLM; :mod:`~probe.capture.positions.tiles`), the
  metadata's ``tiles``;
* :class:`MergedGrids`: ``image_grid_thw``, each picture at its own size, ``m x m`` patches
  merged into one token (Qwen2-VL; :mod:`~probe.capture.positions.merged`).

:func:`picture_layout` picks the layout of a forward's inputs, :func:`layout_of` the layout a
cache's metadata records; each layout then says what the metadata records of the pixels
(:meth:`PictureLayout.record`), names the positions after a capture
(:meth:`PictureLayout.positions`) and lays a generation's prompt
(:meth:`PictureLayout.prompt`). A new layout of pixels is one new class here and its module.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from probe.cache.format import parse_key
from probe.capture.calls import LayerRecord
from probe.capture.positions.merged import lay_pictures, merge_config, merged_grids, merged_positions
from probe.capture.positions.patches import image_positions, name_positions, text_image_positions
from probe.capture.positions.tiles import lay_tiles, tile_metadata, tile_positions


class PictureLayout:
    """One layout of pixel inputs (see the module docstring). ``key``: the metadata field that
    says a cache holds it; ``seen``: whether its pixels are pictures a person can be shown
    (``image_png``)."""

    key: str = ""
    seen: bool = False

    def fits(self, pixels: Any, thw: Any) -> bool:
        """Whether a forward's ``pixel_values`` and ``image_grid_thw`` are in this layout."""
        raise NotImplementedError

    def record(self, pixels: Any, thw: Any) -> dict[str, Any]:
        """What the cache metadata records of the pixel inputs, before the forward."""
        raise NotImplementedError

    def positions(
        self, meta: dict[str, Any], model: nn.Module, records: list[LayerRecord], stack_of: dict[str, str]
    ) -> dict[str, dict[str, Any]]:
        """Per stack, what its positions are, named after a capture (labels into ``meta``)."""
        raise NotImplementedError

    def prompt(
        self,
        model: nn.Module,
        meta: dict[str, Any],
        tensors: dict[str, Tensor],
        inputs: dict,
        prompt: list[int],
        token: int,
    ) -> dict[str, Any] | None:
        """A generation's prompt ids (``token``: the image token) laid on the pictures' grids
        (``{"kinds", "grids", "labels"}``), the vision tower's stack named in ``meta`` where the
        layout has one; None where they cannot be laid exactly."""
        raise NotImplementedError

    def prompt_record(self, inputs: dict) -> dict[str, Any]:
        """What a generation's cache metadata records of its prompt's pixels."""
        return {}


class MergedGrids(PictureLayout):
    key = "image_grid_thw"

    def fits(self, pixels: Any, thw: Any) -> bool:
        return isinstance(thw, Tensor) and thw.dim() == 2 and thw.shape[-1] == 3

    def record(self, pixels: Any, thw: Any) -> dict[str, Any]:
        shape = {"pixel_shape": list(pixels.shape)} if isinstance(pixels, Tensor) else {}
        return shape | {"image_grid_thw": thw.tolist()}  # each picture's (frames, rows, cols) of patches

    def positions(self, meta, model, records, stack_of):
        return merged_positions(meta, model, records, stack_of)

    def prompt(self, model, meta, tensors, inputs, prompt, token):
        mc = merge_config(model)
        grids = merged_grids(inputs["image_grid_thw"].tolist(), *mc) if mc is not None else None
        got = lay_pictures(prompt, token, grids) if grids else None
        return got[0] if got is not None and got[1] == len(grids) else None

    def prompt_record(self, inputs: dict) -> dict[str, Any]:
        return {"image_grid_thw": inputs["image_grid_thw"].tolist()}


class Tiles(PictureLayout):
    key = "tiles"
    seen = True

    def fits(self, pixels: Any, thw: Any) -> bool:
        return isinstance(pixels, Tensor) and pixels.dim() == 5

    def record(self, pixels: Any, thw: Any) -> dict[str, Any]:
        # Idefics3's [batch, images, C, H, W]: which slots the vision tower runs
        return {"pixel_shape": list(pixels.shape)} | tile_metadata(pixels)

    def positions(self, meta, model, records, stack_of):
        return tile_positions(meta, model, records, stack_of)

    def prompt(self, model, meta, tensors, inputs, prompt, token):
        pixels = inputs["pixel_values"]
        shape = list(pixels.shape)
        meta.update(self.record(pixels, None))
        n = len(meta["tiles"])
        tower = vision_tower(model, meta, tensors, [n, *shape[2:]])
        got = lay_tiles(model, tower, shape, [prompt], n)[0] if tower is not None else None
        return got[0] if got else None


class PatchGrid(PictureLayout):
    key = "image_shape"
    seen = True

    def fits(self, pixels: Any, thw: Any) -> bool:
        return isinstance(pixels, Tensor) and pixels.dim() == 4

    def record(self, pixels: Any, thw: Any) -> dict[str, Any]:
        return {"image_shape": list(pixels.shape)}

    def positions(self, meta, model, records, stack_of):
        return name_positions(meta, model, records, stack_of)

    def prompt(self, model, meta, tensors, inputs, prompt, token):
        grid = vision_tower(model, meta, tensors, list(inputs["pixel_values"].shape))
        return text_image_positions(prompt, token, grid) if grid is not None else None

    def prompt_record(self, inputs: dict) -> dict[str, Any]:
        return {"image_shape": list(inputs["pixel_values"].shape)}


LAYOUTS: tuple[PictureLayout, ...] = (MergedGrids(), Tiles(), PatchGrid())  # asked in this order


def picture_layout(pixels: Any = None, thw: Any = None) -> PictureLayout | None:
    """The layout of a forward's ``pixel_values`` and ``image_grid_thw``; None for none of them."""
    return next((lay for lay in LAYOUTS if lay.fits(pixels, thw)), None)


def layout_of(meta: dict[str, Any]) -> PictureLayout | None:
    """The layout a cache's metadata records (its ``key`` set); None for a cache without pixels."""
    return next((lay for lay in LAYOUTS if meta.get(lay.key)), None)


def stack_length(tensors: dict[str, Tensor], stack: str) -> int | None:
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


def vision_tower(model: nn.Module, meta: dict[str, Any], tensors: dict[str, Tensor], shape: list[int]) -> Any:
    """The vision tower's positions (``kinds``, ``grid``) named on its stack of a generation's
    cache (the first stack, other than ``encoder``/``decoder``, whose length is the patch grid of
    pixels of ``shape``); its grid, or None."""
    for stack in meta.get("stacks", {}):
        if stack in ("decoder", "encoder"):
            continue
        length = stack_length(tensors, stack)
        pos = image_positions(model, shape, length) if length else None
        if pos is not None:
            meta["stacks"][stack] = dict(
                meta["stacks"][stack], positions={"kinds": pos["kinds"], "grid": pos["grid"]}
            )
            return pos["grid"]
    return None


__all__ = [
    "LAYOUTS",
    "MergedGrids",
    "PatchGrid",
    "PictureLayout",
    "Tiles",
    "layout_of",
    "picture_layout",
    "stack_length",
    "vision_tower",
]
