"""``--audio PATH`` for ``probe capture`` and ``probe report``: sound files captured through the
model's feature extractor (a ``--hf`` folder's own, ``--processor PATH``, or a zoo speech model's
``processor``), the transcript given with ``--target``."""

from __future__ import annotations

import argparse
from pathlib import Path

from probe.cli import common
from probe.errors import ProbeError


def add_audio_args(p: argparse.ArgumentParser) -> None:
    """``--audio PATH`` (several allowed: one batch); ``--processor`` comes with the image args."""
    p.add_argument(
        "--audio",
        action="append",
        default=None,
        metavar="PATH",
        help="a sound file to capture (WAV, FLAC, OGG, MP3; several = one batch); the transcript "
        "goes in --target; needs the audio extra (soundfile, scipy)",
    )


def check_audio_args(args: argparse.Namespace, texts: list[str]) -> None:
    """Refuse, before any model loads, what does not go with ``--audio``."""
    from probe.capture.inputs.audio import SUFFIXES

    if getattr(args, "image", None):
        raise ProbeError("give --audio or --image, not both")
    if texts:
        raise ProbeError(
            f"--audio takes no TEXT ({texts[0]!r}); give the transcript with --target, or cache files alone"
        )
    for a in args.audio:
        if Path(a).is_dir():
            raise ProbeError(f"--audio {a}: is a directory; give a sound file inside it")
        if not Path(a).is_file():
            raise ProbeError(f"--audio {a}: no such file")
        if Path(a).suffix.lower() not in SUFFIXES:
            raise ProbeError(f"--audio {a}: not a sound file; give {', '.join(sorted(SUFFIXES))}")


def load_audio_model(args: argparse.Namespace):
    """``(model, tokenizer, processor)`` for ``--audio``: a ``--hf`` folder's model with its
    processor (or ``--processor PATH``), the processor refused before the model loads; a zoo
    speech model with its own ``processor`` unless ``--processor`` is given."""
    if getattr(args, "hf", None) or args.processor:
        processor = load_audio_processor(args.processor or args.hf)
        model, tok = common.load_model(args)
        return model, tok or getattr(processor, "tokenizer", None), processor
    model, tok = common.load_model(args)
    processor = getattr(model, "processor", None)
    if processor is None:
        raise ProbeError(
            f"--audio needs a speech model: zoo model {getattr(model, 'name', '?')} reads text; give "
            "--model speech, or --hf PATH with an audio model"
        )
    return model, tok, processor


def load_audio_processor(path: str):
    """The processor (feature extractor and tokenizer) saved in ``path``, else its feature
    extractor alone: a folder with ``preprocessor_config.json``."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not (Path(path) / "preprocessor_config.json").is_file():
        raise ProbeError(
            f"--audio needs the model's feature extractor ({path} has no preprocessor_config.json); "
            "give --processor PATH, a folder where it was saved (save_pretrained)"
        )
    import transformers

    try:
        return transformers.AutoProcessor.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        pass
    try:
        return transformers.AutoFeatureExtractor.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ProbeError(f"--processor {path}: could not load ({str(e).splitlines()[0]})") from None


def capture_audio(args: argparse.Namespace, model, tok, processor, **kw):
    """``probe.capture`` of the ``--audio`` files with ``--target`` as the transcript."""
    import probe

    target = None
    if getattr(args, "target", None) is not None:
        target = args.target if len(args.target) > 1 else args.target[0]
    audio = args.audio if len(args.audio) > 1 else args.audio[0]
    return probe.capture(model, audio, tokenizer=tok, processor=processor, target=target, **kw)


__all__ = ["add_audio_args", "capture_audio", "check_audio_args", "load_audio_model", "load_audio_processor"]
