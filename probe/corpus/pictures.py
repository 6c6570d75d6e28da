"""The pictures of a corpus run: a folder, image files, PIL images or numpy arrays, captured
through the model's image processor a batch at a time.

Each picture is one item of the run (what a text is to a text run): its manifest entry records
``"image"``, the file's path as given (its name, for a folder) or, for a picture in memory, its
index. A picture is opened (:func:`probe.capture.inputs.images.load_images`) and processed alone
(:func:`probe.capture.inputs.images.process`); pictures whose processed tensors have the same shapes are
batched together in input order (a processor that keeps each picture's own size gives a batch per
size), and a batch is captured as the model's keyword inputs (``probe.capture(model,
{"pixel_values": ...})``), named like a capture of the pictures themselves. A picture that cannot
be opened, processed or run is recorded as the item's error and skipped.

A vision-language model reads a text beside each picture (``run_corpus(..., text=...)``: one text
for every picture, or one per picture): each picture is processed with its text
(``processor(images=[picture], text=text)``, the processor placing the image tokens; a processor
that is not the model's refused as :func:`probe.capture.inputs.vlm.check_processor` does), items whose
processed tensors have the same shapes (the same text length) are batched, and the manifest entry
records ``"text"`` beside ``"image"``.

Statistics come from whole patterns, one batch at a time (an image model's sequence is short):
the image metrics ``distance_px``, ``on_class`` and ``on_register`` need each position's kind and
place on the grid, which are named after the forward, so statistics computed while the model runs
(``keep="stats"`` for texts) would leave them out.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from probe import interrupt
from probe.capture import capture
from probe.capture.inputs.images import SUFFIXES, is_images, load_images, pictures_seen, process, texts_of
from probe.capture.inputs.prepared import model_name
from probe.capture.inputs.processors import tokenizer_of
from probe.capture.inputs.vlm import check_processor
from probe.corpus.shards import ShardRecord
from probe.errors import ProbeError

EXTENSIONS = tuple(sorted(SUFFIXES))


def picture_inputs(inputs: Any, processor: Any) -> bool:
    """Whether ``inputs`` are pictures: ``processor`` given, a folder, or PIL images / arrays."""
    if processor is not None:
        return True
    if isinstance(inputs, (str, os.PathLike)):
        return Path(inputs).is_dir()
    return isinstance(inputs, (list, tuple)) and is_images(inputs, files=False)


def load_pictures(inputs: Any) -> tuple[list[Any], list[str | int]]:
    """``(items, names)``: the pictures (files not opened yet) and what the manifest calls each.

    A folder gives every file in it whose extension is an image's (:data:`EXTENSIONS`, any case),
    sorted by name, not its subfolders; a list gives its paths, PIL images and numpy arrays."""
    if isinstance(inputs, (str, os.PathLike)) and Path(inputs).is_dir():
        folder = Path(inputs)
        found = (p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES)
        items = sorted(found, key=lambda p: p.name)
        if not items:
            raise ProbeError(
                f"{folder} holds no image file ({', '.join(EXTENSIONS)}); give a folder of pictures"
            )
        return list(items), [p.name for p in items]
    items = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    if not items:
        raise ProbeError("no pictures given; pass a folder, image files, PIL images or numpy arrays")
    for i, x in enumerate(items):
        if isinstance(x, (str, os.PathLike)):
            if Path(x).suffix.lower() not in SUFFIXES:
                raise ProbeError(
                    f"picture {i}: {str(x)!r} is not an image file name ({', '.join(EXTENSIONS)})"
                )
        elif not is_images([x], files=False):
            raise ProbeError(
                f"picture {i} is a {type(x).__name__}; give image file paths, PIL images or "
                "[height, width(, channels)] numpy arrays"
            )
    names = [str(x) if isinstance(x, (str, os.PathLike)) else i for i, x in enumerate(items)]
    return items, names


def picture_texts(text: Any, n: int) -> list[str] | None:
    """Each picture's text for a vision-language run: ``text`` repeated for every picture, or a
    list of ``n`` texts; None without ``text``."""
    if text is None:
        return None
    if isinstance(text, str):
        return [text] * n
    texts = texts_of(text)
    if len(texts) != n:
        raise ProbeError(
            f"{len(texts)} texts for {n} pictures; give one text for every picture, or one per picture"
        )
    return texts


def pictures_digest(items: list[Any], names: list[str | int]) -> str:
    """What config.json records to recognise the pictures when resuming: each file's name (its path
    as given; in a folder, its name there, so the folder may be named another way) and size (the
    files are not read), each picture in memory's size and pixels."""
    h = hashlib.sha256()
    for x, name in zip(items, names, strict=True):
        if isinstance(x, (str, os.PathLike)):
            p = Path(x)
            size = p.stat().st_size if p.is_file() else -1
            h.update(f"file\x00{name}\x00{size}\x00".encode())
        elif type(x).__module__ == "numpy":
            h.update(f"array\x00{x.shape}\x00{x.dtype}\x00".encode())
            h.update(x.tobytes())
        else:  # a PIL image
            h.update(f"pil\x00{x.mode}\x00{x.size}\x00".encode())
            h.update(x.tobytes())
    return h.hexdigest()


def processor_name(processor: Any) -> str:
    """The processor as config.json records it: its class and, for a transformers processor, a
    digest of its settings (so a resumed run uses the same resize and normalisation)."""
    name = f"{type(processor).__module__}.{type(processor).__qualname__}"
    to_json = getattr(processor, "to_json_string", None)
    if callable(to_json):
        try:
            name += "@" + hashlib.sha256(to_json().encode("utf-8")).hexdigest()[:16]
        except Exception:  # noqa: BLE001 - a settings dump that fails only loses the digest
            pass
    return name


def _signature(out: Mapping) -> tuple:
    """The shapes (past the batch dimension) and dtypes of one picture's processed tensors: pictures
    with the same signature are batched together; non-tensor values must be equal."""
    sig = []
    for k, v in out.items():
        if isinstance(v, torch.Tensor):
            sig.append((k, tuple(v.shape[1:]) if v.dim() else (), str(v.dtype)))
        else:
            sig.append((k, repr(v)))
    return tuple(sig)


def _batch(outs: list[Mapping]) -> dict[str, Any]:
    """One batch of keyword inputs from pictures processed alone: tensors joined on the batch
    dimension (the same signature: the same shapes past it)."""
    first = outs[0]
    return {
        k: torch.cat([o[k] for o in outs]) if isinstance(v, torch.Tensor) and v.dim() else v
        for k, v in first.items()
    }


def run_picture_shard(
    model, processor, items, names, start, folder: Path, settings: tuple, texts=None, store: bool = False
) -> dict:
    """Capture one shard's pictures (batches of one processed size, in input order; ``texts``, one
    per picture, read beside them by a vision-language model) and return its JSON record; memory
    holds at most ``batch_size`` processed pictures per size. ``settings``: ``(keep, batch_size,
    stats, bar, dtype)``; ``store``: also write the per-picture rows (:mod:`probe.corpus.store`)."""
    keep, batch_size, stats, bar, dtype = settings
    sources = [str(n) if texts is None else f"{n}: {texts[i]}" for i, n in enumerate(names)]
    rec = ShardRecord(folder, len(items), keep, stats, dtype, start, sources if store else None)
    pending: dict[tuple, list[tuple[int, Mapping]]] = {}
    tokenizer = tokenizer_of(processor) if texts is not None else None

    def entry(i: int) -> dict:
        return {"image": names[i]} if texts is None else {"image": names[i], "text": texts[i]}

    def label(i: int) -> str:
        name = names[i]
        return f"image {start + i}" + (f" ({name})" if isinstance(name, str) else "")

    def shown(i: int) -> str:  # what the cache calls the picture: its file name, else "image N"
        x = items[i]
        return Path(x).name if isinstance(x, (str, os.PathLike)) else f"image {start + i}"

    def run(rows: list[int], outs: list[Mapping]):
        batch = _batch(outs)
        cache = capture(model, batch, tokenizer=tokenizer)
        cache.metadata["images"] = [shown(i) for i in rows]
        if texts is not None:
            cache.metadata["prompts"] = [texts[i] for i in rows]
        cache.metadata["image_png"] = pictures_seen(batch["pixel_values"], processor)
        return cache

    def flush(sig: tuple) -> None:
        group = pending.pop(sig)
        rows = [i for i, _ in group]
        try:
            caches = [(run(rows, [o for _, o in group]), rows)]
        except ProbeError:
            caches = []  # one picture failed the batch (the model refused it): each alone
            for i, o in group:
                try:
                    caches.append((run([i], [o]), [i]))
                except ProbeError as e:
                    rec.fail(i, f"{label(i)}: {e}", entry(i))
        for cache, got in caches:  # errors past capture are probe's or the disk's: they stop the run
            rec.store(cache, got, [entry(i) for i in got])
        del caches
        bar.update(len(rows))
        interrupt.check()  # a Ctrl-C swallowed inside a __del__ stops the run here (command line)

    for i, x in enumerate(items):
        try:
            picture = load_images([x], start=start + i)  # its error names the file and why
        except ProbeError as e:
            rec.fail(i, str(e), entry(i))
            bar.update(1)
            continue
        try:
            out = dict(process(processor, picture, None if texts is None else [texts[i]]))
            if texts is not None:
                check_processor(model, processor, out, model_name(model))
        except ProbeError as e:
            rec.fail(i, f"{label(i)}: {e}", entry(i))
            bar.update(1)
            continue
        del picture
        sig = _signature(out)
        pending.setdefault(sig, []).append((i, out))
        if len(pending[sig]) == batch_size:
            flush(sig)
    for sig in list(pending):  # the last, partial batch of each size, in the order sizes appeared
        flush(sig)
    return rec.record()


__all__ = [
    "EXTENSIONS",
    "load_pictures",
    "picture_inputs",
    "picture_texts",
    "pictures_digest",
    "processor_name",
    "run_picture_shard",
]
