"""The pictures modality: PIL images, numpy arrays or image files, through the user's processor.

The pictures are opened and handed to the processor (:mod:`probe.capture.inputs.images`); with a
text read beside them (``text=``: a vision-language model), the processor places the image
tokens in the text and its output is checked against the model first
(:func:`probe.capture.inputs.vlm.check_processor`). The keyword tensors it returns go to the
forward as any keyword inputs do (:func:`probe.capture.inputs.keywords.prepare_kwargs`); the
metadata adds the pictures' names, the prompts and each picture as the model saw it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from probe.capture.inputs.audio import is_sound_processor, not_sound
from probe.capture.inputs.images import (
    image_names,
    is_images,
    load_images,
    not_pictures,
    pictures_seen,
    process,
)
from probe.capture.inputs.keywords import prepare_kwargs
from probe.capture.inputs.prepared import Prepared, model_name
from probe.capture.inputs.processors import pick_tokenizer
from probe.capture.inputs.vlm import check_processor
from probe.errors import ProbeError


def prepare_pictures(
    model: nn.Module, inputs: Any, tokenizer: Any, processor: Any, text: list[str] | None = None
) -> Prepared:
    """Pictures (PIL images, numpy arrays, image files) through ``processor`` to keyword tensors;
    with ``text``, a vision-language processor places the image tokens in the text."""
    name = model_name(model)
    if processor is None:
        raise ProbeError(
            f"pictures need processor= (the image processor of {name}) to become pixel_values; "
            "or give {'pixel_values': tensor}"
        )
    if not is_images(inputs):
        if is_sound_processor(processor):  # a feature extractor given something that is not sound
            raise ProbeError(
                f"processor= ({type(processor).__name__}) reads sound: give a waveform with "
                f"sampling_rate=, a sound file or a list of them; {not_sound(inputs)}"
            )
        raise ProbeError(
            "processor= takes pictures: a PIL image, a numpy array, an image file path, or a list of "
            f"them; {not_pictures(inputs)}"
        )
    if is_sound_processor(processor):
        raise ProbeError(
            f"processor= ({type(processor).__name__}) reads sound, not pictures: give the image "
            f"processor of {name} (an image model's), or sound to an audio model"
        )
    batch = dict(process(processor, load_images(inputs), text))
    if text is not None:
        check_processor(model, processor, batch, name)  # the text's ids and image tokens
        tokenizer = pick_tokenizer(model, tokenizer, processor)
    prepared = prepare_kwargs(model, batch, tokenizer)
    prepared.meta["images"] = image_names(inputs)
    if text is not None:
        prepared.meta["prompts"] = text
    prepared.meta["image_png"] = pictures_seen(batch["pixel_values"], processor)
    return prepared


__all__ = ["prepare_pictures"]
