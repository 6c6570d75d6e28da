"""Pictures as inputs: PIL images, numpy arrays and image files, turned into the model's keyword
tensors by the user's processor (a transformers image processor or processor, called as
``processor(images=..., return_tensors="pt")``, the way users already call it).

Files are read with Pillow (matplotlib's own dependency) and converted to RGB; an unreadable or
corrupt file, an empty list or a processor that fails on the pictures is one clear line.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from probe.errors import ProbeError

SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}


def _is_image(x: Any) -> bool:
    if isinstance(x, (str, Path)):
        return Path(x).suffix.lower() in SUFFIXES
    if type(x).__module__.startswith("PIL."):
        return True
    if type(x).__module__ != "numpy" or getattr(x, "ndim", 0) not in (2, 3):
        return False
    # [H, W, C] with C a colour count, or a grey [H, W] of floats or bytes (not a 2-D array of ids)
    if x.ndim == 3:
        return x.shape[-1] in (1, 3, 4)
    return x.dtype.kind in "fb" or x.dtype.str.endswith("u1")


def is_images(inputs: Any, files: bool = True) -> bool:
    """Whether ``inputs`` is a picture (a PIL image, an ``[H, W(, C)]`` numpy array, an image file
    path unless ``files=False``: a string may as well be a text) or a non-empty list of them."""
    items = inputs if isinstance(inputs, (list, tuple)) else [inputs]
    ok = (lambda x: _is_image(x) and not isinstance(x, (str, Path))) if not files else _is_image
    return bool(items) and all(ok(x) for x in items)


def _open(x: Any, i: int) -> Any:
    from PIL import Image, UnidentifiedImageError

    if isinstance(x, (str, Path)):
        path = Path(x)
        if not path.is_file():
            raise ProbeError(f"image {i}: no such file {str(path)!r}")
        try:
            with Image.open(path) as img:
                return img.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ProbeError(f"image {i}: cannot read {str(path)!r} as a picture ({why})") from None
    if type(x).__module__ == "numpy":
        if x.size == 0:
            raise ProbeError(f"image {i}: an empty array; give [height, width] or [height, width, channels]")
        return x
    return x


def load_images(inputs: Any, start: int = 0) -> list[Any]:
    """The pictures of ``inputs`` (see :func:`is_images`), files opened as RGB PIL images; errors
    number them from ``start`` (a corpus run opens its pictures one at a time)."""
    items = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    return [_open(x, start + i) for i, x in enumerate(items)]


def process(processor: Any, images: list[Any]) -> Mapping:
    """``processor(images=images, return_tensors="pt")``, its failure said in one line."""
    if not callable(processor):
        raise ProbeError(
            f"processor= should be a transformers (image) processor, not {type(processor).__name__}"
        )
    try:
        out = processor(images=images, return_tensors="pt")
    except Exception as e:  # the processor is the user's library: say what failed and the way out
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ProbeError(
            f"the processor {type(processor).__name__} failed on the images ({why}); give the processor "
            "that belongs to the model"
        ) from None
    if not isinstance(out, Mapping) or "pixel_values" not in out:
        raise ProbeError(f"the processor {type(processor).__name__} returned no pixel_values for the images")
    return out


def pictures_seen(pixel_values: Any, processor: Any = None) -> list[str]:
    """Each picture as the model saw it, a base64 PNG at the processed size: ``pixel_values``
    ``[batch, 3, H, W]`` back through the processor's normalisation (``image_mean``/``image_std``;
    crops and resizes included, since these are the model's own pixels), or scaled per picture
    to [0, 1] when the normalisation is unknown. Empty when the pixels are not 1 or 3 channels."""
    import base64
    import io

    import torch
    from PIL import Image

    x = pixel_values.detach().float().cpu()
    if x.dim() != 4 or x.shape[1] not in (1, 3):
        return []
    mean, std = getattr(processor, "image_mean", None), getattr(processor, "image_std", None)
    if mean is not None and std is not None and len(mean) == len(std) == x.shape[1]:
        x = x * torch.tensor(std).view(1, -1, 1, 1) + torch.tensor(mean).view(1, -1, 1, 1)
    else:
        lo = x.amin(dim=(1, 2, 3), keepdim=True)
        x = (x - lo) / (x.amax(dim=(1, 2, 3), keepdim=True) - lo).clamp(min=1e-12)
    out = []
    for img in (x.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy():
        buf = io.BytesIO()
        Image.fromarray(img.squeeze(-1) if img.shape[-1] == 1 else img).save(buf, format="PNG")
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


def image_names(inputs: Any) -> list[str]:
    """What each picture is called in the cache: a file's name, else ``image i``."""
    items = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    return [Path(x).name if isinstance(x, (str, Path)) else f"image {i}" for i, x in enumerate(items)]


__all__ = ["image_names", "is_images", "load_images", "pictures_seen", "process"]
