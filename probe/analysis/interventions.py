"""The results of interventions as data: :class:`HeadImportance` and :class:`Patching`.

They hold numbers only (tables and ``[layers, heads]`` / ``[layers, positions]`` grids), so the
report can show them without running a model (``probe.intervene`` computes them). Both save to
and load from one JSON file: ``result.save(path)``, ``HeadImportance.load(path)``,
``load_result(path)`` (either kind). NaN (a layer with fewer heads) is stored as ``null``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from probe.analysis.residual.exports import TableExports
from probe.analysis.table import Table
from probe.errors import ProbeError

FORMAT = 1


def _grid_list(t: Tensor) -> list[list[float | None]]:
    return [[None if math.isnan(v) else v for v in row] for row in t.tolist()]


def _grid_tensor(values: Any, what: str, path: Any) -> Tensor:
    try:
        return torch.tensor([[math.nan if v is None else float(v) for v in row] for row in values])
    except (TypeError, ValueError) as e:
        raise ProbeError(f"{path}: {what} is not a grid of numbers ({e}); save the result again") from None


def _save(obj: dict, path: str | os.PathLike) -> str:
    from probe.files import write_text_atomic

    text = json.dumps(obj, allow_nan=False, indent=1)
    write_text_atomic(path, text)
    return str(path)


def _rows(d: dict, path: Any) -> list[dict]:
    t = d.get("table")
    rows = t.get("rows") if isinstance(t, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ProbeError(f"{path}: no table of rows; save the result again with result.save(path)")
    return [{k: (math.nan if v is None else v) for k, v in r.items()} for r in rows]


@dataclass
class HeadImportance(TableExports):
    """Per head: ``metric`` (unablated), ``ablated`` (with the head removed), ``change`` =
    ablated - metric, and ``gradient`` = ∂metric/∂ξ_h (Michel et al. 2019). ``grid`` and
    ``gradients`` are ``[layers, heads]`` (``rows`` name the layers; NaN where a layer has fewer
    heads). ``notes``: what the reader should know (e.g. that the ablations ran one forward per
    head, and why). ``texts``: the input texts when they were text (else empty)."""

    metric_name: str
    how: str
    table: Table
    grid: Tensor
    gradients: Tensor
    rows: list[str]
    notes: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def main_table(self) -> Table:
        return self.table

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric_name,
            "how": self.how,
            "table": self.table.to_dict(),
            "rows": self.rows,
            "change": self.grid.tolist(),
            "gradient": self.gradients.tolist(),
            "notes": list(self.notes),
            "texts": list(self.texts),
        }

    def save(self, path: str | os.PathLike) -> str:
        """Write the whole result to ``path`` as JSON (atomically); :meth:`load` reads it back."""
        d = self.to_dict()
        d.update(kind="head_importance", format=FORMAT)
        d["change"], d["gradient"] = _grid_list(self.grid), _grid_list(self.gradients)
        d["table"] = {"columns": self.table.columns, "rows": _plain_rows(self.table)}
        return _save(d, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> HeadImportance:
        """A result written by :meth:`save`; a one-line :class:`ProbeError` for anything else."""
        r = load_result(path)
        if not isinstance(r, cls):
            raise ProbeError(f"{path} holds a {type(r).__name__} result, not head importance")
        return r

    def __str__(self) -> str:
        lines = [f"head importance: change of {self.metric_name} when a head is removed ({self.how})"]
        n = self.grid.shape[1]
        lines.append("     " + " ".join(f"{'H' + str(h):>8}" for h in range(n)))
        for r, vals in zip(self.rows, self.grid.tolist(), strict=True):
            lines.append(f"{r:5}" + " ".join(f"{v:8.4f}" for v in vals))
        return "\n".join(lines)


@dataclass
class Patching(TableExports):
    """The effect of each patch. ``table`` rows: ``stack``, ``layer``, ``component`` (e.g.
    ``L1.H2``, ``L0.resid@3``), ``pos`` (None when every position was patched), ``token``,
    ``head`` (``what="heads"``), ``metric`` (raw) and ``normalised``. ``grid`` ``[layers, positions
    or heads]`` holds ``normalised`` (``rows``/``cols`` label its axes). ``clean``/``corrupted``:
    the metric on the unpatched runs.
    """

    what: str
    metric_name: str
    clean: float
    corrupted: float
    table: Table
    grid: Tensor
    rows: list[str]
    cols: list[str]
    notes: list[str] = field(default_factory=list)

    def main_table(self) -> Table:
        return self.table

    def to_dict(self) -> dict[str, Any]:
        """Plain Python: the table, the two reference metrics, the grid as nested lists, notes."""
        return {
            "what": self.what,
            "metric": self.metric_name,
            "clean": self.clean,
            "corrupted": self.corrupted,
            "table": self.table.to_dict(),
            "grid": {"rows": self.rows, "cols": self.cols, "values": self.grid.tolist()},
            "notes": list(self.notes),
        }

    def save(self, path: str | os.PathLike) -> str:
        """Write the whole result to ``path`` as JSON (atomically); :meth:`load` reads it back."""
        d = self.to_dict()
        d.update(kind="patching", format=FORMAT)
        d["grid"]["values"] = _grid_list(self.grid)
        d["table"] = {"columns": self.table.columns, "rows": _plain_rows(self.table)}
        for k in ("clean", "corrupted"):
            d[k] = None if math.isnan(d[k]) else d[k]
        return _save(d, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Patching:
        """A result written by :meth:`save`; a one-line :class:`ProbeError` for anything else."""
        r = load_result(path)
        if not isinstance(r, cls):
            raise ProbeError(f"{path} holds a {type(r).__name__} result, not patching")
        return r

    def __str__(self) -> str:
        head = f"patching {self.what}: {self.metric_name}, "
        head += f"clean {self.clean:.4g}, corrupted {self.corrupted:.4g}"
        w = max(len(r) for r in self.rows) if self.rows else 0
        lines = [head, " " * w + " " + " ".join(f"{c:>7}" for c in self.cols)]
        for r, vals in zip(self.rows, self.grid.tolist(), strict=True):
            lines.append(r.ljust(w) + " " + " ".join(f"{v:7.3f}" for v in vals))
        return "\n".join(lines) + "".join(f"\nnote: {n}" for n in self.notes)


def _plain_rows(table: Table) -> list[dict]:
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in table]


def load_result(path: str | os.PathLike) -> HeadImportance | Patching:
    """The :class:`HeadImportance` or :class:`Patching` that ``result.save(path)`` wrote.

    A missing, unreadable or foreign file raises a one-line :class:`ProbeError` naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ProbeError(f"{path}: no such file; write one with result.save(path)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProbeError(f"{path}: not a saved probe result ({e})") from None
    kind = d.get("kind") if isinstance(d, dict) else None
    if kind not in ("head_importance", "patching"):
        raise ProbeError(
            f"{path}: not a saved head-importance or patching result (no 'kind'); "
            "write one with probe.head_importance(...).save(path) or probe.patch(...).save(path)"
        )
    try:
        if kind == "head_importance":
            t = d["table"]
            return HeadImportance(
                str(d["metric"]),
                str(d["how"]),
                Table(_rows(d, path), t["columns"], "head importance"),
                _grid_tensor(d["change"], "change", path),
                _grid_tensor(d["gradient"], "gradient", path),
                [str(r) for r in d["rows"]],
                list(d.get("notes", [])),
                list(d.get("texts", [])),
            )
        g = d["grid"]
        return Patching(
            str(d["what"]),
            str(d["metric"]),
            math.nan if d["clean"] is None else float(d["clean"]),
            math.nan if d["corrupted"] is None else float(d["corrupted"]),
            Table(_rows(d, path), d["table"]["columns"], f"patching {d['what']}"),
            _grid_tensor(g["values"], "grid", path),
            [str(r) for r in g["rows"]],
            [str(c) for c in g["cols"]],
            list(d.get("notes", [])),
        )
    except (KeyError, TypeError) as e:
        raise ProbeError(f"{path}: a {kind} result missing {e}; save the result again") from None


__all__ = ["HeadImportance", "Patching", "load_result"]
