"""Running a circuit: the model on the clean inputs with every edge outside the circuit corrupted.

For a set of edges (a ``[nodes, targets]`` bool mask), each target ``t`` reads
``Σ_u (u -> t in the circuit ? u's output in this run : u's output on the corrupted inputs)``
plus the constant biases. The model really runs: the stream ``x`` it would give ``t`` is the sum of
this run's node outputs (checked when the task is set up), so ``t`` is given
``x + Σ_{u -> t not in the circuit} (corrupt_u - run_u)``, its projection block or its readers'
input recomputed from that (:mod:`~probe.intervene.circuit.wiring`). Nodes inside the circuit so
see their inputs through the circuit only, and pass what they compute on.

With every edge in the circuit the run is the clean run; with none, every target reads the
corrupted stream, so the logits are the corrupted run's (both up to float rounding, tested).

``faithfulness = (M(circuit) - M(corrupted)) / (M(clean) - M(corrupted))``: 1 when the circuit
recovers the clean metric, 0 when it does no better than the corrupted run (Hanna et al. 2024's
normalised faithfulness; for KL, ``1 - KL(circuit) / KL(corrupted)``).
"""

from __future__ import annotations

from torch import Tensor

from probe.errors import ProbeError
from probe.intervene.circuit.task import Task
from probe.intervene.circuit.wiring import Run


def corrupted_edges_deviation(ref: Run, off: Tensor):
    """The ``deviate`` function of a run where the edges in ``off`` (``[nodes, targets]`` bool)
    read the corrupted run ``ref``'s node outputs and all others this run's. The differences
    ``corrupt_u - run_u`` fill one ``[nodes, B*T*d]`` buffer as the nodes run, so each group of
    targets takes its deviations in one matrix product."""
    ref_groups = dict(ref.values)
    state: dict = {"buf": None, "filled": 0}

    def deviate(run: Run, gi: int):
        g = run.wiring.groups[gi]
        w = off[: g.upstream, g.targets]
        if not bool(w.any()):
            return None
        if state["buf"] is None:
            first = run.values[0][1]
            state["buf"] = first.new_empty(len(run.wiring.graph.nodes), first[0].numel())
        buf = state["buf"]
        for start, v in run.values:
            if start >= state["filled"]:
                buf[start : start + v.shape[0]] = (ref_groups[start] - v).reshape(v.shape[0], -1)
                state["filled"] = start + v.shape[0]
        dev = w.T.to(buf.device, buf.dtype) @ buf[: g.upstream]  # [targets, B*T*d]
        shape = run.values[0][1].shape[1:]
        return {t: dev[i].reshape(shape) for i, t in enumerate(g.targets) if bool(w[:, i].any())}

    return deviate


def circuit_metric(task: Task, edges: Tensor) -> float:
    """The batch-mean metric of the model run with only ``edges`` clean (see the module docstring)."""
    graph = task.wiring.graph
    if edges.shape != (len(graph.nodes), len(graph.targets)):
        raise ProbeError(f"a circuit's edges are a [{len(graph.nodes)}, {len(graph.targets)}] mask")
    off = graph.mask() & ~edges.bool()
    total = 0.0
    for ci, (clean, _) in enumerate(task.pairs()):
        task.ensure_clean(ci)
        ref = task.corrupted(ci)
        logits = task.forward(Run(task.wiring, deviate=corrupted_edges_deviation(ref, off)), clean)
        total += float(task.rows(logits, clean, ci).sum())
        del ref
    return total / task.n


def circuit_logits(task: Task, edges: Tensor, chunk_index: int = 0) -> Tensor:
    """The logits of one chunk of the clean inputs run with only ``edges`` clean (for tests and
    inspection)."""
    graph = task.wiring.graph
    off = graph.mask() & ~edges.bool()
    clean, _ = task.pairs()[chunk_index]
    ref = task.corrupted(chunk_index)
    return task.forward(Run(task.wiring, deviate=corrupted_edges_deviation(ref, off)), clean).detach()


def faithfulness(value: float, refs: dict[str, float]) -> float:
    """``(value - corrupted) / (clean - corrupted)`` (NaN when clean == corrupted)."""
    span = refs["clean"] - refs["corrupted"]
    return (value - refs["corrupted"]) / span if span else float("nan")


__all__ = ["circuit_metric", "circuit_logits", "faithfulness", "corrupted_edges_deviation"]
