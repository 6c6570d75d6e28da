"""The circuit section: which edges carry a behaviour, drawn as the model's graph, with the
faithfulness curve and the table of edges.

The circuit comes from ``probe.report(..., circuit=c)`` (a :func:`probe.circuit` result, a circuit
chosen from it such as ``c.greedy(8)``, or the JSON file ``c.to_json(path)`` wrote) and the curve
from ``circuit_curve=`` (``c.evaluate(...)``), or is computed once by :func:`circuit_input` when
the result still has its model; this section never runs the model. It reads the result's plain
data only (``to_dict()``), so the report never imports :mod:`probe.intervene`.

The graph is inline SVG (:mod:`~probe.report.sections._circuit_layout`): the embeddings at the
bottom, each layer's heads in a row with its MLP above, the logits on top; the edges of largest
``|score|`` drawn with a width linear in ``|score|`` (red: positive, the edge carries the clean
behaviour; blue: negative). Clicking a head, or Enter on it, shows it in the report's head
explorers (``static/circuit_graph.js``).
"""

from __future__ import annotations

import base64
import csv
import io
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

from markupsafe import Markup

from probe.errors import ProbeError
from probe.report.sections._circuit_curve import curve_figure, finite
from probe.report.sections._circuit_layout import NEGATIVE, POSITIVE, WIDTH, layout

TITLE = "Circuit"
ORDER = 46  # after "Which heads matter" (45)
SHOWN = 40  # edges drawn in the graph and listed in the table
WHAT = (
    "circuit= takes probe.circuit's result, a circuit chosen from it (c.greedy(n), c.top(n), "
    "c.edges([...])) or the JSON file c.to_json(path) wrote"
)


def _read_json(path: str | os.PathLike, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProbeError(f"{what}: {path} does not exist") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ProbeError(f"{what}: {path} is not JSON ({err})") from None


def _circuit_data(circuit: Any) -> tuple[Any, dict, list[str] | None, str | None]:
    """``(the result object or None, its plain data, the chosen edges or None, how chosen)``."""
    if isinstance(circuit, (str, os.PathLike)):
        obj, data, chosen, how = None, _read_json(circuit, "circuit="), None, None
    elif hasattr(circuit, "circuit") and hasattr(circuit, "edges") and hasattr(circuit, "table"):
        obj, chosen, how = circuit.circuit, list(circuit.table.column("edge")), str(circuit.how)
        data = obj.to_dict()
    elif callable(getattr(circuit, "to_dict", None)):
        obj, data, chosen, how = circuit, circuit.to_dict(), None, None
    else:
        raise ProbeError(f"{WHAT}, not {type(circuit).__name__}")
    if not isinstance(data, dict) or data.get("kind") != "probe.circuit" or "graph" not in data:
        raise ProbeError(f"{WHAT}: this is not a circuit's data (no 'kind': 'probe.circuit')")
    return obj, data, chosen, how


def _curve_data(curve: Any) -> dict:
    data = _read_json(curve, "circuit_curve=") if isinstance(curve, (str, os.PathLike)) else curve
    if callable(getattr(data, "to_dict", None)):
        data = data.to_dict()
    if not isinstance(data, dict) or not isinstance(data.get("curve"), list):
        raise ProbeError(
            "circuit_curve= takes the faithfulness curve c.evaluate([...]) returns, or the JSON file "
            "its to_json(path) wrote"
        )
    return {"how": data.get("how", ""), "references": data.get("references") or {}, "rows": data["curve"]}


def circuit_input(circuit: Any, curve: Any = None) -> dict[str, Any]:
    """``circuit=`` and ``circuit_curve=`` of :func:`probe.report` as plain data (read, and refused
    with a one-line :class:`ProbeError`, before any section runs). Without a curve, a result that
    still has its model is evaluated here (``c.evaluate()``: the greedy circuits of 1, 2, 5, 10, ...
    edges up to all of them, each a run of the model)."""
    if circuit is None:
        raise ProbeError("circuit_curve= goes with circuit=: give the circuit its curve belongs to")
    obj, data, chosen, how = _circuit_data(circuit)
    if curve is None and obj is not None and getattr(obj, "task", None) is not None:
        curve = obj.evaluate()
    return {
        "data": data,
        "chosen": chosen,
        "how": how,
        "curve": None if curve is None else _curve_data(curve),
    }


def edge_rows(data: dict) -> list[dict]:
    """Every scored edge of the circuit's data, by ``|score|`` (largest first), ranked from 1; each
    with its source, target and the target's input (``q``, ``k``, ``v``, ``mlp``, ``logits``)."""
    kinds = {t["name"]: t["kind"] for t in data["graph"]["targets"]}
    rows = []
    for e in data.get("edges", []):
        score = e.get("score")
        if not finite(score):
            continue
        source, target = (p.strip() for p in e["edge"].split("->"))
        if target not in kinds:
            raise ProbeError(
                f"the circuit's edge {e['edge']!r} has no target in its graph; the JSON was edited"
            )
        rows.append(
            {"edge": e["edge"], "source": source, "target": target, "input": kinds[target], "score": score}
        )
    rows.sort(key=lambda r: -abs(r["score"]))
    return [r | {"rank": i} for i, r in enumerate(rows, 1)]


def _check_cache(ctx, graph: dict) -> None:
    """A ProbeError when the report's first cache holds patterns of another model's heads."""
    cache, stack = ctx.cache, graph.get("stack", "decoder")
    if stack not in cache.stacks:
        return
    heads = {s["layer"]: s.get("heads", 0) for s in graph["layers"] if s.get("attention", True)}
    for layer in cache.pattern_layers(stack, "self"):
        have = cache.pattern(stack, layer, "self", batch=0).shape[0]
        if heads.get(layer) != have:
            raise ProbeError(
                f"the circuit's graph has {heads.get(layer, 0)} heads in layer {layer}, the cache {have}: "
                "give a circuit scored on the cached model"
            )


def _csv_uri(rows: list[dict], columns: list[str]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow([r[c] for c in columns])
    raw = ("\ufeff" + buf.getvalue()).encode("utf-8")  # the byte-order mark: spreadsheets read UTF-8
    return "data:text/csv;charset=utf-8;base64," + base64.b64encode(raw).decode("ascii")


def _kept_if_removed(data: dict, score: float) -> float | None:
    """The share of the clean metric left with this edge alone corrupted: exact for patching's
    scores (``M(clean) - M(edge corrupted)``), not given for the estimates."""
    clean = (data.get("references") or {}).get("clean")
    if data.get("method") != "patching" or not finite(clean) or clean == 0:
        return None
    return (clean - score) / clean


def _table(data: dict, shown: list[dict]) -> dict:
    kept = [_kept_if_removed(data, r["score"]) for r in shown]
    has_kept = any(k is not None for k in kept)
    rows = [r | {"kept_if_removed": k} for r, k in zip(shown, kept, strict=True)]
    columns = ["rank", "edge", "source", "target", "input", "score"] + (
        ["kept_if_removed"] if has_kept else []
    )
    return {
        "rows": [
            r | {"score_text": f"{r['score']:.4g}", "kept_text": "" if k is None else f"{k:.3f}"}
            for r, k in zip(rows, kept, strict=True)
        ],
        "kept": has_kept,
        "csv": _csv_uri(rows, columns),
    }


def _facts(data: dict, n_all: int, chosen: list[str] | None, how: str | None) -> dict:
    refs = data.get("references") or {}
    g = data["graph"]
    return {
        "model": g.get("model") or "the model",
        "nodes": len(g["nodes"]),
        "targets": len(g["targets"]),
        "edges": n_all,
        "method": data.get("method", ""),
        "steps": data.get("steps", 1),
        "metric": data.get("metric", ""),
        "clean": f"{refs['clean']:.4g}" if finite(refs.get("clean")) else None,
        "corrupted": f"{refs['corrupted']:.4g}" if finite(refs.get("corrupted")) else None,
        "chosen": None if chosen is None else len(chosen),
        "how": how,
    }


def build(ctx) -> dict | None:
    """Data for the template; None unless the report was given a circuit."""
    given = ctx.results.get("circuit")
    if given is None:
        return None
    ctx.progress("circuit")
    data = given["data"]
    _check_cache(ctx, data["graph"])
    rows = edge_rows(data)
    chosen = given["chosen"]
    pool = rows if chosen is None else [r for r in rows if r["edge"] in set(chosen)]
    shown = pool[:SHOWN]
    curve = given["curve"]
    js = resources.files("probe.report").joinpath("static", "circuit_graph.js").read_text("utf-8")
    return {
        "facts": _facts(data, len(rows), chosen, given["how"]),
        "pool": len(pool),
        "graph": layout(data["graph"], shown),
        "table": _table(data, shown),
        "curve": None if curve is None else curve_figure(curve["rows"]),
        "curve_how": None if curve is None else curve["how"],
        "colours": {"positive": POSITIVE, "negative": NEGATIVE},
        "widths": WIDTH,
        "js": Markup(js),
    }
