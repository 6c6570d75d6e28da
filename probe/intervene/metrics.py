"""Metrics for activation patching: a number from the model's outputs.

``"logit_diff"`` (``answer`` minus ``wrong`` logit), ``"prob"`` (softmax probability of ``answer``)
at the last real position of each text, averaged over texts; ``"loss"`` (next-token
cross-entropy of the clean token ids over real positions); or any ``callable(outputs) -> float``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from probe.errors import ProbeError
from probe.forward import outputs_of

METRICS = ("logit_diff", "prob", "loss")


def token_id(model: Any, tok: Any, tokenizer: Any = None) -> int:
    """A token id from an int or a string that the tokenizer encodes as exactly one token."""
    if isinstance(tok, int):
        return tok
    if isinstance(tok, str):
        from probe.capture.tokenizers import adapt

        raw = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        if raw is None:
            raise ProbeError(f"cannot turn {tok!r} into a token id without a tokenizer; give the id")
        ids = [
            i
            for i, s in zip(adapt(raw).encode(tok).ids, adapt(raw).encode(tok).special, strict=True)
            if not s
        ]
        if len(ids) != 1:
            raise ProbeError(f"{tok!r} is {len(ids)} tokens, not one; give a single token or its id")
        return ids[0]
    raise ProbeError(f"a token is an id or a one-token string, not {type(tok).__name__}")


def _last(mask: Tensor | None, logits: Tensor) -> Tensor:
    """The index of the last real position of each text ``[batch]``."""
    B, T = logits.shape[:2]
    if mask is None:
        return torch.full((B,), T - 1, dtype=torch.long)
    m = mask.long()
    return (m * torch.arange(T)).argmax(-1)


def make_metric(
    model: Any,
    metric: Any,
    *,
    answer: Any = None,
    wrong: Any = None,
    ids: Tensor | None = None,
    mask: Tensor | None = None,
    tokenizer: Any = None,
) -> tuple[str, Callable[[Any], float]]:
    """``(name, fn)``: ``fn(outputs) -> float`` for the metric asked for (see the module docstring)."""
    name, fn = metric_tensor(
        model, metric, answer=answer, wrong=wrong, ids=ids, mask=mask, tokenizer=tokenizer
    )
    return name, lambda out: float(fn(out))


def metric_tensor(
    model: Any,
    metric: Any,
    *,
    answer: Any = None,
    wrong: Any = None,
    ids: Tensor | None = None,
    mask: Tensor | None = None,
    tokenizer: Any = None,
) -> tuple[str, Callable[[Any], Tensor]]:
    """As :func:`make_metric`, with ``fn`` returning a 0-d tensor (differentiable)."""
    if callable(metric):
        return getattr(metric, "__name__", "metric"), lambda out: torch.as_tensor(metric(out))
    if metric not in METRICS:
        raise ProbeError(
            f"metric= is one of {', '.join(METRICS)} or a function of the outputs, not {metric!r}"
        )
    if metric == "loss":
        if ids is None:
            raise ProbeError("metric='loss' needs token ids (texts or an id tensor) as the clean inputs")

        def loss(out: Any) -> Tensor:
            logits = outputs_of(out).float()[:, :-1]
            tgt = ids[:, 1:].to(logits.device)
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tgt, reduction="none")
            keep = mask[:, 1:].bool() if mask is not None else torch.ones_like(nll, dtype=torch.bool)
            return nll[keep].mean()

        return "loss", loss
    if answer is None or (metric == "logit_diff" and wrong is None):
        need = "answer= and wrong=" if metric == "logit_diff" else "answer="
        raise ProbeError(f"metric={metric!r} needs {need} (token ids or one-token strings)")
    a = token_id(model, answer, tokenizer)
    b = token_id(model, wrong, tokenizer) if wrong is not None else None

    def at_last(out: Any) -> Tensor:
        logits = outputs_of(out).float()
        rows = torch.arange(logits.shape[0])
        return logits[rows, _last(mask, logits)]

    if metric == "prob":
        return f"p({answer})", lambda out: at_last(out).softmax(-1)[:, a].mean().item()
    return (
        f"logit({answer}) - logit({wrong})",
        lambda out: (at_last(out)[:, a] - at_last(out)[:, b]).mean().item(),
    )


__all__ = ["make_metric", "metric_tensor", "token_id", "METRICS"]
