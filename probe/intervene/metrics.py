"""Metrics for activation patching: a number from the model's outputs.

``"logit_diff"`` (``answer`` minus ``wrong`` logit), ``"prob"`` (softmax probability of ``answer``)
at the last real position of each text (or of each input's one row of logits ``[batch,
labels]``: an image classifier's, ``answer`` a label id or name), averaged over texts; ``"loss"`` (next-token
cross-entropy of the clean token ids over real positions); or any ``callable(outputs) -> float``.
Each is a :class:`Metric`; the built-in ones also have a per-example form (:attr:`Metric.rows`),
which lets :func:`probe.head_importance` run several ablations as rows of one batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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
        from probe.capture.inputs.tokenizers import adapt

        raw = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        labels = getattr(getattr(model, "config", None), "label2id", None) or {}
        if raw is None and tok in labels:  # a classifier's label name
            return int(labels[tok])
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


@dataclass
class Metric:
    """A number from the model's outputs: ``metric(outputs)`` is a 0-d float tensor.

    ``rows``: the per-example form, ``rows(logits [batch, ...]) -> (total [batch], weight
    [batch])``: text ``b``'s own metric is ``total[b] / weight[b]`` and the metric of the batch is
    ``Σ total / Σ weight`` (for ``"loss"`` the weight is the number of predicted real tokens, else
    1). None for a function given by the user: it sees the whole outputs (and may reduce over the
    batch in its own way), so it has no per-example form.
    """

    name: str
    rows: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None
    fn: Callable[[Any], Any] | None = None

    def __call__(self, out: Any) -> Tensor:
        if self.rows is None:
            return torch.as_tensor(self.fn(out))
        return self.of_logits(outputs_of(out))

    def of_logits(self, logits: Tensor) -> Tensor:
        """The metric of a batch from its logits ``[batch, ...]`` (needs :attr:`rows`)."""
        total, weight = self.rows(logits.float())
        return total.sum() / weight.sum()


def metric_tensor(
    model: Any,
    metric: Any,
    *,
    answer: Any = None,
    wrong: Any = None,
    ids: Tensor | None = None,
    mask: Tensor | None = None,
    tokenizer: Any = None,
) -> Metric:
    """The :class:`Metric` asked for (see the module docstring); ``ids``/``mask`` ``[batch, pos]``
    are the clean token ids and real-token mask (for ``"loss"`` and the last real position)."""
    if callable(metric):
        return Metric(getattr(metric, "__name__", "metric"), fn=metric)
    if metric not in METRICS:
        raise ProbeError(
            f"metric= is one of {', '.join(METRICS)} or a function of the outputs, not {metric!r}"
        )
    if metric == "loss":
        if ids is None:
            raise ProbeError(
                "metric='loss' needs token ids (texts or an id tensor) as the clean inputs; for a "
                "classifier use metric='prob' or 'logit_diff' with answer= (a label id) or a function"
            )

        def loss(logits: Tensor) -> tuple[Tensor, Tensor]:
            logits = logits[:, :-1]
            tgt = ids[:, 1:].to(logits.device)
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tgt, reduction="none")
            keep = mask[:, 1:].bool() if mask is not None else torch.ones_like(nll, dtype=torch.bool)
            keep = keep.to(nll.device)
            return (nll * keep).sum(1), keep.sum(1).to(nll.dtype)

        return Metric("loss", loss)
    if answer is None or (metric == "logit_diff" and wrong is None):
        need = "answer= and wrong=" if metric == "logit_diff" else "answer="
        raise ProbeError(f"metric={metric!r} needs {need} (token ids or one-token strings)")
    a = token_id(model, answer, tokenizer)
    b = token_id(model, wrong, tokenizer) if wrong is not None else None

    def at_last(logits: Tensor) -> Tensor:
        if logits.dim() == 2:  # one row of logits per input (an image classifier's labels)
            return logits
        rows = torch.arange(logits.shape[0])
        return logits[rows, _last(mask, logits)]

    def one(lg: Tensor) -> Tensor:
        return torch.ones(lg.shape[0], device=lg.device)

    if metric == "prob":
        return Metric(f"p({answer})", lambda lg: (at_last(lg).softmax(-1)[:, a], one(lg)))
    return Metric(
        f"logit({answer}) - logit({wrong})", lambda lg: (at_last(lg)[:, a] - at_last(lg)[:, b], one(lg))
    )


__all__ = ["Metric", "metric_tensor", "token_id", "METRICS"]
