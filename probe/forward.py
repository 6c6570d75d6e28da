"""The one door through which analyses run a model.

Analyses read caches and never import :mod:`probe.capture`; the few that must call the model
(the functional causal checks, the logit lens) do it through this module only, so the data flow
stays one-way and this stays the single place to look when a model call misbehaves.

* :func:`prepare` turns texts into the forward call ``probe.capture`` would make (same tokenizer
  adapter, padding and position ids), returning a :class:`Prepared` with ``.run()`` and ``.meta``.
* :func:`capture` is ``probe.capture`` itself.
* :func:`run` runs the model once on inputs, exactly as capture would, and returns its outputs.
* :func:`run_recorded` does the same while recording the inputs and outputs of chosen submodules
  (and, optionally, capturing the cache of that very forward): the logit lens finds the model's
  final norm and unembedding this way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from probe.capture.engine import Trace, capture, trace
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


@dataclass
class Call:
    """One call of a recorded submodule: its first positional input and its (first) output."""

    name: str
    module: nn.Module
    input: Any
    output: Any
    order: int


@dataclass
class Recorded:
    """What :func:`run_recorded` saw: the model's outputs, input metadata, calls and the cache."""

    outputs: Any
    meta: dict
    calls: list[Call] = field(default_factory=list)
    cache: Any = None


def _first(x: Any) -> Any:
    if isinstance(x, (tuple, list)) and x:
        return x[0]
    return x


def run_recorded(
    model: nn.Module,
    inputs: Any,
    *,
    tokenizer: Any = None,
    target: Any = None,
    record: Callable[[str, nn.Module], bool] = lambda name, m: True,
    capture_cache: bool = False,
) -> Recorded:
    """Run ``model`` once on ``inputs`` (as :func:`run`), recording every call of the submodules
    ``record(name, module)`` selects, in call order; with ``capture_cache`` that same forward is
    also captured (``Recorded.cache``). Hooks are removed afterwards; outputs are unchanged.
    """
    prepared = prepare(model, inputs, tokenizer=tokenizer, target=target)
    calls: list[Call] = []
    handles = []
    for name, m in model.named_modules():
        if not record(name, m):
            continue

        def hook(mod, args, out, _name=name):
            calls.append(Call(_name, mod, args[0] if args else None, _first(out), len(calls)))

        handles.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            if capture_cache:
                t = Trace(model, metadata=prepared.meta)
                with t:
                    out = prepared.run()
                return Recorded(out, prepared.meta, calls, t.cache)
            out = prepared.run()
            return Recorded(out, prepared.meta, calls)
    finally:
        for h in handles:
            h.remove()


__all__ = [
    "Prepared",
    "prepare",
    "capture",
    "trace",
    "run",
    "run_recorded",
    "Recorded",
    "Call",
    "is_hf_model",
    "model_name",
    "adapt_tokenizer",
]
