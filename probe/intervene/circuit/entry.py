"""``probe.circuit(model, clean, corrupted, metric=..., method=...)``: score every edge of a model's graph."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from probe.errors import ProbeError
from probe.intervene.circuit.attribute import METHODS, eap_scores, patching_scores
from probe.intervene.circuit.build import check_sum, wire
from probe.intervene.circuit.inputs import Examples, check_pair, run_chunk
from probe.intervene.circuit.metrics import make_metric
from probe.intervene.circuit.result import Circuit
from probe.intervene.circuit.task import Task
from probe.intervene.circuit.wiring import Run
from probe.intervene.edits import check_free

MEMORY = 512 * 2**20  # bytes of node outputs one chunk may hold (sets the default batch_size)


def circuit(
    model: nn.Module,
    clean: Any,
    corrupted: Any,
    *,
    metric: Any = "logit-diff",
    answers: Any = None,
    method: str = "eap-ig",
    steps: int = 5,
    batch_size: int | None = None,
    tokenizer: Any = None,
    processor: Any = None,
    text: Any = None,
    sampling_rate: Any = None,
) -> Circuit:
    """Score every edge of ``model``'s graph on a task: ``clean`` inputs and ``corrupted`` ones of
    the same length, and a ``metric`` of the logits at each input's last real position.

    ``metric``: ``"logit-diff"`` (``answers``: one ``(correct, wrong)`` pair of tokens, ids or
    one-token strings, for every input, or one pair per input), ``"prob"`` (the correct token's
    probability), ``"kl"`` (KL divergence from the clean run; no answers), or a function
    ``f(last_logits [batch, vocab], examples [batch]) -> [batch]``.

    ``method``: ``"eap"`` (edge attribution patching, one backward), ``"eap-ig"`` (with integrated
    gradients over ``steps`` interpolations of the input embeddings; the default, more faithful),
    or ``"patching"`` (the exact effect of corrupting each edge alone: one forward per edge).
    The score of an edge is the drop of the metric when that edge alone is corrupted (exact or
    estimated). ``batch_size``: inputs per chunk (default: what fits in about 512 MiB of node
    outputs). Inputs: texts, token ids, or whatever :func:`probe.capture` takes
    (``processor=``/``sampling_rate=`` for pictures and sound).

    Returns a :class:`~probe.intervene.circuit.result.Circuit`: ``.table`` of edges, ``.top(n)``,
    ``.greedy(n)``, ``.evaluate(...)`` (the faithfulness curve, running the model), ``.path(...)``.
    """
    if not isinstance(model, nn.Module):
        raise ProbeError(f"probe finds circuits in torch.nn.Module models, not {type(model).__name__}")
    if method not in METHODS:
        raise ProbeError(f"method= is one of {', '.join(METHODS)}, not {method!r}")
    check_free(model)
    options = {"tokenizer": tokenizer, "processor": processor, "text": text, "sampling_rate": sampling_rate}
    a, b = Examples(clean, "clean inputs"), Examples(corrupted, "corrupted inputs")
    if a.n != b.n:
        raise ProbeError(
            f"{a.n} clean inputs but {b.n} corrupted ones; give one corrupted input per clean one"
        )
    m = make_metric(metric, answers, a.n, model=model, tokenizer=tokenizer)
    if m.kind == "kl" and method == "eap":
        raise ProbeError(
            "metric='kl' has zero gradient at the clean run, so method='eap' would score every edge 0; "
            "use method='eap-ig' or 'patching'"
        )
    everything = list(range(a.n))
    check_pair(run_chunk(model, a, everything, options), run_chunk(model, b, everything, options), a.n, b.n)
    wiring = wire(model, a, options)
    size = batch_size or _batch_size(model, a, options, wiring)
    task = Task(model, wiring, a, b, m, options, size)
    first = task.pairs()[0][0]
    run = Run(wiring)
    with torch.no_grad():
        task.forward(run, first)
    check_sum(wiring, run)
    if method == "patching":
        scores = patching_scores(task)
    else:
        scores = eap_scores(task, steps if method == "eap-ig" else 1)
    return Circuit(
        wiring.graph,
        scores,
        method=method,
        metric=m.name,
        steps=steps if method == "eap-ig" else 1,
        references=task.references(),
        task=task,
    )


def _batch_size(model: nn.Module, examples: Examples, options: dict, wiring: Any) -> int:
    """As many inputs per chunk as keep the node outputs (clean, corrupted, their difference) and
    the targets' gradients within :data:`MEMORY` (float32, ``(3 nodes + targets) × pos × d``)."""
    chunk = run_chunk(model, examples, [0], options)
    length = chunk.mask.shape[-1] if chunk.mask is not None else 1
    d = next((w.W_O.shape[-1] for w in wiring.writers if w.W_O is not None), 1)
    g = wiring.graph
    per = 4 * length * d * (3 * len(g.nodes) + len(g.targets))
    return max(1, min(examples.n, MEMORY // max(per, 1)))


__all__ = ["circuit"]
