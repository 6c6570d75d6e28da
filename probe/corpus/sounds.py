"""The sound of a corpus run: a folder of sound files, or sound files, captured through the model's
feature extractor a batch at a time.

Each sound file is one item of the run (what a text is to a text run): its manifest entry records
``"audio"``, the file's path as given (its name, for a folder). ``batch_size`` files at a time are
captured as :func:`probe.capture` takes sound files (``probe.capture(model, paths,
processor=...)``: each file read, resampled to the processor's rate and turned into the model's
features; an encoder-decoder decodes its transcript first, as a capture of sound does), named as
that capture names them. A batch the capture refuses is captured again file by file, and a file
refused alone is recorded as its item's error and skipped.

The per-text store keeps, as a picture run keeps each picture, the picture of what the model heard:
the spectrogram a sound capture records for the report (``metadata["spectrogram_png"]``, see
:mod:`probe.capture.inputs.spectrogram`), scaled down (:mod:`probe.corpus.store`). Statistics
come from whole patterns, one batch at a time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from probe import interrupt
from probe.capture import capture
from probe.capture.inputs.audio import SUFFIXES
from probe.capture.inputs.images import SUFFIXES as PICTURE_SUFFIXES
from probe.corpus.shards import ShardRecord
from probe.errors import ProbeError

EXTENSIONS = tuple(sorted(SUFFIXES))


def _sound_file(x: Any) -> bool:
    return isinstance(x, (str, os.PathLike)) and Path(x).suffix.lower() in SUFFIXES


def sound_inputs(inputs: Any) -> bool:
    """Whether ``inputs`` are sound files: a folder holding sound files and no picture, one sound
    file, or a non-empty list of sound file paths."""
    if isinstance(inputs, (str, os.PathLike)) and Path(inputs).is_dir():
        names = [p.suffix.lower() for p in Path(inputs).iterdir() if p.is_file()]
        return any(s in SUFFIXES for s in names) and not any(s in PICTURE_SUFFIXES for s in names)
    items = inputs if isinstance(inputs, (list, tuple)) else [inputs]
    return bool(items) and all(_sound_file(x) for x in items)


def load_sound_files(inputs: Any) -> tuple[list[Path], list[str]]:
    """``(files, names)``: the sound files (not read yet) and what the manifest calls each: every
    file of a folder whose extension is a sound's (:data:`EXTENSIONS`, any case), sorted by name,
    not its subfolders; or the paths given."""
    if isinstance(inputs, (str, os.PathLike)) and Path(inputs).is_dir():
        found = sorted(
            (p for p in Path(inputs).iterdir() if p.is_file() and _sound_file(p)), key=lambda p: p.name
        )
        if not found:
            raise ProbeError(
                f"{inputs} holds no sound file ({', '.join(EXTENSIONS)}); give a folder of sounds"
            )
        return found, [p.name for p in found]
    items = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    return [Path(x) for x in items], [str(x) for x in items]


def run_sound_shard(
    model,
    processor,
    files: list[Path],
    names: list[str],
    start: int,
    folder: Path,
    settings: tuple,
    store: bool,
) -> dict:
    """Capture one shard's sound files, ``batch_size`` at a time in input order (a batch the capture
    refuses: each file alone), and return its JSON record. ``settings``: ``(keep, batch_size,
    stats, bar, dtype)``; ``store``: also write the per-sound rows (:mod:`probe.corpus.store`)."""
    keep, batch_size, stats, bar, dtype = settings
    rec = ShardRecord(folder, len(files), keep, stats, dtype, start, list(names) if store else None)

    def entry(i: int) -> dict:
        return {"audio": names[i]}

    def run(rows: list[int]):
        return capture(model, [str(files[i]) for i in rows], processor=processor)

    for j in range(0, len(files), batch_size):
        rows = list(range(j, min(len(files), j + batch_size)))
        try:
            caches = [(run(rows), rows)]
        except ProbeError:
            caches = []  # one file failed the batch: each alone, the failing one recorded
            for i in rows:
                try:
                    caches.append((run([i]), [i]))
                except ProbeError as e:  # the capture's message names the file (its "audio 0" dropped)
                    why = str(e).removeprefix("audio 0: ")
                    rec.fail(i, f"sound {start + i} ({names[i]}): {why}", entry(i))
        for cache, got in caches:  # errors past capture are probe's or the disk's: they stop the run
            rec.store(cache, got, [entry(i) for i in got])
        del caches
        bar.update(len(rows))
        interrupt.check()
    return rec.record()


__all__ = ["EXTENSIONS", "load_sound_files", "run_sound_shard", "sound_inputs"]
