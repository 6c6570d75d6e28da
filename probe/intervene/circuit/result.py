"""What :func:`probe.circuit` returns: scored edges, the circuits chosen from them, their faithfulness.

* :class:`Circuit`: the graph, a score per edge (``.table``: a :class:`~probe.analysis.table.Table`
  sorted by absolute score, exportable to dict/JSON/CSV/pandas), ``.top(n)`` and ``.greedy(n)``
  choose a circuit, ``.evaluate(n_edges=[...])`` runs the model with each chosen circuit and gives
  the faithfulness curve, ``.path(...)`` path-patches one path, ``.to_json()``/``.from_json()``.
* :class:`Selection`: a chosen set of edges, ``.evaluate()`` (the model really run with every
  other edge corrupted), ``.nodes``, ``.table``, ``.pruned()``.
* :class:`Faithfulness`: the curve as a table (edges, metric, faithfulness) with the references.

A circuit loaded from JSON has no model attached: ``evaluate`` and ``path`` then raise a
:class:`ProbeError`; everything else works.
"""

from __future__ import annotations

import html
import json
import math
from typing import Any

import torch
from torch import Tensor

from probe.analysis.table import Exports, Table
from probe.errors import ProbeError
from probe.intervene.circuit.evaluate import circuit_metric, faithfulness
from probe.intervene.circuit.graph import Graph, connected, greedy_edges, top_edges

FAITHFULNESS_COLUMNS = ["edges", "share", "metric", "kept", "faithfulness"]
EDGE_COLUMNS = ["rank", "edge", "source", "target", "input", "source_layer", "target_layer", "score"]


def edge_table(graph: Graph, scores: Tensor, chosen: Tensor | None = None, title: str = "") -> Table:
    """The edges (all, or the ``chosen`` ones) sorted by absolute score (NaN last)."""
    mask = graph.mask() if chosen is None else chosen & graph.mask()
    idx = mask.nonzero().tolist()
    key = scores.abs().nan_to_num(-1.0)
    idx.sort(key=lambda p: -float(key[p[0], p[1]]))
    rows = []
    for r, (i, j) in enumerate(idx, 1):
        n, t = graph.nodes[i], graph.targets[j]
        rows.append(
            {
                "rank": r,
                "edge": graph.edge_name(i, j),
                "source": n.name,
                "target": t.name,
                "input": t.kind,
                "source_layer": n.layer,
                "target_layer": t.layer,
                "score": float(scores[i, j]),
            }
        )
    return Table(rows, EDGE_COLUMNS, title)


class Circuit(Exports):
    """Edge scores of a model on a task (see the module docstring)."""

    def __init__(
        self,
        graph: Graph,
        scores: Tensor,
        *,
        method: str,
        metric: str,
        steps: int = 1,
        references: dict[str, float] | None = None,
        task: Any = None,
    ) -> None:
        self.graph, self.scores, self.method, self.metric, self.steps = graph, scores, method, metric, steps
        self.references = dict(references or {})
        self.task = task
        self.table = edge_table(graph, scores, title=f"edges by {method}")

    def __len__(self) -> int:
        return len(self.table)

    def score(self, edge: str) -> float:
        """The score of one edge, named ``"NODE -> TARGET"`` (``"L0.H1 -> L1.H2.k"``)."""
        i, j = self.graph.edge(edge)
        return float(self.scores[i, j])

    def rank(self, edge: str) -> int:
        """The 1-based rank of an edge by absolute score."""
        name = " -> ".join(p.strip() for p in edge.split("->"))
        self.graph.edge(name)
        return next(r["rank"] for r in self.table.rows if r["edge"] == name)

    # -- choosing circuits -------------------------------------------------------------------
    def top(self, n: int) -> Selection:
        """The ``n`` edges of largest absolute score."""
        return Selection(self, top_edges(self.graph, self.scores, n), f"top {n}")

    def greedy(self, n: int) -> Selection:
        """``n`` edges chosen greedily from the logits backwards, each connected to the logits
        (:func:`~probe.intervene.circuit.graph.greedy_edges`, as EAP-IG's ``apply_greedy``)."""
        return Selection(self, greedy_edges(self.graph, self.scores, n), f"greedy {n}")

    def edges(self, names: list[str]) -> Selection:
        """The circuit of exactly these edges (``["L0.H1 -> L1.H3.k", ...]``)."""
        chosen = torch.zeros(len(self.graph.nodes), len(self.graph.targets), dtype=torch.bool)
        for name in names:
            chosen[self.graph.edge(name)] = True
        return Selection(self, chosen, f"{len(names)} given edges")

    def evaluate(self, n_edges: list[int] | None = None, how: str = "greedy") -> Faithfulness:
        """The faithfulness curve: for each count in ``n_edges`` (default: 1, 2, 5, 10, ... up to
        every edge), the circuit of that many edges chosen ``how`` (``"greedy"`` or ``"top"``), run
        with everything else corrupted."""
        if how not in ("greedy", "top"):
            raise ProbeError(f"how= is 'greedy' or 'top', not {how!r}")
        total = self.graph.n_edges
        counts = n_edges if n_edges is not None else _default_counts(total)
        rows = []
        for n in counts:
            sel = self.greedy(n) if how == "greedy" else self.top(n)
            rows.append({"edges": n, "share": n / total} | sel.evaluate())
        return Faithfulness(Table(rows, FAITHFULNESS_COLUMNS), self.reference_values(), how)

    def path(self, path: str | list[str]) -> dict[str, float]:
        """Path patching of one path (see :mod:`~probe.intervene.circuit.paths`)."""
        from probe.intervene.circuit.paths import path_patch

        return path_patch(self.attached(), path)

    def attached(self) -> Any:
        """The task (model and inputs) this circuit was scored on; a ProbeError when loaded from JSON."""
        if self.task is None:
            raise ProbeError("this circuit has no model attached (loaded from JSON); run probe.circuit again")
        return self.task

    def reference_values(self) -> dict[str, float]:
        """The metric on the clean and on the corrupted inputs (computed once if not yet known)."""
        if not self.references:
            self.references = self.attached().references()
        return self.references

    # -- data ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data: the graph, the method and metric, the references and every edge's score."""
        return {
            "kind": "probe.circuit",
            "method": self.method,
            "steps": self.steps,
            "metric": self.metric,
            "references": dict(self.references),
            "graph": self.graph.to_dict(),
            "edges": [{"edge": r["edge"], "score": r["score"]} for r in self.table.rows],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Circuit:
        if data.get("kind") != "probe.circuit":
            raise ProbeError("not a probe circuit's data (no 'kind': 'probe.circuit')")
        graph = Graph.from_dict(data["graph"])
        scores = torch.full((len(graph.nodes), len(graph.targets)), float("nan"))
        for e in data.get("edges", []):
            s = e["score"]
            scores[graph.edge(e["edge"])] = float("nan") if s is None else float(s)
        return cls(
            graph,
            scores,
            method=data.get("method", ""),
            metric=data.get("metric", ""),
            steps=int(data.get("steps", 1)),
            references=data.get("references"),
        )

    @classmethod
    def from_json(cls, text: str) -> Circuit:
        return cls.from_dict(json.loads(text))

    def summary(self) -> str:
        ref = self.references
        refs = f"; clean {ref['clean']:.4g}, corrupted {ref['corrupted']:.4g}" if ref else ""
        return (
            f"{self.graph.model or 'model'}: {len(self.graph.nodes)} nodes, {len(self.graph.targets)} "
            f"targets, {len(self)} edges scored by {self.method} on {self.metric}{refs}"
        )

    def __repr__(self) -> str:
        return f"<Circuit {self.summary()}>"

    def _repr_html_(self) -> str:
        top = Table(self.table.rows[:20], self.table.columns, "the 20 edges of largest |score|")
        return f"<p>{html.escape(self.summary())}</p>{top._repr_html_()}"


def _default_counts(total: int) -> list[int]:
    out, k = [], 1
    while k < total:
        out += [n for n in (k, 2 * k, 5 * k) if n < total]
        k *= 10
    return sorted(set(out)) + [total]


class Selection:
    """A circuit: a set of edges of a :class:`Circuit`'s graph (``edges``: ``[nodes, targets]`` bool)."""

    def __init__(self, circuit: Circuit, edges: Tensor, how: str) -> None:
        self.circuit, self.edges, self.how = circuit, edges, how
        self.table = edge_table(circuit.graph, circuit.scores, edges, title=f"circuit ({how})")

    def __len__(self) -> int:
        return int(self.edges.sum())

    @property
    def nodes(self) -> list[str]:
        """The nodes that write through at least one edge of the circuit, in forward order."""
        g = self.circuit.graph
        return [g.nodes[i].name for i in range(len(g.nodes)) if bool(self.edges[i].any())]

    def pruned(self) -> Selection:
        """The same circuit less the edges not on a path from the input to the logits (they change
        nothing when it runs; :func:`~probe.intervene.circuit.graph.connected`)."""
        return Selection(self.circuit, connected(self.circuit.graph, self.edges), self.how + ", pruned")

    def evaluate(self) -> dict[str, float]:
        """``{"edges", "metric", "kept", "faithfulness"}``: the model run on the clean inputs with
        every edge outside this circuit given its corrupted value
        (:mod:`~probe.intervene.circuit.evaluate`); ``kept``: the metric over the clean run's,
        ``faithfulness``: ``(metric - corrupted) / (clean - corrupted)``."""
        value = circuit_metric(self.circuit.attached(), self.edges)
        refs = self.circuit.reference_values()
        return {
            "edges": len(self),
            "metric": value,
            "kept": value / refs["clean"] if refs["clean"] else float("nan"),
            "faithfulness": faithfulness(value, refs),
        }

    def to_dict(self) -> dict[str, Any]:
        return {"how": self.how, "edges": self.table.column("edge")}

    def __repr__(self) -> str:
        return f"<Selection {self.how}: {len(self)} edges, {len(self.nodes)} nodes>"


class Faithfulness(Exports):
    """The faithfulness curve: ``table`` (edges, share of all edges, metric, kept: the metric over
    the clean run's, faithfulness) and ``references`` (the metric on the clean and the corrupted
    inputs)."""

    def __init__(self, table: Table, references: dict[str, float], how: str) -> None:
        self.table, self.references, self.how = table, references, how

    def to_dict(self) -> dict[str, Any]:
        return {"how": self.how, "references": self.references, "curve": self.table.to_dict()["rows"]}

    def smallest(self, at_least: float) -> int | None:
        """The fewest edges whose circuit reaches faithfulness ``at_least`` (None if none does)."""
        ok = [
            r["edges"]
            for r in self.table.rows
            if not math.isnan(r["faithfulness"]) and r["faithfulness"] >= at_least
        ]
        return min(ok) if ok else None

    def __str__(self) -> str:
        r = self.references
        return f"clean {r['clean']:.4g}, corrupted {r['corrupted']:.4g} ({self.how})\n{self.table.to_text()}"

    def _repr_html_(self) -> str:
        return self.table._repr_html_()


__all__ = ["Circuit", "Selection", "Faithfulness", "edge_table", "EDGE_COLUMNS"]
