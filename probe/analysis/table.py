"""Rows of results with the exports every analysis offers: dict, JSON, CSV, pandas and HTML.

An analysis result holds (or is) a :class:`Table`: a list of flat rows with a fixed column order.
Exports never lose a row; values are plain Python numbers and strings, so JSON and CSV round-trip.
"""

from __future__ import annotations

import csv
import html
import io
import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

from probe.errors import ProbeError


def _plain(v: Any) -> Any:
    """A JSON-friendly scalar: tensors and numpy scalars become Python numbers, NaN stays NaN."""
    if hasattr(v, "item") and callable(v.item) and getattr(v, "ndim", 0) == 0:
        v = v.item()
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return str(v)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4g}"
    return "" if v is None else str(v)


class Table:
    """A list of result rows (dicts with the same columns), exportable and sortable.

    ``columns`` fixes the column order; ``rows`` are dicts with those keys.
    """

    def __init__(self, rows: Iterable[dict[str, Any]], columns: Sequence[str] | None = None, title: str = ""):
        self.rows: list[dict[str, Any]] = [{k: _plain(v) for k, v in r.items()} for r in rows]
        if columns is None:
            columns = list(self.rows[0]) if self.rows else []
        self.columns = list(columns)
        self.title = title

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]

    def column(self, name: str) -> list[Any]:
        """All values of one column, in row order."""
        self._check_column(name)
        return [r.get(name) for r in self.rows]

    def _check_column(self, name: str) -> None:
        if name not in self.columns:
            raise ProbeError(f"no column {name!r}; choose one of: {', '.join(self.columns)}")

    def sorted(self, by: str, descending: bool = True) -> Table:
        """A copy sorted by column ``by`` (NaN and None last)."""
        self._check_column(by)

        def k(r: dict[str, Any]) -> tuple:
            v = r.get(by)
            missing = v is None or (isinstance(v, float) and math.isnan(v))
            if missing:
                return (1, 0)
            return (0, -v if descending and isinstance(v, (int, float)) else v)

        rows = sorted(self.rows, key=k)
        if descending and rows and not isinstance(rows[0].get(by), (int, float)):
            rows = list(reversed(rows))
        return Table(rows, self.columns, self.title)

    def top(self, by: str, k: int = 10, descending: bool = True) -> Table:
        """The ``k`` rows with the largest (or smallest) ``by``."""
        if k < 1:
            raise ProbeError(f"k must be at least 1, got {k}")
        t = self.sorted(by, descending)
        return Table(t.rows[:k], self.columns, self.title)

    # -- exports -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """``{"columns": [...], "rows": [{...}, ...]}``: plain Python, JSON-ready."""
        return {"columns": list(self.columns), "rows": [dict(r) for r in self.rows]}

    def to_json(self, path: str | os.PathLike | None = None, **kw: Any) -> str:
        """JSON text of :meth:`to_dict` (NaN written as ``null``); also written to ``path`` if given."""
        data = self.to_dict()
        for r in data["rows"]:
            for c, v in r.items():
                if isinstance(v, float) and not math.isfinite(v):
                    r[c] = None
        text = json.dumps(data, ensure_ascii=False, **kw)
        if path is not None:
            from probe.files import write_text_atomic

            write_text_atomic(path, text)
        return text

    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """CSV text with a header row; also written to ``path`` if given."""
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=self.columns, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for r in self.rows:
            w.writerow({c: _csv_value(r.get(c)) for c in self.columns})
        text = buf.getvalue()
        if path is not None:
            from probe.files import write_text_atomic

            write_text_atomic(path, text)
        return text

    def to_pandas(self):
        """A ``pandas.DataFrame`` (pandas is optional: ``pip install pandas``)."""
        try:
            import pandas as pd
        except ImportError:
            raise ProbeError("to_pandas() needs pandas; install it with `pip install pandas`") from None
        return pd.DataFrame(self.rows, columns=self.columns)

    def select(self, columns: Sequence[str]) -> Table:
        """The same rows with only ``columns``, in that order (each must be a column)."""
        for c in columns:
            self._check_column(c)
        return Table(self.rows, list(columns), self.title)

    def to_text(self, max_rows: int = 40, width: int | None = None, keys: Sequence[str] = ()) -> str:
        """A fixed-width text table (the CLI prints this).

        With ``width``, a table wider than ``width`` characters is printed as blocks of columns
        that fit, one under the other, each block repeating the ``keys`` columns (e.g. layer and
        head) so every row can be read on its own.
        """
        rows = self.rows[:max_rows]
        cells = [self.columns] + [[_fmt(r.get(c)) for c in self.columns] for r in rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.columns))]
        blocks = [list(range(len(self.columns)))]
        if width is not None and sum(widths) + 2 * (len(widths) - 1) > width:
            blocks = _column_blocks(self.columns, widths, keys, width)
        parts = []
        for cols in blocks:
            lines = ["  ".join(row[i].ljust(widths[i]) for i in cols).rstrip() for row in cells]
            lines.insert(1, "  ".join("-" * widths[i] for i in cols))
            parts.append("\n".join(lines))
        text = "\n\n".join(parts)
        if len(self.rows) > max_rows:
            text += f"\n... {len(self.rows) - max_rows} more rows"
        return text

    def __str__(self) -> str:
        return (self.title + "\n" if self.title else "") + self.to_text()

    def __repr__(self) -> str:
        return f"<Table {self.title or ''} {len(self.rows)} rows × {len(self.columns)} columns>"

    def _repr_html_(self, max_rows: int = 200) -> str:
        """An HTML table (escaped; no scripts, no network) for Jupyter, JupyterLab and VS Code."""
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in self.columns) + "</tr>"
            for r in self.rows[:max_rows]
        )
        more = f"<p>… {len(self.rows) - max_rows} more rows</p>" if len(self.rows) > max_rows else ""
        title = f"<p><b>{html.escape(self.title)}</b></p>" if self.title else ""
        return f"{title}<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{more}"


def _column_blocks(
    columns: Sequence[str], widths: list[int], keys: Sequence[str], width: int
) -> list[list[int]]:
    """Column indices in blocks of at most ``width`` characters, each led by the ``keys`` columns
    (a column wider than a block on its own gets a block of its own)."""
    lead = [i for i, c in enumerate(columns) if c in keys]
    used = sum(widths[i] + 2 for i in lead)
    blocks: list[list[int]] = []
    cur, size = list(lead), used
    for i, w in enumerate(widths):
        if i in lead:
            continue
        if len(cur) > len(lead) and size + w > width:
            blocks.append(cur)
            cur, size = list(lead), used
        cur.append(i)
        size += w + 2
    blocks.append(cur)
    return blocks


def _csv_value(v: Any) -> Any:
    if isinstance(v, list):
        return json.dumps(v, ensure_ascii=False)
    return v


__all__ = ["Table"]


def _finite(x: Any) -> Any:
    """``x`` with every NaN or infinite float (in nested dicts and lists) as None, for JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


class Exports:
    """The exports of a result that has :meth:`to_dict` and a main :class:`Table` (the attribute
    named by ``_exported``, ``table`` by default): JSON, CSV and pandas, files written atomically."""

    _exported = "table"

    def _export_dict(self) -> dict[str, Any]:
        """What :meth:`to_json` writes: :meth:`to_dict` (a result adds its tables' rows here)."""
        return self.to_dict()  # type: ignore[attr-defined]

    def to_json(self, path: str | os.PathLike | None = None, **kw: Any) -> str:
        """JSON of the result (NaN and infinities as null); also written atomically to ``path``."""
        text = json.dumps(_finite(self._export_dict()), ensure_ascii=False, **kw)
        if path is not None:
            from probe.files import write_text_atomic

            write_text_atomic(path, text)
        return text

    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """CSV of the result's table (one line per row); also written atomically to ``path``."""
        return getattr(self, self._exported).to_csv(path)

    def to_pandas(self):
        """The result's table as a ``pandas.DataFrame`` (pandas is optional)."""
        return getattr(self, self._exported).to_pandas()
