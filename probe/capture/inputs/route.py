"""Turning what the user passes to ``probe.capture`` into one forward call and its metadata.

:func:`prepare` sends each kind of input to its modality: sound or an audio model's keyword dict
(:mod:`~probe.capture.inputs.sound`), a dict of keyword tensors
(:mod:`~probe.capture.inputs.keywords`), pictures (:mod:`~probe.capture.inputs.pictures`), a
tensor of ids or floats (:mod:`~probe.capture.inputs.tensors`), texts
(:mod:`~probe.capture.inputs.text`). A file name is a text to a model that reads text; to one that
reads pictures or sound (no tokenizer, or a forward that takes them) it is a file to open.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from probe.capture.inputs.audio import is_audio, routes_here
from probe.capture.inputs.checks import SIGNAL_KEYS
from probe.capture.inputs.images import WithText, is_images
from probe.capture.inputs.keywords import prepare_kwargs
from probe.capture.inputs.pictures import prepare_pictures
from probe.capture.inputs.prepared import Prepared, accepts
from probe.capture.inputs.sound import prepare_audio
from probe.capture.inputs.tensors import prepare_tensor
from probe.capture.inputs.text import prepare_text
from probe.errors import ProbeError


def prepare(
    model: nn.Module,
    inputs: Any,
    *,
    tokenizer: Any = None,
    target: Any = None,
    processor: Any = None,
    sampling_rate: Any = None,
) -> Prepared:
    """Build the forward call for ``model`` on ``inputs`` (see :func:`probe.capture`)."""
    if not isinstance(model, nn.Module):
        raise ProbeError(f"probe captures torch.nn.Module models, not {type(model).__name__}")
    # a file name is a text to a model that reads text; to one that reads pictures or sound (no
    # tokenizer, or a forward that takes them), it is a file to open, and said to need processor=
    reads_text = tokenizer is not None or getattr(model, "tokenizer", None) is not None
    sound_file = is_audio(inputs) and (not reads_text or any(accepts(model, k) for k in SIGNAL_KEYS))
    if routes_here(inputs, processor, sampling_rate) or sound_file:
        return prepare_audio(
            model,
            inputs,
            tokenizer=tokenizer,
            target=target,
            processor=processor,
            sampling_rate=sampling_rate,
        )
    picture_file = is_images(inputs) and (not reads_text or accepts(model, "pixel_values"))
    if processor is not None or isinstance(inputs, Mapping) or is_images(inputs, files=False) or picture_file:
        return _keywords_or_pictures(model, inputs, tokenizer, target, processor)
    if isinstance(inputs, Tensor):
        return prepare_tensor(model, inputs, tokenizer)
    return prepare_text(model, inputs, tokenizer, target)


def _keywords_or_pictures(
    model: nn.Module, inputs: Any, tokenizer: Any, target: Any, processor: Any
) -> Prepared:
    """A dict of keyword tensors handed on as it is, or pictures through ``processor``; a
    processor given with a text (:class:`~probe.capture.inputs.images.WithText`) reads it beside
    the pictures."""
    if target is not None:
        raise ProbeError("target= is for texts; with keyword inputs pass decoder_input_ids among them")
    text = None
    if isinstance(processor, WithText):
        processor, text = processor.processor, processor.texts
    if isinstance(inputs, Mapping) and processor is None:
        return prepare_kwargs(model, inputs, tokenizer)
    return prepare_pictures(model, inputs, tokenizer, processor, text)


__all__ = ["prepare"]
