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

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from probe.analysis.table import Table
from probe.errors import ProbeError


def object_mask(obj: Any, image: tuple[int, int]) -> Tensor:
    """A box ``(x0, y0, x1, y1)`` or a mask as a bool ``[height, width]`` mask of the image."""
    H, W = image
    if isinstance(obj, Tensor) and obj.dim() == 2:
        if tuple(obj.shape) != (H, W):
            raise ProbeError(f"a mask of {list(obj.shape)} for a {H}x{W} image; give it at the image's size")
        return obj.bool()
    if isinstance(obj, (Sequence, Tensor)) and len(obj) == 4:
        x0, y0, x1, y1 = (float(v) for v in obj)
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
    (for example one per layer and head). ``objects``: one box or mask, or one per image.
    ``image``: the processed image's ``(height, width)`` in input pixels (the cache's
    ``stacks[stack]["positions"]["grid"]["image"]``).
    """
    named = dict(maps) if isinstance(maps, Mapping) else {"map": maps}
    if not named:
        raise ProbeError("no maps given; pass a [rows, cols] map or a dict of them")
    rows_out = []
    for name, m in named.items():
        m = torch.as_tensor(m)
        stack = m.unsqueeze(0) if m.dim() == 2 else m
        if stack.dim() != 3:
            raise ProbeError(f"map {name!r} is {list(m.shape)}; give [rows, cols] or [images, rows, cols]")
        objs = _per_image(objects, stack.shape[0])
        for i, (one, obj) in enumerate(zip(stack, objs, strict=True)):
            hit, mass, peak = _play(one, object_mask(obj, image))
            rows_out.append(
                {"map": str(name), "image": i, "hit": hit, "mass_inside": mass, "peak": list(peak)}
            )
    return Pointing(Table(rows_out, title="pointing game"))


def _per_image(objects: Any, n: int) -> list[Any]:
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
