"""A tensor as the input: token ids, or float inputs handed to the forward as they are.

Integer tensors are token ids (``[T]`` or ``[batch, T]``), checked against the model's context
length and vocabulary, their display tokens read through the tokenizer when there is one. Float
tensors (``[batch, T, ...]``, or ``[T, ...]`` for one) go to the forward as they are, their
positions numbered.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from probe.capture.inputs.checks import check_ids, check_length, context_length
from probe.capture.inputs.prepared import Prepared, device_of, is_hf_model, model_name
from probe.capture.inputs.tokenizers import adapt
from probe.errors import ProbeError


def prepare_tensor(model: nn.Module, x: Tensor, tokenizer: Any = None) -> Prepared:
    """The forward call for a tensor of ids or of float inputs (see the module docstring)."""
    name = model_name(model)
    if x.numel() == 0:
        raise ProbeError("empty input tensor: give at least one position to capture")
    limit = context_length(model)
    x = x.to(device_of(model))  # ids or inputs built on the CPU for a model on a GPU
    if x.is_floating_point():
        if not bool(torch.isfinite(x).all()):
            raise ProbeError("the input tensor holds NaN or infinite values; give finite numbers")
        batch = x if x.dim() >= 3 else x.unsqueeze(0)
        T = batch.shape[1]
        check_length(T, limit, name, "input")
        meta = {
            "input_kind": "tensor",
            "input_shape": list(batch.shape),
            "tokens": [[str(i) for i in range(T)] for _ in range(batch.shape[0])],
        }
        return Prepared(lambda: model(batch), meta)
    ids = (x if x.dim() == 2 else x.reshape(1, -1)).long()
    check_length(ids.shape[1], limit, name, "input")
    check_ids(model, ids, name)
    raw_tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if raw_tok is not None:
        tokens = [adapt(raw_tok).tokens_of(row) for row in ids.tolist()]
    else:
        tokens = [[str(int(i)) for i in row] for row in ids]
    meta = {
        "input_kind": "ids",
        "tokens": tokens,
        "ids": ids.tolist(),
        "attention_mask": torch.ones_like(ids).tolist(),
    }
    if is_hf_model(model):
        return Prepared(lambda: model(input_ids=ids), meta)
    return Prepared(lambda: model(ids), meta)


__all__ = ["prepare_tensor"]
