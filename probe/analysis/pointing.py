"""The pointing game: does an attention map look at the object?

Zhang et al. (2016) score a saliency map by whether its maximum falls inside the annotated object.
:func:`pointing` plays it on maps over an image's patch grid (:func:`probe.attention_map`): the
patch with the largest weight hits when its centre pixel lies inside the object, and the share
of the map's mass inside the object is each patch's weight times the fraction of its pixels that
are the object's, over the map's total. Objects are boxes ``(x0, y0, x1, y1)`` in input pixels
(x along the columns, a pixel counted when its centre is inside) or boolean masks ``[height,
width]`` at the processed image's resolution.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from probe.analysis.table import Table
from probe.errors import ProbeError


def object_mask(obj: Any, image: tuple[int, int]) -> Tensor:
    """A box ``(x0, y0, x1, y1)`` or a mask as a bool ``[height, width]`` mask of the image."""
    H, W = image
    if type(obj).__module__ == "numpy":  # a dataset's box or mask as an array
        obj = torch.as_tensor(obj)
    if isinstance(obj, Tensor) and obj.dim() == 2:
        if tuple(obj.shape) != (H, W):
            raise ProbeError(f"a mask of {list(obj.shape)} for a {H}x{W} image; give it at the image's size")
        return obj.bool()
    if isinstance(obj, (Sequence, Tensor)) and len(obj) == 4:
        try:
            x0, y0, x1, y1 = (float(v) for v in obj)
        except (TypeError, ValueError):
            raise ProbeError(f"box {tuple(obj)!r}: give four numbers (x0, y0, x1, y1) in pixels") from None
        if not all(math.isfinite(v) for v in (x0, y0, x1, y1)):
            raise ProbeError(
                f"box {(x0, y0, x1, y1)} holds NaN or infinity; give four finite pixel coordinates"
            )
        if not (x0 < x1 and y0 < y1):
            raise ProbeError(f"box {tuple(obj)} is empty; give (x0, y0, x1, y1) with x0 < x1 and y0 < y1")
        ys, xs = torch.arange(H) + 0.5, torch.arange(W) + 0.5
        return ((ys >= y0) & (ys < y1))[:, None] & ((xs >= x0) & (xs < x1))[None, :]
    raise ProbeError(f"an object is a box (x0, y0, x1, y1) or a [height, width] mask, not {obj!r}")


def _cells(n: int, size: int) -> list[tuple[int, int]]:
    return [((i * size) // n, ((i + 1) * size) // n) for i in range(n)]


def inside_fraction(mask: Tensor, rows: int, cols: int) -> Tensor:
    """``[rows, cols]``: the fraction of each patch's pixels that are in ``mask``."""
    H, W = mask.shape
    out = torch.zeros(rows, cols, dtype=torch.float64)
    for r, (y0, y1) in enumerate(_cells(rows, H)):
        for c, (x0, x1) in enumerate(_cells(cols, W)):
            out[r, c] = mask[y0:y1, x0:x1].double().mean()
    return out


def _play(m: Tensor, mask: Tensor) -> tuple[bool, float, tuple[int, int]]:
    rows, cols = m.shape
    H, W = mask.shape
    flat = int(torch.argmax(m.reshape(-1)))
    r, c = divmod(flat, cols)
    centre = (int((r + 0.5) * H / rows), int((c + 0.5) * W / cols))
    total = float(m.double().sum())
    inside = float((m.double() * inside_fraction(mask, rows, cols)).sum())
    return bool(mask[centre]), inside / total if total > 0 else float("nan"), (r, c)


class Pointing:
    """The pointing game over maps and images: ``table`` (a row per map and image: ``hit``,
    ``mass_inside``, the ``peak`` patch) and ``by_map`` (per map: ``images``, ``hits``,
    ``hit_rate``, ``mass_inside`` averaged over the images), best hit rate first."""

    def __init__(self, table: Table):
        self.table = table
        names = list(dict.fromkeys(r["map"] for r in table))
        rows = []
        for n in names:
            mine = [r for r in table if r["map"] == n]
            hits = sum(r["hit"] for r in mine)
            mass = [r["mass_inside"] for r in mine if r["mass_inside"] == r["mass_inside"]]
            rows.append(
                {
                    "map": n,
                    "images": len(mine),
                    "hits": hits,
                    "hit_rate": hits / len(mine),
                    "mass_inside": sum(mass) / len(mass) if mass else float("nan"),
                }
            )
        self.by_map = Table(rows, title="pointing game per map").sorted("hit_rate")

    def __repr__(self) -> str:
        return f"Pointing({len(self.by_map)} maps)\n{self.by_map.to_text()}"

    def _repr_html_(self) -> str:
        return self.by_map._repr_html_()


def pointing(maps: Any, objects: Any, image: tuple[int, int]) -> Pointing:
    """Play the pointing game (see the module docstring).

    ``maps``: a ``[rows, cols]`` map, ``[images, rows, cols]`` maps, or a dict ``{name: map(s)}``
    (for example one per layer and head): finite, non-negative weights (attention), not all zero
    on any image. ``objects``: one box or mask, or one per image. ``image``: the processed image's
    ``(height, width)`` in input pixels (the cache's ``stacks[stack]["positions"]["grid"]
    ["image"]``), at least one pixel per patch: a picture smaller than the map's grid (fewer
    pixel rows than map rows, or columns than columns) is refused, as its patches would hold no
    pixel to be inside or outside the object.
    """
    named = dict(maps) if isinstance(maps, Mapping) else {"map": maps}
    if not named:
        raise ProbeError("no maps given; pass a [rows, cols] map or a dict of them")
    H, W = _image_size(image)
    rows_out = []
    for name, m in named.items():
        stack = _map_stack(name, m)
        if stack.shape[1] > H or stack.shape[2] > W:
            raise ProbeError(
                f"image {(H, W)} is smaller than the {stack.shape[1]}x{stack.shape[2]} grid of map {name!r}: "
                "each patch needs at least one pixel; give the processed image's (height, width)"
            )
        objs = _per_image(objects, stack.shape[0])
        for i, (one, obj) in enumerate(zip(stack, objs, strict=True)):
            if not bool(one.any()):
                raise ProbeError(f"map {name!r} is zero everywhere on image {i}: it points nowhere")
            hit, mass, peak = _play(one, object_mask(obj, image))
            rows_out.append(
                {"map": str(name), "image": i, "hit": hit, "mass_inside": mass, "peak": list(peak)}
            )
    return Pointing(Table(rows_out, title="pointing game"))


def _image_size(image: Any) -> tuple[int, int]:
    ok = isinstance(image, (Sequence, Tensor)) and not isinstance(image, str) and len(image) == 2
    if ok:
        try:
            H, W = (int(v) for v in image)
            ok = H > 0 and W > 0 and all(float(v) == int(v) for v in image)
        except (TypeError, ValueError):
            ok = False
    if not ok:
        raise ProbeError(
            f"image={image!r}: give the processed image's (height, width), two positive integers"
        )
    return H, W


def _map_stack(name: Any, m: Any) -> Tensor:
    """Map ``name`` as ``[images, rows, cols]`` float64, refused where the game has no answer."""
    try:
        m = torch.as_tensor(m).double()
    except (TypeError, ValueError, RuntimeError):
        raise ProbeError(f"map {name!r} is not numbers; give a [rows, cols] tensor of weights") from None
    stack = m.unsqueeze(0) if m.dim() == 2 else m
    if stack.dim() != 3 or stack.numel() == 0:
        raise ProbeError(f"map {name!r} is {list(m.shape)}; give [rows, cols] or [images, rows, cols]")
    if not bool(torch.isfinite(stack).all()):
        raise ProbeError(f"map {name!r} holds NaN or infinite weights; it has no peak to point with")
    if bool((stack < 0).any()):
        raise ProbeError(
            f"map {name!r} holds negative weights; the game scores attention (non-negative): give "
            "m.clamp(min=0) or m.abs() of a signed map"
        )
    return stack


def _per_image(objects: Any, n: int) -> list[Any]:
    if type(objects).__module__ == "numpy":  # a dataset's boxes or masks as an array
        objects = torch.as_tensor(objects)
    if isinstance(objects, Tensor) and objects.dim() == 3:
        items = list(objects)
    elif isinstance(objects, (list, tuple)) and objects and not isinstance(objects[0], (int, float)):
        items = list(objects)
    else:
        items = [objects]
    if len(items) == 1 and n > 1:
        items = items * n
    if len(items) != n:
        raise ProbeError(f"{len(items)} objects for {n} images; give one object, or one per image")
    return items


__all__ = ["Pointing", "inside_fraction", "object_mask", "pointing"]
