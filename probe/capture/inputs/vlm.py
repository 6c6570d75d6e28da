"""A vision-language model's processor checked against the model, before the forward runs.

A processor built for another model tokenizes the text with another vocabulary or marks the
pictures with another image token; the model may not notice (an id inside its vocabulary is
just another word) and read the pictures as words. Two things are checked on the processor's
own output, each refused in one line naming the fix:

* every id of ``input_ids`` is inside the model's vocabulary (its input embedding's rows);
* the id the processor's tokenizer gives its image token (``processor.image_token``) is the
  model's ``image_token_id`` (LLaVA's ``image_token_index``).

A picture of a size the vision tower cannot take, or image tokens that are not as many as the
tower's features (a processor with another patch size), are the model's own checks: its
``ValueError`` is the one line :func:`probe.capture.inputs.keywords.prepare_kwargs` turns it into.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from probe.capture.inputs.checks import vocabulary_size
from probe.capture.inputs.processors import tokenizer_of
from probe.capture.positions.patches import image_token_id
from probe.errors import ProbeError


def processor_image_token_id(processor: Any) -> int | None:
    """The id the processor's tokenizer gives its image token, None when it names none."""
    token, tok = getattr(processor, "image_token", None), tokenizer_of(processor)
    if not isinstance(token, str) or tok is None or not hasattr(tok, "convert_tokens_to_ids"):
        return None
    i = tok.convert_tokens_to_ids(token)
    unk = getattr(tok, "unk_token_id", None)
    return int(i) if isinstance(i, int) and i != unk else None


def check_processor(model: nn.Module, processor: Any, batch: Mapping, name: str) -> None:
    """Refuse, in one line, a processor's output the model would misread (see the module
    docstring): ids past the model's vocabulary, another image token id."""
    ids = batch.get("input_ids")
    if not isinstance(ids, Tensor) or ids.numel() == 0:
        raise ProbeError(
            f"the processor {type(processor).__name__} returned no input_ids for the text; give the "
            "vision-language model's own processor"
        )
    vocab = vocabulary_size(model)
    top = int(ids.max())
    if vocab is not None and top >= vocab:
        raise ProbeError(
            f"the processor's tokenizer gives id {top}, past {name}'s vocabulary of {vocab} ids: the "
            "processor is not the model's; give the processor saved with the model"
        )
    mine, theirs = image_token_id(model), processor_image_token_id(processor)
    if mine is not None and theirs is not None and mine != theirs:
        token = processor.image_token
        raise ProbeError(
            f"the processor marks pictures with {token!r} (id {theirs}) but {name} reads id {mine} as "
            "its image token: the processor is not the model's; give the processor saved with the model"
        )


__all__ = ["check_processor", "processor_image_token_id"]
