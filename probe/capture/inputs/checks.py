"""What a model can take, checked before it runs: its context length, the token ids it has
embeddings for, keyword tensors it would fail on deep inside or compute NaN attention from, and
what to say when text goes to a model that reads pictures or sound.

Each check raises one line (:class:`~probe.errors.ProbeError`) naming the problem and the fix;
``name`` is the model as a person knows it (:func:`probe.capture.inputs.prepared.model_name`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from probe.capture.inputs.prepared import accepts
from probe.errors import ProbeError

SIGNAL_KEYS = ("input_features", "input_values")  # sound; pixel_values* are pictures


def context_length(model: nn.Module) -> int | None:
    """The positions ``model`` reads at most: ``model.context_length`` (the zoo), else its
    config's ``max_position_embeddings`` or ``n_positions``; None when it does not say."""
    limit = getattr(model, "context_length", None)
    if limit is not None:
        return int(limit)
    cfg = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "n_positions"):
        v = getattr(cfg, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def check_length(n: int, limit: int | None, name: str, what: str) -> None:
    """``what`` of ``n`` tokens refused when past ``limit``."""
    if limit is not None and n > limit:
        raise ProbeError(f"{what} is {n} tokens but {name} accepts at most {limit}; shorten it")


def check_keyword_tensors(model: nn.Module, kwargs: Mapping, name: str) -> None:
    """Keyword tensors the forward would fail on deep inside, or compute NaN attention from,
    refused: empty pictures or sound, NaN or infinite pixels or features, features without their
    batch dimension, ``input_ids``/``decoder_input_ids`` past the model's positions."""
    for k, v in kwargs.items():
        if not isinstance(v, Tensor) or not (k.startswith("pixel_values") or k in SIGNAL_KEYS):
            continue
        if v.numel() == 0:
            raise ProbeError(f"{k} is empty ({list(v.shape)}); give at least one picture or waveform")
        if k == "input_features" and v.dim() == 2:
            raise ProbeError(
                f"input_features is {list(v.shape)}, without its batch dimension; give "
                "[batch, ...] (input_features.unsqueeze(0) for one input)"
            )
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            bad = int(v.numel() - torch.isfinite(v).sum())
            raise ProbeError(
                f"{k} holds {bad} NaN or infinite values of {v.numel()}; give finite numbers (check the "
                "picture or sound, and the processor's normalisation)"
            )
    limits = {"input_ids": context_length(model)}
    cfg = getattr(model, "config", None)
    limits["decoder_input_ids"] = limits["input_ids"] or getattr(cfg, "max_target_positions", None)
    for k, limit in limits.items():
        v = kwargs.get(k)
        if isinstance(v, Tensor) and v.dim() == 2 and isinstance(limit, int):
            check_length(v.shape[1], limit, name, k)


def vocabulary_size(model: nn.Module) -> int | None:
    """The rows of the model's input embedding (the ids it can read), None when it has none."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        emb = None
    n = getattr(emb, "num_embeddings", None)
    return int(n) if isinstance(n, int) else None


def check_ids(model: nn.Module, ids: Tensor, name: str) -> None:
    """Token ids the model has embeddings for: none negative, none past its vocabulary (a
    transformers model's input embeddings; a zoo model's tokenizer says for its own)."""
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        raise ProbeError(f"token id {lo} is negative; give ids {name}'s tokenizer made")
    n = vocabulary_size(model)
    if n is not None and hi >= n:
        raise ProbeError(
            f"token id {hi} is not in {name}'s vocabulary (0-{n - 1}); give ids its tokenizer made"
        )


def no_tokenizer(model: nn.Module, name: str) -> ProbeError:
    """The error for text given to ``model`` without a tokenizer: an image or audio model is told
    what it reads instead."""
    if not accepts(model, "input_ids"):
        if accepts(model, "pixel_values"):
            return ProbeError(
                f"{name} reads pictures, not text (its forward takes pixel_values); give pictures "
                "with processor= (its image processor; on the command line --image PATH)"
            )
        if key := next((k for k in SIGNAL_KEYS if accepts(model, k)), None):
            return ProbeError(
                f"{name} reads sound, not text (its forward takes {key}); give a waveform with "
                "sampling_rate= or a sound file, with processor= (on the command line --audio PATH)"
            )
    return ProbeError(f"{name} has no tokenizer; pass tokenizer=... or a tensor of token ids")


__all__ = [
    "SIGNAL_KEYS",
    "check_ids",
    "check_keyword_tensors",
    "check_length",
    "context_length",
    "no_tokenizer",
    "vocabulary_size",
]
