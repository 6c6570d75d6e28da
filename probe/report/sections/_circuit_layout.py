"""Where the circuit section draws each node and edge of a circuit's graph (the template writes the SVG).

Works on the graph's plain data (``Circuit.to_dict()["graph"]``: its layers, nodes and targets),
so the report never imports :mod:`probe.intervene`. Rows from the bottom: the embeddings
(``input``), then per layer its heads in one row and its MLP in the row above (in the heads' row
when the block is parallel), in a column right of the heads so that the MLPs' edges pass no head;
the logits on top. An edge runs from the top of its source to its
target's port: a head's query, key and value ports sit left, middle and right under it (under
grouped-query attention a key/value head's ports sit under the middle of the heads that share
it), an MLP's and the logits' under their middle.
"""

from __future__ import annotations

import math
from typing import Any

PITCH = 58  # horizontal distance between the centres of two heads
ROW = 70  # vertical distance between two rows
NODE_W, NODE_H = 46, 20
WIDE_W = 96  # the embeddings and the logits
MLP_W = 56  # an MLP, in a column right of the heads: in its own row, or in the heads' row when parallel
LEFT, PAD = 52, 18  # room for the layer labels; margin
PORT = {"q": -13, "k": 0, "v": 13}
WIDTH = (1.0, 7.0)  # stroke width of the smallest and the largest |score| drawn
ZOOM = (1.0, 2.0, 640)  # a small graph is drawn larger: up to 2x, to about 640 px wide
POSITIVE, NEGATIVE = "#b2182b", "#2166ac"  # RdBu, as the importance maps: red carries the clean behaviour


def _rows(layers: list[dict]) -> list[tuple[str, int]]:
    """The rows from the bottom: ``("input", -1)``, ``("heads", l)``, ``("mlp", l)``, ``("logits", -1)``."""
    rows = [("input", -1)]
    for spec in layers:
        if spec.get("attention", True) and spec.get("heads", 0):
            rows.append(("heads", spec["layer"]))
        if spec.get("mlp", True) and not (spec.get("parallel") and spec.get("attention", True)):
            rows.append(("mlp", spec["layer"]))
    return rows + [("logits", -1)]


def node_boxes(graph: dict) -> tuple[dict[str, dict], list[dict], float, float]:
    """``(boxes by node name, layer labels, width, height)``: each box ``x, y`` (top left), ``w, h``,
    ``cx`` (its centre) and its ``row``'s label."""
    layers = graph["layers"]
    cols = max([s.get("heads", 0) for s in layers] + [2])
    mlps = any(s.get("mlp", True) for s in layers)
    mid = LEFT + cols * PITCH / 2
    right = LEFT + cols * PITCH + MLP_W / 2 + 12  # the MLPs' column, beside the heads
    rows = _rows(layers)
    height = 2 * PAD + (len(rows) - 1) * ROW + NODE_H
    width = LEFT + cols * PITCH + (MLP_W + 12 if mlps else 0) + PAD
    heads = {s["layer"]: s.get("heads", 0) for s in layers}
    boxes, labels = {}, []

    def put(name: str, cx: float, y: float, w: float) -> None:
        boxes[name] = {"x": cx - w / 2, "y": y, "w": w, "h": NODE_H, "cx": cx}

    for r, (kind, layer) in enumerate(rows):
        y = PAD + (len(rows) - 1 - r) * ROW
        if kind in ("input", "logits"):
            put(kind, mid, y, WIDE_W)
        elif kind == "mlp":
            put(f"L{layer}.MLP", right, y, MLP_W)
            labels.append({"text": f"L{layer}", "y": y + NODE_H / 2})
        else:
            n = heads[layer]
            first = mid - (n - 1) * PITCH / 2
            for h in range(n):
                put(f"L{layer}.H{h}", first + h * PITCH, y, NODE_W)
            labels.append({"text": f"L{layer}", "y": y + NODE_H / 2})
            spec = next(s for s in layers if s["layer"] == layer)
            if spec.get("parallel") and spec.get("mlp", True):
                put(f"L{layer}.MLP", right, y, MLP_W)
    return boxes, labels, width, height


def port(target: dict, boxes: dict[str, dict]) -> tuple[float, float]:
    """Where an edge into ``target`` (a graph target's plain data) ends: under its node."""
    kind, layer = target["kind"], target["layer"]
    if kind == "logits":
        b = boxes["logits"]
        return b["cx"], b["y"] + b["h"]
    if kind == "mlp":
        b = boxes[f"L{layer}.MLP"]
        return b["cx"], b["y"] + b["h"]
    readers = target.get("heads") or [target["head"]]
    under = [boxes[f"L{layer}.H{h}"] for h in readers]
    cx = sum(b["cx"] for b in under) / len(under)
    return cx + PORT[kind], under[0]["y"] + NODE_H


def edge_path(src: dict, end: tuple[float, float]) -> str:
    """A cubic curve from the top middle of box ``src`` up to ``end``."""
    sx, sy = src["cx"], src["y"]
    tx, ty = end
    bend = max(18.0, (sy - ty) * 0.4)
    return f"M{sx:.1f} {sy:.1f} C{sx:.1f} {sy - bend:.1f} {tx:.1f} {ty + bend:.1f} {tx:.1f} {ty:.1f}"


def stroke(score: float, top: float) -> float:
    """The stroke width of an edge: linear in ``|score|`` from WIDTH[0] (0) to WIDTH[1] (``top``)."""
    share = abs(score) / top if top > 0 else 0.0
    return round(WIDTH[0] + (WIDTH[1] - WIDTH[0]) * share, 3)


def layout(graph: dict, edges: list[dict]) -> dict[str, Any]:
    """The drawing of ``edges`` (rows of the circuit's edge table: ``edge, source, target, score``)
    on ``graph``: nodes (boxes, which are on an edge drawn), edges (paths, widths, colours; the
    smallest first, so the largest lie on top), the used ports, the size."""
    boxes, labels, width, height = node_boxes(graph)
    targets = {t["name"]: t for t in graph["targets"]}
    top = max((abs(e["score"]) for e in edges), default=0.0)
    drawn, used, ports = [], set(), {}
    for e in sorted(edges, key=lambda e: abs(e["score"])):
        t = targets[e["target"]]
        end = port(t, boxes)
        reader = f"L{t['layer']}.MLP" if t["kind"] == "mlp" else "logits" if t["kind"] == "logits" else None
        readers = [reader] if reader else [f"L{t['layer']}.H{h}" for h in t.get("heads") or [t["head"]]]
        drawn.append(
            e
            | {
                "readers": " ".join(readers),
                "d": edge_path(boxes[e["source"]], end),
                "width": stroke(e["score"], top),
                "opacity": round(0.3 + 0.55 * (abs(e["score"]) / top if top > 0 else 0.0), 3),
                "colour": POSITIVE if e["score"] >= 0 else NEGATIVE,
                "sign": "positive" if e["score"] >= 0 else "negative",
            }
        )
        used.update([e["source"], *readers])
        if t["kind"] in PORT:
            ports[t["name"]] = {"x": end[0], "y": end[1] + 9, "text": t["kind"]}
    nodes = []
    for n in graph["nodes"] + [{"name": "logits", "kind": "logits", "layer": -1, "head": None}]:
        b = boxes[n["name"]]
        label = {"input": "embeddings", "logits": "logits", "mlp": "MLP"}.get(n["kind"], f"H{n['head']}")
        nodes.append(n | b | {"label": label, "on": n["name"] in used})
    return {
        "nodes": nodes,
        "labels": labels,
        "edges": drawn,
        "ports": list(ports.values()),
        "width": math.ceil(width),
        "height": math.ceil(height + 8),
        "zoom": round(min(ZOOM[1], max(ZOOM[0], ZOOM[2] / width)), 3),
        "top": top,
    }
