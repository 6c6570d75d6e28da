"""Keyword inputs: a dict of tensors (a processor's ``BatchFeature`` among them) handed to the
forward as it is (:func:`prepare_kwargs`): what pictures (:mod:`probe.capture.inputs.pictures`)
and sound (:mod:`probe.capture.inputs.sound`) become too. The metadata (:func:`inputs_metadata`)
records the keys, the pixel input's shape (an image
model's positions are named from it after the forward, :mod:`probe.capture.positions.patches`) and, when
the inputs hold ``input_ids``, their tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from probe.capture.inputs.audio import audio_metadata
from probe.capture.inputs.checks import check_keyword_tensors
from probe.capture.inputs.images import pictures_seen
from probe.capture.inputs.prepared import Prepared, device_of, forward_params, is_hf_model, model_name
from probe.capture.inputs.tokenizers import adapt
from probe.capture.inputs.transcript import decoder_metadata
from probe.capture.positions.pictures import picture_layout
from probe.errors import ProbeError


def inputs_metadata(model: nn.Module, kwargs: Mapping, tokenizer: Any = None) -> dict[str, Any]:
    """What the cache records of keyword inputs: their names; the pixels' shape and the pictures
    as the model saw them (``[batch, C, H, W]``), another pixel layout's shape, Qwen2-VL's
    ``image_grid_thw``; the token ids, their display tokens and the attention mask."""
    meta: dict[str, Any] = {"input_kind": "inputs", "input_keys": list(kwargs)}
    pixels, thw = kwargs.get("pixel_values"), kwargs.get("image_grid_thw")
    layout = picture_layout(pixels, thw)  # the pixels' layout (positions/pictures.py)
    if layout is not None:
        meta.update(layout.record(pixels, thw))
        if layout.seen:  # each picture (each tile) as the model saw it
            meta["image_png"] = pictures_seen(pixels)  # the processor's normalisation unknown: scaled
    elif isinstance(pixels, Tensor):
        meta["pixel_shape"] = list(pixels.shape)  # a layout probe does not name: positions numbered
    ids = kwargs.get("input_ids")
    if isinstance(ids, Tensor) and ids.dim() == 2 and not ids.is_floating_point():
        raw_tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        rows = ids.tolist()
        if raw_tok is not None:
            meta["tokens"] = [adapt(raw_tok).tokens_of(r) for r in rows]
        else:
            meta["tokens"] = [[str(i) for i in r] for r in rows]
        meta["ids"] = rows
        mask = kwargs.get("attention_mask")
        full = isinstance(mask, Tensor) and mask.shape == ids.shape
        meta["attention_mask"] = (mask if full else torch.ones_like(ids)).long().tolist()
    meta.update(audio_metadata(kwargs, model=model))  # sound: its frames' times are named after the forward
    meta.update(decoder_metadata(model, kwargs, tokenizer))  # decoder_input_ids: the target tokens
    return meta


def prepare_kwargs(model: nn.Module, inputs: Mapping, tokenizer: Any = None) -> Prepared:
    """A dict of keyword inputs (``pixel_values``, ``input_ids``, masks, grids; a processor's
    ``BatchFeature``), handed to the forward as they are, moved to the model's device."""
    name = model_name(model)
    if not inputs:
        raise ProbeError(f"an empty dict of inputs; give the keyword tensors {name}'s forward takes")
    params, var_kw = forward_params(model)
    # a transformers forward's **kwargs are attention flags: a misspelt input would vanish there
    open_ended = var_kw and not is_hf_model(model)
    unknown = [k for k in inputs if not isinstance(k, str) or (k not in params and not open_ended)]
    if unknown:
        raise ProbeError(
            f"{name}'s forward takes no {', '.join(map(repr, unknown))}; it takes {', '.join(params)}"
        )
    device = device_of(model)
    kwargs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in inputs.items()}
    if not any(isinstance(v, Tensor) for v in kwargs.values()):
        raise ProbeError(f"no tensor among the inputs {', '.join(kwargs)}; give the model's keyword tensors")
    check_keyword_tensors(model, kwargs, name)
    meta = inputs_metadata(model, kwargs, tokenizer)
    if "use_cache" in params and "use_cache" not in kwargs:
        kwargs["use_cache"] = False

    def run() -> Any:
        try:
            return model(**kwargs)
        except ProbeError:  # probe's own (a ValueError too): already one line
            raise
        except ValueError as e:  # the model's own check of its inputs (an image of the wrong size)
            why = str(e).strip().splitlines()[0] if str(e).strip() else "ValueError"
            raise ProbeError(
                f"{name} refused these inputs ({why}); check that they (or the processor that made "
                f"them) belong to the model: its forward takes {', '.join(params)}"
            ) from None

    return Prepared(run, meta)


__all__ = ["inputs_metadata", "prepare_kwargs"]
