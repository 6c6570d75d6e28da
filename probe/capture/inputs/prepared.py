"""What every input modality prepares, and what preparing it asks of the model.

A modality (:mod:`~probe.capture.inputs.text`, :mod:`~probe.capture.inputs.keywords`,
:mod:`~probe.capture.inputs.pictures`, :mod:`~probe.capture.inputs.sound`, ...) turns what the
user passed into one :class:`Prepared`: the forward call, ready to run, and the cache metadata
it was made from. The questions they all ask of the model are here, once: its name as a person
knows it, the device it computes on, whether it is a transformers model, and which keywords its
``forward`` takes.
"""

from __future__ import annotations

import inspect
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class Prepared:
    """A ready-to-run forward pass and what it was made from."""

    run: Callable[[], Any]
    meta: dict[str, Any]


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` ``PreTrainedModel`` (without importing transformers)."""
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


def device_of(model: nn.Module) -> torch.device:
    """Where ``model`` computes: the device of its first parameter or buffer (CPU if it has none)."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        return t.device
    return torch.device("cpu")


def model_name(model: nn.Module) -> str:
    """The name a person knows ``model`` by: ``model.name``, its config's path or type, its class."""
    name = getattr(model, "name", None)
    if isinstance(name, str):
        return name
    cfg = getattr(model, "config", None)
    return getattr(cfg, "name_or_path", None) or getattr(cfg, "model_type", None) or type(model).__name__


def accepts(model: nn.Module, name: str) -> bool:
    """Whether ``model.forward`` has a parameter called ``name`` (False when its signature cannot
    be read)."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def forward_params(model: nn.Module) -> tuple[list[str], bool]:
    """The forward's parameter names (``self`` left out) and whether it takes ``**kwargs``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return [], True
    names = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return names, any(p.kind == p.VAR_KEYWORD for p in params.values())


def is_encoder_decoder(model: nn.Module) -> bool:
    """Whether ``model`` is an encoder-decoder (its own flag, or its config's)."""
    return bool(
        getattr(model, "is_encoder_decoder", False)
        or getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    )


__all__ = [
    "Prepared",
    "accepts",
    "device_of",
    "forward_params",
    "is_encoder_decoder",
    "is_hf_model",
    "model_name",
]
