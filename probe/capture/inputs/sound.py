"""The sound modality: waveforms, sound files or an audio model's keyword dict, prepared for the forward.

Sound is turned into the model's keyword tensors by the user's processor (or handed raw as
``input_values``: :mod:`probe.capture.inputs.audio`, which also records what each position's time
is computed from); an encoder-decoder's decoder reads the transcript given as ``target=``, or
the model's own greedy decoding (:mod:`probe.capture.inputs.transcript`); the keyword tensors
then go to the forward as any keyword inputs do (:func:`probe.capture.inputs.keywords.prepare_kwargs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from probe.capture.inputs.audio import (
    audio_dict,
    audio_metadata,
    check_channels,
    is_audio,
    not_sound,
    sound_inputs,
)
from probe.capture.inputs.checks import check_keyword_tensors
from probe.capture.inputs.keywords import prepare_kwargs
from probe.capture.inputs.prepared import Prepared, model_name
from probe.capture.inputs.processors import pick_tokenizer
from probe.capture.inputs.transcript import target_inputs
from probe.errors import ProbeError


def prepare_audio(
    model: nn.Module,
    inputs: Any,
    *,
    tokenizer: Any = None,
    target: Any = None,
    processor: Any = None,
    sampling_rate: Any = None,
) -> Prepared:
    """The forward call for sound or an audio model's keyword dict (see :func:`probe.capture`);
    ``target`` (an encoder-decoder's transcript) becomes ``decoder_input_ids``
    (:func:`probe.capture.inputs.transcript.target_inputs`); sound, or a dict of features without
    ``decoder_input_ids``, is decoded greedily without it; a dict with them goes to the forward as
    it is."""
    if audio_dict(inputs):
        kwargs, meta = dict(inputs), {}
    elif not is_audio(inputs):
        raise ProbeError(
            "sampling_rate= is for sound: give a waveform (a 1-D array or tensor), a sound file "
            f"path or a list of them; {not_sound(inputs)}"
        )
    else:
        kwargs, meta = sound_inputs(model, inputs, processor, sampling_rate)
    check_keyword_tensors(model, kwargs, model_name(model))  # before a greedy decoding runs on them
    target_meta = {}
    # an encoder-decoder's decoder inputs: the transcript given, else a greedy one (sound and a
    # dict of features alike); a dict that holds them goes to the forward as it is
    if target is not None or _needs_target(model, kwargs):
        kwargs, target_meta = target_inputs(model, kwargs, target, tokenizer, processor)
    check_channels(model, kwargs)
    prepared = prepare_kwargs(model, kwargs, pick_tokenizer(model, tokenizer, processor))
    prepared.meta.update(audio_metadata(kwargs, processor, meta.get("sampling_rate", sampling_rate), model))
    prepared.meta.update(meta)
    prepared.meta.update(target_meta)
    return prepared


def _needs_target(model: nn.Module, kwargs: Mapping) -> bool:
    cfg = getattr(model, "config", None)
    enc_dec = bool(getattr(cfg, "is_encoder_decoder", False))
    return enc_dec and "decoder_input_ids" not in kwargs and "decoder_inputs_embeds" not in kwargs


__all__ = ["prepare_audio"]
