"""What a capture keeps of each attention: ``keep=`` parsed and checked in one place.

``probe.capture(..., keep=...)`` and ``probe capture --keep`` take:

* ``None`` or ``"patterns"`` (the default): every pattern whole, ``<attn>.pattern``;
* ``{"rows": [-1, ...]}`` (``rows:-1,-2`` on the command line): the selected query rows of every
  attention, exactly, over every key: ``<attn>.rows`` ``[batch, head, row, key]`` and
  ``<attn>.row_index`` ``[batch, row]``. Row ``i`` is the i-th *real* query of each text (padding
  skipped), negative ones counted from its last real query, as Python indexes a list;
* ``{"topk": k}`` (``topk:32``): the ``k`` largest weights of every query row, their key
  positions and the mass they keep: ``<attn>.topk_values``, ``<attn>.topk_indices`` (int32) and
  ``<attn>.topk_mass``;
* ``"stats"`` (``stats``): the focus statistics of every head only, computed block by block while
  the model runs (``<attn>.stat.<metric>`` ``[batch, head]``, ``<attn>.received``
  ``[batch, head, key]``), and each residual tensor's per-position norm (``<name>.norm``
  ``[batch, pos]``) instead of the tensor. The statistics are the analysis' business: the
  top-level ``probe.capture`` passes their readers in (:mod:`probe.capture.engine.stats`).

Neither ever holds a whole ``[query, key]`` pattern of an SDPA call (rows are recomputed alone,
top-k block by block); a softmax the model computes itself is sliced as it comes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from probe.errors import ProbeError

USAGE = "keep='patterns' (the default), 'stats', {'rows': [-1, ...]} or {'topk': k}"
CLI_USAGE = "patterns, stats, rows:<i,j,...> (e.g. rows:-1,-2) or topk:<k> (e.g. topk:32)"


@dataclass(frozen=True)
class Keep:
    """What to keep of each attention: ``kind`` is ``"patterns"``, ``"stats"``, ``"rows"`` or ``"topk"``;
    ``rows`` the row indices (rows), ``k`` the number of keys per row (topk)."""

    kind: str = "patterns"
    rows: tuple[int, ...] = ()
    k: int = 0

    @property
    def default(self) -> bool:
        return self.kind == "patterns"

    def to_json(self) -> Any:
        """The metadata's ``keep``: ``"patterns"``, ``"stats"``, ``{"rows": [...]}`` or ``{"topk": k}``."""
        if self.kind == "stats":
            return "stats"
        if self.kind == "rows":
            return {"rows": list(self.rows)}
        if self.kind == "topk":
            return {"topk": self.k}
        return "patterns"

    def describe(self) -> str:
        """In words, for messages: ``query rows [-1]``, ``the top 32 keys of every row``."""
        if self.kind == "rows":
            return f"query rows {list(self.rows)} only"
        if self.kind == "topk":
            return f"the top {self.k} keys of every query row only"
        if self.kind == "stats":
            return "statistics only"
        return "whole patterns"


def _rows(values: Any) -> tuple[int, ...]:
    if isinstance(values, int) and not isinstance(values, bool):
        values = [values]
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ProbeError(f"keep['rows'] must be a list of row indices like [-1, -2], not {values!r}")
    out = []
    for v in values:
        if isinstance(v, bool):
            raise ProbeError(f"keep['rows'] must hold integer row indices like [-1, -2]; {v!r} is not one")
        try:
            out.append(operator.index(v))
        except TypeError:
            raise ProbeError(
                f"keep['rows'] must hold integer row indices like [-1, -2]; {v!r} is not one"
            ) from None
    if not out:
        raise ProbeError("keep={'rows': []} keeps no row; give row indices like [-1, -2]")
    if len(set(out)) != len(out):
        raise ProbeError(f"keep['rows']={out} names a row twice; give each index once")
    return tuple(out)


def _k(value: Any) -> int:
    try:
        k = -1 if isinstance(value, bool) else operator.index(value)
    except TypeError:
        k = -1
    if k < 1:
        raise ProbeError(f"keep['topk'] must be a positive number of keys like 32, not {value!r}")
    return k


def parse_keep(keep: Any) -> Keep:
    """``keep=`` as a :class:`Keep`; a one-line :class:`ProbeError` naming the accepted forms."""
    if keep is None or isinstance(keep, Keep):
        return keep or Keep()
    if isinstance(keep, str):
        if keep == "patterns":
            return Keep()
        if keep == "stats":
            return Keep("stats")
        raise ProbeError(f"keep={keep!r} is not supported; use {USAGE}")
    if isinstance(keep, dict) and len(keep) == 1:
        ((what, value),) = keep.items()
        if what == "rows":
            return Keep("rows", rows=_rows(value))
        if what == "topk":
            return Keep("topk", k=_k(value))
    raise ProbeError(f"keep={keep!r} is not supported; use {USAGE}")


def parse_keep_arg(text: str) -> Keep:
    """``--keep`` of the command line: ``patterns``, ``stats``, ``rows:-1,-2`` or ``topk:32``."""
    what, sep, rest = text.strip().partition(":")
    if what == "patterns" and not sep:
        return Keep()
    if what == "stats" and not sep:
        return Keep("stats")
    if what == "rows" and sep:
        try:
            rows = [int(v) for v in rest.split(",")]
        except ValueError:
            raise ProbeError(f"--keep {text}: row indices must be integers; use {CLI_USAGE}") from None
        return parse_keep({"rows": rows})
    if what == "topk" and sep:
        try:
            k = int(rest)
        except ValueError:
            raise ProbeError(f"--keep {text}: k must be a positive integer; use {CLI_USAGE}") from None
        return parse_keep({"topk": k})
    raise ProbeError(f"--keep {text} is not supported; use {CLI_USAGE}")
