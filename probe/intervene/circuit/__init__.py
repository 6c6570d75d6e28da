"""Circuits: which heads and MLPs, through which edges, carry a behaviour (issue 55, item 4).

``probe.circuit(model, clean, corrupted, metric="logit-diff", answers=..., method="eap-ig")``
scores every edge of the model's graph (:mod:`~probe.intervene.circuit.graph`: the embedding,
every head with its query, key and value inputs as separate targets, every MLP, the logits) by
edge attribution patching, EAP with integrated gradients, or exact patching
(:mod:`~probe.intervene.circuit.attribute`); a circuit chosen from the scores runs the model with
every other edge corrupted (:mod:`~probe.intervene.circuit.evaluate`); one path can be path-patched
(:mod:`~probe.intervene.circuit.paths`). :mod:`~probe.intervene.circuit.prompts` makes the
textbook tasks (induction, IOI).

Layout: ``graph`` (nodes, targets, edges, choosing circuits) -> ``wiring`` (the hooks) ->
``build`` (the wiring from the anatomy) -> ``task`` (inputs in chunks, the metric; ``inputs``,
``metrics``) -> ``grads`` (each target's own gradient) -> ``attribute`` / ``evaluate`` /
``paths`` -> ``result`` -> ``entry``.
"""

from probe.intervene.circuit.entry import circuit
from probe.intervene.circuit.graph import Graph, LayerSpec, Node, Target
from probe.intervene.circuit.metrics import CircuitMetric, make_metric
from probe.intervene.circuit.prompts import PromptSet, induction_prompts, ioi_prompts
from probe.intervene.circuit.result import Circuit, Faithfulness, Selection

__all__ = [
    "circuit",
    "Circuit",
    "Selection",
    "Faithfulness",
    "Graph",
    "LayerSpec",
    "Node",
    "Target",
    "CircuitMetric",
    "make_metric",
    "PromptSet",
    "induction_prompts",
    "ioi_prompts",
]
