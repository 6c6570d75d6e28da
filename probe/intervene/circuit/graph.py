"""The computational graph of a circuit: nodes that write to the residual stream, targets that read it.

A transformer whose residual stream is a sum (pre-norm, parallel blocks, attention-only) is a
graph (Elhage et al. 2021; Conmy et al. 2023): every component reads the sum of what the
components before it wrote, so the stream entering a component can be split into one term per
upstream writer, and each such term is an **edge**.

* **Nodes** (writers): ``input`` (the stream entering the first layer: token and position
  embeddings), every attention head ``L{l}.H{h}`` (its write: its slice of the output projection
  applied to its output), every MLP ``L{l}.MLP`` (its output).
* **Targets** (readers): each head's query input ``L{l}.H{h}.q``; its key and value inputs
  ``L{l}.H{h}.k`` / ``.v``, or, under grouped-query attention (several query heads sharing one
  key/value head), one key and one value input per key/value head, ``L{l}.KV{g}.k`` / ``.v``;
  every MLP's input ``L{l}.MLP``; and the ``logits`` (the stream entering the final norm and
  unembedding).
* **Edges**: every node to every target after it in the forward. Layer ``l``'s heads feed layer
  ``l``'s MLP, unless the block is parallel (GPT-J, Falcon: the MLP reads the same stream as the
  attention).

Each node and target has an ``order``: ``input`` 0, layer ``l``'s attention ``2l+1``, its MLP
``2l+2`` (``2l+1`` when parallel), the logits ``2L+1``; an edge joins a node to a target of
larger order. The graph is plain data (:meth:`Graph.to_dict` / :meth:`Graph.from_dict` round-trip
through JSON); scores live beside it as a ``[nodes, targets]`` tensor.
"""

from __future__ import annotations

import heapq
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from probe.errors import ProbeError


@dataclass(frozen=True)
class LayerSpec:
    """One layer's shape: ``heads`` query heads, ``kv_heads`` key/value heads (``kv_of[h]`` is
    head ``h``'s), whether it has an attention and an MLP, and whether the MLP is ``parallel``."""

    layer: int
    heads: int = 0
    kv_heads: int = 0
    kv_of: tuple[int, ...] = ()
    attention: bool = True
    mlp: bool = True
    parallel: bool = False

    def __post_init__(self) -> None:
        if self.attention:
            if not self.kv_of:
                object.__setattr__(self, "kv_of", tuple(range(self.heads)))
            if not self.kv_heads:
                object.__setattr__(self, "kv_heads", self.heads)
            if len(self.kv_of) != self.heads or any(not 0 <= g < self.kv_heads for g in self.kv_of):
                raise ProbeError(f"layer {self.layer}: kv_of must give each of {self.heads} heads a kv head")

    @property
    def grouped(self) -> bool:
        """Grouped-query attention: fewer key/value heads than query heads."""
        return self.kv_heads != self.heads


@dataclass(frozen=True)
class Node:
    """A writer to the stream: ``kind`` ``"input"``, ``"head"`` or ``"mlp"``."""

    name: str
    kind: str
    layer: int
    head: int | None
    order: int


@dataclass(frozen=True)
class Target:
    """A reader of the stream: ``kind`` ``"q"``, ``"k"``, ``"v"``, ``"mlp"`` or ``"logits"``.

    ``head``: the query head (``q``), the key/value head (``k``, ``v``), else None; ``heads``: the
    query heads that read through it (for ``k``/``v`` under GQA, every head sharing the kv head).
    """

    name: str
    kind: str
    layer: int
    head: int | None
    order: int
    heads: tuple[int, ...] = ()


@dataclass
class Graph:
    """Nodes, targets and edges of a one-stack model (see the module docstring)."""

    layers: list[LayerSpec]
    stack: str = "decoder"
    model: str = ""
    nodes: list[Node] = field(init=False)
    targets: list[Target] = field(init=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ProbeError("a circuit graph needs at least one layer")
        nodes, targets = [Node("input", "input", -1, None, 0)], []
        for spec in self.layers:
            l, att = spec.layer, 2 * spec.layer + 1
            if spec.attention:
                for h in range(spec.heads):
                    targets.append(Target(f"L{l}.H{h}.q", "q", l, h, att, (h,)))
                for g in range(spec.kv_heads):
                    readers = tuple(h for h in range(spec.heads) if spec.kv_of[h] == g)
                    base = f"L{l}.KV{g}" if spec.grouped else f"L{l}.H{g}"
                    targets += [Target(f"{base}.{r}", r, l, g, att, readers) for r in "kv"]
                nodes += [Node(f"L{l}.H{h}", "head", l, h, att) for h in range(spec.heads)]
            if spec.mlp:
                mlp = att if spec.parallel else att + 1
                targets.append(Target(f"L{l}.MLP", "mlp", l, None, mlp))
                nodes.append(Node(f"L{l}.MLP", "mlp", l, None, mlp))
        last = 2 * max(s.layer for s in self.layers) + 3
        targets.append(Target("logits", "logits", -1, None, last))
        self.nodes, self.targets = nodes, targets
        self._node_index = {n.name: i for i, n in enumerate(nodes)}
        self._target_index = {t.name: i for i, t in enumerate(targets)}

    # -- lookups ------------------------------------------------------------------------------
    def node(self, name: str) -> int:
        """The index of node ``name`` (``input``, ``L1.H2``, ``L0.MLP``)."""
        if name not in self._node_index:
            raise ProbeError(f"no node {name!r} in the graph; nodes are like input, L0.H1, L0.MLP")
        return self._node_index[name]

    def target(self, name: str) -> int:
        """The index of target ``name`` (``L1.H2.k``, ``L1.KV0.v``, ``L0.MLP``, ``logits``)."""
        if name not in self._target_index:
            raise ProbeError(f"no target {name!r} in the graph; targets are like L1.H0.q, L0.MLP, logits")
        return self._target_index[name]

    def edge(self, name: str) -> tuple[int, int]:
        """``(node, target)`` indices of an edge named ``"L0.H1 -> L1.H2.k"``."""
        parts = [p.strip() for p in name.split("->")]
        if len(parts) != 2:
            raise ProbeError(f"an edge is named 'NODE -> TARGET' (e.g. 'L0.H1 -> L1.H3.k'), not {name!r}")
        i, j = self.node(parts[0]), self.target(parts[1])
        if not self.nodes[i].order < self.targets[j].order:
            raise ProbeError(f"{name!r} is not an edge: {parts[0]} does not run before {parts[1]}")
        return i, j

    def edge_name(self, i: int, j: int) -> str:
        return f"{self.nodes[i].name} -> {self.targets[j].name}"

    def mask(self) -> Tensor:
        """``[nodes, targets]`` bool: which (node, target) pairs are edges."""
        src = torch.tensor([n.order for n in self.nodes])
        dst = torch.tensor([t.order for t in self.targets])
        return src[:, None] < dst[None, :]

    @property
    def n_edges(self) -> int:
        return int(self.mask().sum())

    def upstream(self, j: int) -> int:
        """How many nodes feed target ``j`` (nodes are in order, so they are the first ones)."""
        order = self.targets[j].order
        return sum(1 for n in self.nodes if n.order < order)

    def readers(self, i: int) -> list[int]:
        """The targets through which node ``i`` reads the stream (a head: its q, k and v targets;
        an MLP: its input; the input node: none)."""
        n = self.nodes[i]
        if n.kind == "mlp":
            return [self.target(n.name)]
        if n.kind != "head":
            return []
        return [
            j
            for j, t in enumerate(self.targets)
            if t.layer == n.layer and t.kind in ("q", "k", "v") and n.head in t.heads
        ]

    def layer_spec(self, layer: int) -> LayerSpec:
        for s in self.layers:
            if s.layer == layer:
                return s
        raise ProbeError(f"no layer {layer} in the graph")

    # -- data ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data: the layer shapes (which define every node and target) and the names."""
        return {
            "model": self.model,
            "stack": self.stack,
            "layers": [asdict(s) | {"kv_of": list(s.kv_of)} for s in self.layers],
            "nodes": [asdict(n) for n in self.nodes],
            "targets": [asdict(t) | {"heads": list(t.heads)} for t in self.targets],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Graph:
        try:
            layers = [LayerSpec(**(d | {"kv_of": tuple(d["kv_of"])})) for d in data["layers"]]
            g = cls(layers, data.get("stack", "decoder"), data.get("model", ""))
        except (KeyError, TypeError) as err:
            raise ProbeError(f"not a circuit graph's data (missing or wrong field: {err})") from None
        names = [n["name"] for n in data.get("nodes", [])]
        if names and names != [n.name for n in g.nodes]:
            raise ProbeError(
                "the graph's node list does not match its layers; the JSON was edited or damaged"
            )
        return g

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_json(cls, text: str) -> Graph:
        return cls.from_dict(json.loads(text))


def top_edges(graph: Graph, scores: Tensor, n: int, absolute: bool = True) -> Tensor:
    """``[nodes, targets]`` bool: the ``n`` edges with the largest (absolute) score."""
    mask = graph.mask()
    if not 0 <= n <= int(mask.sum()):
        raise ProbeError(f"the graph has {int(mask.sum())} edges; cannot choose {n}")
    key = scores.abs() if absolute else scores.clone()
    key = torch.where(mask & ~key.isnan(), key, torch.tensor(float("-inf")))
    chosen = torch.zeros_like(mask)
    if n:
        flat = torch.topk(key.flatten(), n).indices
        chosen.view(-1)[flat] = True
    return chosen & mask


def greedy_edges(graph: Graph, scores: Tensor, n: int, absolute: bool = True) -> Tensor:
    """``n`` edges chosen greedily from the logits backwards (as EAP-IG's ``apply_greedy``): start
    with the edges into the logits as candidates; repeatedly take the candidate of largest
    (absolute) score, and when its node is new to the circuit, make the edges into that node's
    targets candidates too. Every chosen edge is so connected to the logits."""
    mask = graph.mask()
    if not 0 <= n <= int(mask.sum()):
        raise ProbeError(f"the graph has {int(mask.sum())} edges; cannot choose {n}")
    key = (scores.abs() if absolute else scores).nan_to_num(float("-inf"))
    chosen = torch.zeros_like(mask)
    heap: list[tuple[float, int, int]] = []

    ups = [graph.upstream(j) for j in range(len(graph.targets))]

    def push(j: int) -> None:
        for i in range(ups[j]):
            heapq.heappush(heap, (-float(key[i, j]), i, j))

    push(len(graph.targets) - 1)
    seen, count = set(), 0
    while count < n and heap:
        _, i, j = heapq.heappop(heap)
        if chosen[i, j]:
            continue
        chosen[i, j] = True
        count += 1
        if i not in seen:
            seen.add(i)
            for t in graph.readers(i):
                push(t)
    return chosen


def connected(graph: Graph, chosen: Tensor) -> Tensor:
    """``chosen`` less every edge that is not on a path from the input to the logits inside it.

    Such an edge changes nothing when the circuit runs: a node none of whose inputs is in the
    circuit reads only corrupted values, so it writes its corrupted output through every edge."""
    kept = chosen & graph.mask()
    while True:
        from_input, to_logits = _reaches(graph, kept)
        ok = kept & from_input[:, None] & to_logits[None, :]
        if torch.equal(ok, kept):
            return kept
        kept = ok


def _reaches(graph: Graph, kept: Tensor) -> tuple[Tensor, Tensor]:
    """``[nodes]`` bool: reached from the input through ``kept`` edges; ``[targets]`` bool: reach
    the logits through them (nodes and targets are in forward order)."""
    reads = [graph.readers(i) for i in range(len(graph.nodes))]
    from_input = torch.zeros(len(graph.nodes), dtype=torch.bool)
    from_input[0] = True
    for i in range(1, len(graph.nodes)):
        from_input[i] = any(bool((kept[:i, j] & from_input[:i]).any()) for j in reads[i])
    to_logits = torch.zeros(len(graph.targets), dtype=torch.bool)
    to_logits[-1] = True
    for i in reversed(range(len(graph.nodes))):
        if bool((kept[i] & to_logits).any()):
            to_logits[reads[i]] = True
    return from_input, to_logits


__all__ = ["Graph", "LayerSpec", "Node", "Target", "top_edges", "greedy_edges", "connected"]
