""":class:`Comparison`: the per-head differences of two captures, its views and exports."""

from __future__ import annotations

import html
import json
import math
import os
from typing import Any

import torch

from probe.analysis.table import Table
from probe.cache import Cache
from probe.errors import ProbeError

# the pattern differences of a head, and the focus statistics whose B - A is a column (d_<metric>)
PATTERN_METRICS = ("max_abs", "mean_abs", "tv", "js")
DELTA_COLUMNS = ("entropy", "confidence", "first", "prev", "self", "distance", "induction_score")
HEAD_COLUMNS = ["stack", "layer", "head", "kind", "n_texts", *PATTERN_METRICS]
HEAD_COLUMNS += ["role_a", "role_b", "role_changed", *(f"d_{m}" for m in DELTA_COLUMNS)]
STAT_COLUMNS = ["stack", "layer", "head", "kind", "metric", "a", "b", "delta"]


class Comparison:
    """Two captures compared head by head (see :mod:`probe.analysis.compare` for every column).

    ``heads``: a :class:`~probe.analysis.table.Table`, one row per head both caches hold (pattern
    differences, roles, ``d_<metric>`` statistic deltas, B − A); ``stats``: every focus metric of
    every head as ``a``, ``b``, ``delta``; ``skipped``: one line per thing that could not be
    compared; ``labels``: names of A and B; ``same_tokens``: both hold the same tokens.
    """

    def __init__(
        self,
        a: Cache,
        b: Cache,
        rows: list[dict[str, Any]],
        stat_rows: list[dict[str, Any]],
        skipped: list[str],
        labels: tuple[str, str] = ("A", "B"),
    ) -> None:
        self.a, self.b = a, b
        self.labels = labels
        self.heads = Table(rows, HEAD_COLUMNS, title=f"head differences: {labels[0]} vs {labels[1]}")
        self.stats = Table(
            stat_rows, STAT_COLUMNS, title=f"statistic differences: {labels[0]} vs {labels[1]}"
        )
        self.skipped = list(skipped)
        self.same_tokens = a.tokens == b.tokens and a.target_tokens == b.target_tokens

    @property
    def compared_patterns(self) -> bool:
        """Whether any head's patterns were compared (else only statistics were)."""
        return any(r["n_texts"] > 0 for r in self.heads)

    def top(self, k: int = 10, by: str = "tv") -> Table:
        """The ``k`` heads that changed most by ``by`` (a heads column: ``tv``, ``js``,
        ``max_abs``, ``mean_abs``, or ``d_<metric>`` by absolute value)."""
        if by not in self.heads.columns or by in ("stack", "kind", "role_a", "role_b", "role_changed"):
            choices = ", ".join(PATTERN_METRICS + tuple(f"d_{m}" for m in DELTA_COLUMNS))
            raise ProbeError(f"cannot rank heads by {by!r}; choose one of: {choices}")
        if by in PATTERN_METRICS and not self.compared_patterns:
            raise ProbeError(
                f"no patterns were compared ({'; '.join(self.skipped) or 'see skipped'}); "
                "rank by a statistic delta instead, e.g. by='d_entropy'"
            )
        if by.startswith("d_"):
            rows = [dict(r, _abs=abs(r[by]) if r[by] is not None else math.nan) for r in self.heads]
            t = Table(rows, [*self.heads.columns, "_abs"]).top("_abs", k)
            return Table(t.rows, self.heads.columns, f"heads that changed most by |{by}|")
        return Table(self.heads.top(by, k).rows, self.heads.columns, f"heads that changed most by {by}")

    def map(self, metric: str = "tv", stack: str | None = None, kind: str = "self") -> torch.Tensor:
        """``[layers, heads]`` float64 of one heads column (NaN where no head was compared);
        ``stack`` defaults to the last stack with ``kind`` heads (the decoder)."""
        if metric not in PATTERN_METRICS and metric not in [f"d_{m}" for m in DELTA_COLUMNS]:
            raise ProbeError(
                f"no numeric column {metric!r}; choose one of: {', '.join(self.numeric_columns)}"
            )
        rows = [r for r in self.heads if r["kind"] == kind and (stack is None or r["stack"] == stack)]
        if stack is None and rows:
            rows = [r for r in rows if r["stack"] == rows[-1]["stack"]]
        if not rows:
            raise ProbeError(f"no {kind}-attention heads{' in ' + stack if stack else ''} were compared")
        out = torch.full((max(r["layer"] for r in rows) + 1, max(r["head"] for r in rows) + 1), math.nan)
        out = out.double()
        for r in rows:
            out[r["layer"], r["head"]] = r[metric]
        return out

    @property
    def numeric_columns(self) -> list[str]:
        return [*PATTERN_METRICS, *(f"d_{m}" for m in DELTA_COLUMNS)]

    def summary(self) -> str:
        """A few lines: what was compared, the head that changed most, and what was skipped."""
        n = len(self.heads)
        lines = [
            f"{self.labels[0]} vs {self.labels[1]}: {n} heads compared"
            + ("" if self.same_tokens else " (different tokens)")
        ]
        if self.compared_patterns:
            r = self.heads.top("tv", 1)[0]
            lines.append(
                f"most changed: {r['stack']} layer {r['layer']} head {r['head']} ({r['kind']}), "
                f"total variation {r['tv']:.4g}, max |Δ| {r['max_abs']:.4g}"
            )
        changed = sum(1 for r in self.heads if r["role_changed"])
        lines.append(f"roles changed: {changed} of {n} heads")
        lines += [f"not compared: {s}" for s in self.skipped]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Comparison {self.labels[0]!r} vs {self.labels[1]!r}: {len(self.heads)} heads>"

    # -- exports -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """``{"labels", "same_tokens", "skipped", "heads": {columns, rows}, "stats": {columns, rows}}``."""
        return {
            "labels": list(self.labels),
            "same_tokens": self.same_tokens,
            "skipped": list(self.skipped),
            "heads": self.heads.to_dict(),
            "stats": self.stats.to_dict(),
        }

    def to_json(self, path: str | os.PathLike | None = None, **kw: Any) -> str:
        """JSON of :meth:`to_dict` (NaN as null); also written atomically to ``path`` if given."""
        d = self.to_dict()
        d["heads"] = json.loads(self.heads.to_json())
        d["stats"] = json.loads(self.stats.to_json())
        text = json.dumps(d, ensure_ascii=False, **kw)
        if path is not None:
            from probe.files import write_text_atomic

            write_text_atomic(path, text)
        return text

    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """CSV of the heads table (one row per head); also written atomically to ``path`` if given."""
        return self.heads.to_csv(path)

    def to_pandas(self):
        """The heads table as a ``pandas.DataFrame`` (pandas is optional)."""
        return self.heads.to_pandas()

    def _repr_html_(self) -> str:
        """The summary, the ten heads that changed most and what was skipped (escaped, no scripts)."""
        by = "tv" if self.compared_patterns else "d_entropy"
        lines = "".join(f"<li>{html.escape(s)}</li>" for s in self.skipped)
        head = html.escape(self.summary().splitlines()[0])
        skipped = f"<p>Not compared:</p><ul>{lines}</ul>" if lines else ""
        return f"<p><b>{head}</b></p>{self.top(10, by)._repr_html_()}{skipped}"
