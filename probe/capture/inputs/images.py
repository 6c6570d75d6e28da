"""Pictures as inputs: PIL images, numpy arrays and image files, turned into the model's keyword
tensors by the user's processor (a transformers image processor or processor, called as
``processor(images=..., return_tensors="pt")``, the way users already call it).

A vision-language model reads the pictures beside a text: its processor (``LlavaProcessor``,
``PaliGemmaProcessor``, ...) is called ``processor(images=..., text=..., return_tensors="pt")``
and places the image tokens in the text itself. Before it runs, the count of the processor's
image token (``processor.image_token``) in the texts is checked against the pictures.

Files are read with Pillow (matplotlib's own dependency) and converted to RGB; an unreadable or
corrupt file, an empty list or a processor that fails on the pictures is one clear line.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from probe.capture.inputs.processors import image_processor_of, tokenizer_of
from probe.capture.positions.tiles import real_tiles
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
        if path.is_dir():
            raise ProbeError(f"image {i}: {str(path)!r} is a directory; give a picture file inside it")
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
        if x.dtype.kind not in "biuf":
            raise ProbeError(f"image {i}: an array of {x.dtype}; give pixels as uint8 (0-255) or floats")
        _check_finite(x, i)
        return x
    if 0 in getattr(x, "size", (1, 1)):  # a PIL image: (width, height)
        raise ProbeError(f"image {i}: a {x.size[0]}x{x.size[1]} picture has no pixels; give a picture")
    if getattr(x, "mode", None) == "F":  # PIL's one float mode may hold NaN
        import numpy as np

        _check_finite(np.asarray(x), i)
    return x


def _check_finite(x: Any, i: int) -> None:
    """A float picture with NaN or infinite values refused: the attention it gives is NaN."""
    import numpy as np

    if x.dtype.kind == "f" and not np.isfinite(x).all():
        bad = int(x.size - np.isfinite(x).sum())
        raise ProbeError(
            f"image {i}: {bad} of its {x.size} values are NaN or infinite; give finite pixel values"
        )


def not_pictures(inputs: Any) -> str:
    """What in ``inputs`` is not a picture (:func:`is_images`), said for a one-line error."""
    if isinstance(inputs, (list, tuple)) and not inputs:
        return f"an empty {type(inputs).__name__}: give at least one picture"
    items = inputs if isinstance(inputs, (list, tuple)) else [inputs]
    i, x = next(((i, x) for i, x in enumerate(items) if not _is_image(x)), (0, items[0]))
    where = f"item {i} of the {type(inputs).__name__} is " if isinstance(inputs, (list, tuple)) else "got "
    if isinstance(x, Mapping):
        what = f"a {type(x).__name__} of keyword tensors: pass it without processor="
    elif isinstance(x, (str, Path)):
        what = f"{str(x)!r}, not a picture file ({', '.join(sorted(SUFFIXES))})"
    elif type(x).__name__ == "Tensor":
        what = "a tensor: give pixels as {'pixel_values': tensor} without processor="
    elif type(x).__module__ == "numpy" and hasattr(x, "shape"):
        what = (
            f"a {x.dtype} array of shape {list(x.shape)}: give [height, width, channels] (1, 3 or 4 "
            "channels) or a grey [height, width] of uint8 or floats"
        )
    else:
        what = f"of type {type(x).__name__}"
    return where + what


def load_images(inputs: Any, start: int = 0) -> list[Any]:
    """The pictures of ``inputs`` (see :func:`is_images`), files opened as RGB PIL images; errors
    number them from ``start`` (a corpus run opens its pictures one at a time)."""
    items = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    return [_open(x, start + i) for i, x in enumerate(items)]


def texts_of(text: Any) -> list[str]:
    """``text=`` as a list of texts: one string, or a non-empty list of strings."""
    texts = [text] if isinstance(text, str) else text
    if not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(t, str) for t in texts):
        raise ProbeError(
            f"text= takes a text or a list of texts to read beside the pictures, not {type(text).__name__}"
        )
    return list(texts)


class WithText:
    """A vision-language model's processor and the text(s) it reads beside the pictures: what
    ``probe.capture(model, pictures, processor=proc, text=...)`` hands the capture as its
    processor (:func:`with_text`)."""

    def __init__(self, processor: Any, texts: list[str]):
        self.processor, self.texts = processor, texts


def with_text(processor: Any, text: Any) -> Any:
    """``processor`` unchanged when ``text`` is None, else a :class:`WithText` (a text read beside
    pictures needs a processor; the text checked here, one line when it is not one)."""
    if text is None:
        return processor
    if processor is None:
        raise ProbeError(
            "text= is read beside pictures: give the pictures and processor= (the vision-language "
            "model's processor); for a text alone pass it as the inputs"
        )
    return WithText(processor, texts_of(text))


def _image_tokens_error(processor: Any, texts: list[str], n: int, failed: bool) -> ProbeError | None:
    """The texts should hold one image token (``processor.image_token``) per picture, in the
    order the pictures are given, or none at all where the processor places them itself
    (PaliGemma's puts them before the text): the error when they do not (with none, only once
    the processor has ``failed``), else None."""
    token = getattr(processor, "image_token", None)
    if not isinstance(token, str) or not token:
        return None
    found = sum(t.count(token) for t in texts)
    if found == n or (found == 0 and not failed):
        return None
    return ProbeError(
        f"the text{'s hold' if len(texts) > 1 else ' holds'} {found or 'no'} {token!r} token"
        f"{'s' if found > 1 else ''} for {n} picture{'s' if n != 1 else ''}; put one {token!r} "
        "where each picture goes, the pictures in the order of their tokens"
    )


def process(processor: Any, images: list[Any], text: list[str] | None = None) -> Mapping:
    """``processor(images=images, return_tensors="pt")`` (and ``text=``, the texts padded to one
    batch, for a vision-language model's processor), its failure said in one line."""
    if not callable(processor):
        raise ProbeError(
            f"processor= should be a transformers (image) processor, not {type(processor).__name__}"
        )
    kwargs: dict[str, Any] = {}
    if text is not None:
        if tokenizer_of(processor) is None:
            raise ProbeError(
                f"text= needs a vision-language processor (one with a tokenizer); "
                f"{type(processor).__name__} reads pictures only"
            )
        error = _image_tokens_error(processor, text, len(images), failed=False)
        if error is not None:
            raise error
        kwargs = {"text": text if len(text) > 1 else text[0], "padding": True}
    try:
        out = processor(images=images, return_tensors="pt", **kwargs)
    except Exception as e:  # the processor is the user's library: say what failed and the way out
        error = _image_tokens_error(processor, text, len(images), failed=True) if text else None
        if error is not None:
            raise error from None
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        what = "the images" if text is None else "the pictures and text"
        raise ProbeError(
            f"the processor {type(processor).__name__} failed on {what} ({why}); give the processor "
            "that belongs to the model"
        ) from None
    if not isinstance(out, Mapping) or "pixel_values" not in out:
        raise ProbeError(f"the processor {type(processor).__name__} returned no pixel_values for the images")
    return out


def pictures_seen(pixel_values: Any, processor: Any = None) -> list[str]:
    """Each picture as the model saw it, a base64 PNG at the processed size: ``pixel_values``
    ``[batch, 3, H, W]`` (Idefics3's ``[batch, images, 3, H, W]``: each tile the vision tower
    runs) back through the processor's normalisation (``image_mean``/``image_std``;
    crops and resizes included, since these are the model's own pixels), or scaled per picture
    to [0, 1] when the normalisation is unknown. Empty when the pixels are not 1 or 3 channels."""
    import base64
    import io

    import torch
    from PIL import Image

    x = pixel_values.detach().float().cpu()
    if x.dim() == 5:  # Idefics3's [batch, images, C, H, W]: the tiles the vision tower runs
        x = x.flatten(0, 1)[real_tiles(x).flatten()]
    if x.dim() != 4 or x.shape[1] not in (1, 3):
        return []
    images = image_processor_of(processor)  # a vision-language processor's own
    mean, std = getattr(images, "image_mean", None), getattr(images, "image_std", None)
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


__all__ = [
    "WithText",
    "image_names",
    "is_images",
    "load_images",
    "not_pictures",
    "pictures_seen",
    "process",
    "texts_of",
    "with_text",
]
