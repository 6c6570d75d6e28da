"""Pictures of shapes with known object boxes: the data the zoo's vision transformer learns from.

Each picture is ``size`` x ``size`` RGB pixels in [0, 1]: a textured, noisy background (two random
colours mixed by a blend of stripes at a random angle and frequency and of smooth blotches, then
pixel noise) with one filled shape on it at a random position, size and colour. The class is the
shape and nothing else: backgrounds, colours, positions and sizes are drawn the same way for
every class, so the only way to name the class is to find the object.

    >>> from models import shapes
    >>> batch = shapes.generate(4, seed=0)
    >>> batch.images.shape, batch.labels.shape, batch.boxes.shape, batch.masks.shape
    (torch.Size([4, 3, 64, 64]), torch.Size([4]), torch.Size([4, 4]), torch.Size([4, 64, 64]))
    >>> [shapes.CLASSES[i] for i in shapes.generate(6, seed=1).labels]
    ['square', 'diamond', 'triangle', 'circle', 'cross', 'ring']

``masks[i]`` is the object's pixels (a pixel belongs to the shape when its centre does);
``boxes[i]`` is the tight box around them as ``(x0, y0, x1, y1)`` in pixels, x along the columns,
``x1``/``y1`` one past the last column/row: the convention of :func:`probe.pointing`, whose pixel
counts as inside when its centre is. The object's colour is drawn at least 0.45 (Euclidean, RGB)
away from the mean colour of the background under it, so it is always visible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

CLASSES = ("circle", "square", "triangle", "cross", "ring", "diamond")


@dataclass
class Shapes:
    """A batch of generated pictures: ``images [n, 3, H, W]`` in [0, 1], ``labels [n]`` (indices
    into :data:`CLASSES`), ``boxes [n, 4]`` ``(x0, y0, x1, y1)`` and ``masks [n, H, W]`` (bool)."""

    images: Tensor
    labels: Tensor
    boxes: Tensor
    masks: Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def shape_masks(labels: Tensor, cx: Tensor, cy: Tensor, r: Tensor, size: int) -> Tensor:
    """``[n, size, size]`` bool: shape ``labels[i]`` centred at ``(cx[i], cy[i])`` (pixels) with
    half-size ``r[i]``; a pixel is in when its centre ``(x + 0.5, y + 0.5)`` is."""
    c = torch.arange(size, dtype=torch.float32) + 0.5
    dx = c.view(1, 1, -1) - cx.view(-1, 1, 1)  # [n, 1, W]
    dy = c.view(1, -1, 1) - cy.view(-1, 1, 1)  # [n, H, 1]
    r = r.view(-1, 1, 1)
    ax, ay = dx.abs(), dy.abs()
    dist = torch.sqrt(dx**2 + dy**2)
    every = torch.stack(
        [
            dist <= r,  # circle
            (ax <= 0.8 * r) & (ay <= 0.8 * r),  # square
            (dy >= -r) & (dy <= 0.75 * r) & (ax <= 0.6 * (dy + r)),  # triangle, apex up
            ((ax <= 0.3 * r) & (ay <= r)) | ((ay <= 0.3 * r) & (ax <= r)),  # cross
            (dist <= r) & (dist >= 0.55 * r),  # ring
            ax + ay <= 1.1 * r,  # diamond
        ],
        dim=1,
    )  # [n, classes, H, W]
    return every[torch.arange(len(labels)), labels]


def boxes_of(masks: Tensor) -> Tensor:
    """``[n, 4]`` tight boxes ``(x0, y0, x1, y1)`` around each mask (x1, y1 exclusive)."""
    n, H, W = masks.shape
    cols, rows = masks.any(1), masks.any(2)  # [n, W], [n, H]
    xs, ys = torch.arange(W), torch.arange(H)
    x0 = torch.where(cols, xs, W).amin(1)
    x1 = torch.where(cols, xs, -1).amax(1) + 1
    y0 = torch.where(rows, ys, H).amin(1)
    y1 = torch.where(rows, ys, -1).amax(1) + 1
    return torch.stack([x0, y0, x1, y1], dim=1)


def backgrounds(n: int, size: int, g: torch.Generator, contrast: float = 0.5) -> Tensor:
    """``[n, 3, size, size]`` textured backgrounds: two colours mixed by stripes and blotches, the
    second within ``contrast / 2`` of the first in each channel."""
    a = torch.rand(n, 3, 1, 1, generator=g)
    b = (a + contrast * (torch.rand(n, 3, 1, 1, generator=g) - 0.5)).clamp(0, 1)
    angle = torch.rand(n, 1, 1, generator=g) * math.pi
    freq = 2 * math.pi * (1 + 5 * torch.rand(n, 1, 1, generator=g)) / size
    phase = 2 * math.pi * torch.rand(n, 1, 1, generator=g)
    c = torch.arange(size, dtype=torch.float32)
    along = c.view(1, 1, -1) * torch.cos(angle) + c.view(1, -1, 1) * torch.sin(angle)
    stripes = 0.5 + 0.5 * torch.sin(freq * along + phase)  # [n, H, W]
    blotches = F.interpolate(
        torch.rand(n, 1, 5, 5, generator=g), size=(size, size), mode="bicubic", align_corners=False
    )[:, 0].clamp(0, 1)
    w = torch.rand(n, 1, 1, generator=g)  # how much stripes vs blotches
    t = (w * stripes + (1 - w) * blotches).unsqueeze(1)
    return a * (1 - t) + b * t


def generate(
    n: int,
    *,
    size: int = 64,
    seed: int = 0,
    noise: float = 0.06,
    min_size: float = 7.0,
    max_size: float = 15.0,
) -> Shapes:
    """``n`` pictures (see the module docstring), the same for the same arguments.

    Labels cycle through a random permutation of the classes per block of ``len(CLASSES)``
    pictures, so every class is equally frequent; half-sizes are uniform in [``min_size``,
    ``max_size``] pixels and the object lies wholly inside the picture.
    """
    g = torch.Generator().manual_seed(seed)
    k = len(CLASSES)
    blocks = -(-n // k)
    labels = torch.cat([torch.randperm(k, generator=g) for _ in range(blocks)])[:n]
    r = min_size + (max_size - min_size) * torch.rand(n, generator=g)
    cx = r + (size - 2 * r) * torch.rand(n, generator=g)
    cy = r + (size - 2 * r) * torch.rand(n, generator=g)
    masks = shape_masks(labels, cx, cy, r, size)
    images = backgrounds(n, size, g)
    # the object's colour: random, pushed away from the background it covers
    m = masks.unsqueeze(1).float()
    under = (images * m).sum((2, 3)) / m.sum((2, 3)).clamp(min=1)  # [n, 3]
    colour = torch.rand(n, 3, generator=g)
    for _ in range(8):
        near = (colour - under).norm(dim=1) < 0.45
        if not near.any():
            break
        colour = torch.where(near[:, None], torch.rand(n, 3, generator=g), colour)
    near = (colour - under).norm(dim=1) < 0.45
    colour = torch.where(near[:, None], (under < 0.5).float(), colour)  # the far corner: always visible
    images = torch.where(masks.unsqueeze(1), colour.view(n, 3, 1, 1), images)
    images = (images + noise * torch.randn(images.shape, generator=g)).clamp(0, 1)
    return Shapes(images, labels, boxes_of(masks), masks)


def to_pil(image: Tensor):
    """One ``[3, H, W]`` picture in [0, 1] as an RGB PIL image."""
    from PIL import Image

    arr = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(arr)


__all__ = ["CLASSES", "Shapes", "backgrounds", "boxes_of", "generate", "shape_masks", "to_pil"]
