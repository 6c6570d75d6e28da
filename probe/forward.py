"""The one door through which analyses run a model.

Analyses read caches and never import :mod:`probe.capture`; the few that must call the model
(the functional causal checks, the logit lens) do it through this module only, so the data flow
stays one-way and this stays the single place to look when a model call misbehaves.

* :func:`prepare` turns texts into the forward call ``probe.capture`` would make (same tokenizer
  adapter, padding and position ids), returning a :class:`Prepared` with ``.run()`` and ``.meta``.
* :func:`capture` is ``probe.capture`` itself.
* :func:`run` runs the model once on inputs, exactly as capture would, and returns its outputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from probe.capture.engine import capture, trace
from probe.capture.inputs import Prepared, is_hf_model, model_name, prepare
from probe.capture.tokenizers import adapt as adapt_tokenizer


def run(model: nn.Module, inputs: Any, *, tokenizer: Any = None, target: Any = None) -> tuple[Any, dict]:
    """Run ``model`` once on ``inputs`` the way :func:`probe.capture` would, without capturing.

    Returns ``(outputs, meta)``: the model's own return value and the input metadata (texts,
    tokens, ids, attention mask) that a cache of the same call would hold.
    """
    prepared = prepare(model, inputs, tokenizer=tokenizer, target=target)
    with torch.no_grad():
        out = prepared.run()
    return out, prepared.meta


__all__ = ["Prepared", "prepare", "capture", "trace", "run", "is_hf_model", "model_name", "adapt_tokenizer"]
