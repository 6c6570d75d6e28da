"""What a circuit is scored on: one number per example, from the logits at its last real position.

* ``"logit-diff"``: ``logit[correct] - logit[wrong]`` (answers: one ``(correct, wrong)`` pair for
  every example, or one pair per example);
* ``"prob"``: the softmax probability of the correct token;
* ``"kl"``: ``KL(clean || run)`` of the next-token distributions (0 on the clean run itself; no
  answers needed). Its gradient at the clean run is zero, so plain EAP (one gradient, taken at the
  clean run) scores every edge 0 on it: use ``method="eap-ig"`` or ``"patching"``.
* a function ``f(last_logits [batch, vocab], examples [batch]) -> [batch]`` (``examples``: each
  row's index into the inputs, to look up per-example data).

The last real position of each row comes from the attention mask, so left and right padding both
work; a classifier's logits ``[batch, labels]`` (one row per input) are used as they are. The
metric of a batch is the mean over its examples; :meth:`CircuitMetric.rows` gives the per-example
values so a batch can be split into chunks and summed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from probe.errors import ProbeError
from probe.intervene.metrics import token_id

KINDS = {"logit-diff": "logit_diff", "logit_diff": "logit_diff", "prob": "prob", "kl": "kl"}


def last_positions(mask: Tensor | None, length: int, batch: int) -> Tensor:
    """The index of each row's last real position ``[batch]`` (``length - 1`` without a mask)."""
    if mask is None:
        return torch.full((batch,), length - 1, dtype=torch.long)
    m = torch.as_tensor(mask).long().cpu()
    if not bool((m.sum(-1) > 0).all()):
        raise ProbeError("an input has no real token (its attention mask is all zeros)")
    return (m * torch.arange(m.shape[-1])).argmax(-1)


def at_last(logits: Tensor, last: Tensor) -> Tensor:
    """``[batch, vocab]``: each row's logits at its last real position (2-D logits as they are)."""
    if logits.dim() == 2:
        return logits
    rows = torch.arange(logits.shape[0], device=logits.device)
    return logits[rows, last.to(logits.device)]


@dataclass
class CircuitMetric:
    """A per-example metric of the logits (see the module docstring).

    ``kind``: ``logit_diff``, ``prob``, ``kl`` or ``custom``; ``correct``/``wrong``: per-example
    token ids ``[examples]``; ``clean_is_high``: whether the clean run scores high (False for KL).
    """

    name: str
    kind: str
    correct: Tensor | None = None
    wrong: Tensor | None = None
    fn: Callable[[Tensor, Tensor], Any] | None = None

    @property
    def needs_clean(self) -> bool:
        """Whether :meth:`rows` needs the clean run's log-probabilities (KL)."""
        return self.kind == "kl"

    @property
    def clean_is_high(self) -> bool:
        return self.kind != "kl"

    def rows(self, logits: Tensor, last: Tensor, examples: Tensor, clean: Tensor | None = None) -> Tensor:
        """Per-example values ``[batch]`` (float32) for rows ``examples`` of the inputs; ``clean``:
        the clean run's log-probabilities at the last position ``[batch, vocab]`` (for KL)."""
        lg = at_last(logits, last).float()
        ex = examples.to(lg.device)
        rows = torch.arange(lg.shape[0], device=lg.device)
        if self.kind == "logit_diff":
            return lg[rows, self.correct.to(lg.device)[ex]] - lg[rows, self.wrong.to(lg.device)[ex]]
        if self.kind == "prob":
            return lg.softmax(-1)[rows, self.correct.to(lg.device)[ex]]
        if self.kind == "kl":
            if clean is None:
                raise ProbeError("metric='kl' needs the clean run's log-probabilities")
            logp = lg.log_softmax(-1)
            c = clean.to(lg.device).float()
            return (c.exp() * (c - logp)).sum(-1)
        out = torch.as_tensor(self.fn(lg, ex))
        if out.shape != (lg.shape[0],):
            raise ProbeError(
                f"the metric function returned shape {tuple(out.shape)}; it must give one number "
                f"per row, shape ({lg.shape[0]},)"
            )
        return out.float()


def _is_token(x: Any) -> bool:
    return isinstance(x, (int, str)) or (isinstance(x, Tensor) and x.dim() == 0)


def _token(model: Any, x: Any, tokenizer: Any) -> int:
    return int(x) if isinstance(x, Tensor) else token_id(model, x, tokenizer)


def _pairs(answers: Any, n: int, kind: str) -> list[tuple[Any, Any]]:
    """``answers`` as ``n`` pairs ``(correct, wrong)`` (``wrong`` may be None): for logit-diff two
    tokens are one pair for every example; for prob a list of tokens is one per example."""
    if isinstance(answers, Tensor):
        answers = answers.tolist()
    if _is_token(answers):
        return [(answers, None)] * n
    pair = isinstance(answers, (list, tuple)) and len(answers) == 2 and all(_is_token(a) for a in answers)
    if pair and kind == "logit_diff":
        return [(answers[0], answers[1])] * n
    if isinstance(answers, (list, tuple)) and len(answers) == n:
        out = []
        for a in answers:
            if _is_token(a):
                out.append((a, None))
            elif isinstance(a, (list, tuple)) and len(a) in (1, 2) and all(_is_token(x) for x in a):
                out.append((a[0], a[1] if len(a) == 2 else None))
            else:
                raise ProbeError(f"an answer is a token or a (correct, wrong) pair of tokens, not {a!r}")
        return out
    raise ProbeError(
        f"answers= is one (correct, wrong) pair for every example or one per example ({n}), not {answers!r}"
    )


def make_metric(
    metric: Any, answers: Any, n: int, *, model: Any = None, tokenizer: Any = None
) -> CircuitMetric:
    """The :class:`CircuitMetric` for ``metric`` over ``n`` examples (see the module docstring)."""
    if callable(metric):
        return CircuitMetric(getattr(metric, "__name__", "metric"), "custom", fn=metric)
    kind = KINDS.get(metric) if isinstance(metric, str) else None
    if kind is None:
        raise ProbeError(f"metric= is 'logit-diff', 'prob', 'kl' or a function, not {metric!r}")
    if kind == "kl":
        return CircuitMetric("KL(clean || run)", "kl")
    if answers is None:
        need = "(correct, wrong) token pairs" if kind == "logit_diff" else "the correct tokens"
        raise ProbeError(f"metric={metric!r} needs answers= ({need}: ids or one-token strings)")
    pairs = _pairs(answers, n, kind)
    correct = torch.tensor([_token(model, c, tokenizer) for c, _ in pairs])
    if kind == "prob":
        return CircuitMetric("p(correct)", "prob", correct)
    if any(w is None for _, w in pairs):
        raise ProbeError("metric='logit-diff' needs a wrong token beside each correct one: (correct, wrong)")
    wrong = torch.tensor([_token(model, w, tokenizer) for _, w in pairs])
    return CircuitMetric("logit(correct) - logit(wrong)", "logit_diff", correct, wrong)


__all__ = ["CircuitMetric", "make_metric", "last_positions", "at_last", "KINDS"]
