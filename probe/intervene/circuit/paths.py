"""Path patching of one path (Wang et al. 2022; Goldowsky-Dill et al. 2023).

A path is a chain of edges ``u0 -> t1 (node u1) -> t2 (node u2) -> ... -> tk``, written
``"L0.H1 -> L1.H2.k -> logits"`` (a target names its node: a head's ``.q``/``.k``/``.v``, an MLP;
under grouped-query attention a ``.k``/``.v`` target is shared, so name the head after it:
``"L0.H1 -> L1.KV0.k -> L1.H2 -> logits"``).

The model runs on the clean inputs; ``t1`` reads ``u0``'s corrupted output instead of its clean
one; each node on the path passes what it now computes **only** along the path (to the next
target), every other target reading that node's clean output (and a head that shares a key/value
target of the path without being on it has its change taken back everywhere). The change so reaches the logits
through this path alone. A path that ends before the logits lets its last node's change spread
through every later path (the "sender -> receivers" form).

The result: the metric with the path patched, and ``effect = M(clean) - M(path patched)``, the
metric's drop carried by this path alone (with the same sign as the edge scores).
"""

from __future__ import annotations

from torch import Tensor

from probe.errors import ProbeError
from probe.intervene.circuit.graph import Graph
from probe.intervene.circuit.task import Task
from probe.intervene.circuit.wiring import Run


def parse_path(graph: Graph, path: str | list[str]) -> list[tuple[int, int]]:
    """The path's edges ``[(node, target), ...]`` (see the module docstring)."""
    parts = [p.strip() for p in (path.split("->") if isinstance(path, str) else path)]
    if len(parts) < 2:
        raise ProbeError("a path has at least one edge: 'NODE -> TARGET [-> TARGET ...]'")
    names = {n.name for n in graph.nodes}
    node = graph.node(parts[0])
    edges: list[tuple[int, int]] = []
    k = 1
    while k < len(parts):
        j = graph.target(parts[k])
        if not graph.nodes[node].order < graph.targets[j].order:
            raise ProbeError(f"{graph.nodes[node].name} does not run before {parts[k]}; not an edge")
        edges.append((node, j))
        k += 1
        if k == len(parts):
            break
        t = graph.targets[j]
        if t.kind == "logits":
            raise ProbeError("the logits end a path; nothing can follow them")
        if parts[k] in names and parts[k] != parts[k - 1]:  # the node reading through t, named
            node = graph.node(parts[k])
            if j not in graph.readers(node):
                raise ProbeError(f"{parts[k]} does not read through {t.name}")
            k += 1
        elif t.kind == "mlp" or len(t.heads) == 1:
            node = graph.node(t.name if t.kind == "mlp" else f"L{t.layer}.H{t.heads[0]}")
        else:
            raise ProbeError(f"{t.name} is read by heads {list(t.heads)}; name the head after it")
    return edges


def _value(values: list[tuple[int, Tensor]], i: int) -> Tensor:
    for start, v in values:
        if start <= i < start + v.shape[0]:
            return v[i - start]
    raise ProbeError(f"node {i} was not recorded in the run")


def side_readers(graph: Graph, edges: list[tuple[int, int]]) -> set[int]:
    """The heads that read a path's shared key/value target without being the next node on the
    path (grouped-query attention): their changes are taken back everywhere."""
    out = set()
    for (_, t), (u, _) in zip(edges, edges[1:], strict=False):
        tg = graph.targets[t]
        out |= {graph.node(f"L{tg.layer}.H{h}") for h in tg.heads} - {u} if tg.kind in ("k", "v") else set()
    return out


def path_deviation(clean: Run, corrupt: Run, edges: list[tuple[int, int]], side: set[int] = frozenset()):
    """The ``deviate`` function of a path-patched run (see the module docstring)."""
    first_u, first_t = edges[0]
    passes = {u: t for u, t in edges[1:]}  # node on the path -> the one target it passes its change to
    passes |= {u: -1 for u in side}  # changed off the path: taken back from every target

    def deviate(run: Run, gi: int):
        g = run.wiring.groups[gi]
        out: dict[int, Tensor] = {}
        for j in g.targets:
            dev = None
            if j == first_t:
                dev = _value(corrupt.values, first_u) - _value(run.values, first_u)
            for u, t in passes.items():
                if u < g.upstream and t != j:
                    part = _value(clean.values, u) - _value(run.values, u)
                    dev = part if dev is None else dev + part
            if dev is not None:
                out[j] = dev
        return out or None

    return deviate


def path_patch(task: Task, path: str | list[str]) -> dict[str, float]:
    """``{"metric", "effect", "share"}`` of path-patching ``path`` (see the module docstring);
    ``share``: the effect over the whole clean-minus-corrupted difference of the metric."""
    graph = task.wiring.graph
    edges = parse_path(graph, path)
    side = side_readers(graph, edges)
    total = 0.0
    for ci, (clean, _) in enumerate(task.pairs()):
        base, _ = task.record(clean, ci=ci)
        ref = task.corrupted(ci)
        logits = task.forward(Run(task.wiring, deviate=path_deviation(base, ref, edges, side)), clean)
        total += float(task.rows(logits, clean, ci).sum())
    value = total / task.n
    refs = task.references()
    span = refs["clean"] - refs["corrupted"]
    effect = refs["clean"] - value
    return {"metric": value, "effect": effect, "share": effect / span if span else float("nan")}


__all__ = ["parse_path", "path_patch", "path_deviation"]
