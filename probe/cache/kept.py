"""Caches that kept less than whole patterns: selected query rows or the top-k keys of each row.

A mixin of :class:`probe.Cache`. ``probe.capture(..., keep={"rows": [...]})`` stores
``<attn>.rows`` ``[batch, head, row, key]`` and ``<attn>.row_index`` ``[batch, row]``;
``keep={"topk": k}`` stores ``<attn>.topk_values``/``topk_indices`` ``[batch, head, query, k]`` and
``<attn>.topk_mass`` ``[batch, head, query]`` (see :mod:`probe.cache.format`). The metadata's
``keep`` says which; :attr:`KeptFields.kept` reads it (inferring it from the keys of a cache
written without it). Asking such a cache for a whole pattern is a one-line error naming what
was kept and how to get whole patterns.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from probe.cache.format import attention_name, key, parse_key
from probe.cache.queries import CacheKeyError
from probe.errors import ProbeError


class TopK(NamedTuple):
    """The top-k fields of one attention: ``values`` and ``indices`` (int32 key positions)
    ``[batch, head, query, k]`` (sorted from the largest weight), ``mass`` ``[batch, head, query]``
    (the share of each row the k keys keep)."""

    values: torch.Tensor
    indices: torch.Tensor
    mass: torch.Tensor


def describe(kept: Any) -> str:
    """What a cache kept, in words: ``whole patterns``, ``query rows [-1] of every text``, ..."""
    if isinstance(kept, dict) and "rows" in kept:
        return f"query rows {kept['rows']} of every text over every key"
    if isinstance(kept, dict) and "topk" in kept:
        return f"the top {kept['topk']} keys of every query row"
    if kept == "stats":
        return "each head's statistics and the residual norms only"
    return "whole patterns"


class KeptFields:
    """What a cache kept of each attention, and the rows/top-k fields; :class:`probe.Cache`
    provides ``keys``, ``shape``, ``__getitem__``, ``stacks`` and ``metadata``."""

    _keys: list[str]
    _metadata: dict[str, Any]

    @property
    def kept(self) -> str | dict[str, Any]:
        """What the cache kept of each attention: ``"patterns"``, ``"stats"``, ``{"rows": [...]}``
        or ``{"topk": k}`` (the metadata's ``keep``)."""
        kept = self._metadata.get("keep")
        if kept is not None:
            return kept
        fields = {parse_key(k)[2].rsplit(".", 1)[-1] for k in self._keys if _is_probe_key(k)}
        if "pattern" not in fields and "rows" in fields:
            return {"rows": "?"}
        if "pattern" not in fields and "topk_values" in fields:
            return {"topk": "?"}
        if "pattern" not in fields and any(f.startswith("stat.") for f in fields):
            return "stats"
        return "patterns"

    @property
    def partial(self) -> bool:
        """Whether the cache kept less than whole patterns (statistics, rows or top-k)."""
        return self.kept != "patterns"

    def not_kept(self, what: str = "whole attention patterns") -> ProbeError:
        """The error for asking a rows/top-k cache for ``what`` it does not hold (one line)."""
        kept = self.kept
        if kept == "stats":
            return CacheKeyError(
                f"this cache kept {describe(kept)} (keep='stats'), not {what}; read its statistics with "
                "probe.head_stats(cache), or capture again without keep= (probe capture --keep patterns) "
                "for whole patterns"
            )
        reader = "cache.rows(stack, layer)" if "rows" in kept else "cache.topk(stack, layer)"
        return CacheKeyError(
            f"this cache kept {describe(kept)} (keep={kept}), not {what}; read what it holds with "
            f"{reader}, or capture again without keep= (probe capture --keep patterns) for whole patterns"
        )

    def rows(
        self,
        stack: str = "decoder",
        layer: int = 0,
        kind: str = "self",
        *,
        head: int | None = None,
        batch: int | None = None,
        index: int | None = None,
    ) -> torch.Tensor:
        """The kept query rows of an attention: ``[batch, head, row, key]`` (``batch``/``head``
        given as integers drop their axis). Row ``r`` of text ``b`` is query
        ``row_index(...)[b, r]``; each row is exact over every key."""
        t = self[self._field_key(stack, layer, kind, "rows", index)]
        return _pick(t, batch, head)

    def row_index(
        self, stack: str = "decoder", layer: int = 0, kind: str = "self", *, index=None
    ) -> torch.Tensor:
        """int64 ``[batch, row]``: the query position of every kept row, per text."""
        return self[self._field_key(stack, layer, kind, "row_index", index)]

    def topk(
        self,
        stack: str = "decoder",
        layer: int = 0,
        kind: str = "self",
        *,
        head: int | None = None,
        batch: int | None = None,
        index: int | None = None,
    ) -> TopK:
        """The top-k fields of an attention as :class:`TopK` (``values``, ``indices``, ``mass``)."""
        get = [
            self[self._field_key(stack, layer, kind, f, index)]
            for f in ("topk_values", "topk_indices", "topk_mass")
        ]
        return TopK(*(_pick(t, batch, head) for t in get))

    def _field_key(self, stack: str, layer: int, kind: str, field: str, index: int | None) -> str:
        if kind not in ("self", "cross"):
            raise ProbeError(f"kind must be 'self' or 'cross', not {kind!r}")
        k = key(stack, layer, attention_name(kind, field, index)) if isinstance(stack, str) else None
        if k is not None and k in self._keys:
            return k
        if field not in {parse_key(x)[2].rsplit(".", 1)[-1] for x in self._keys if _is_probe_key(x)}:
            what = "query rows" if field in ("rows", "row_index") else "top-k weights"
            raise CacheKeyError(
                f"this cache holds no {what}: it kept {describe(self.kept)}; capture with "
                f"keep={{'rows': [-1]}} or keep={{'topk': 32}} (probe capture --keep rows:-1 / topk:32)"
            )
        have = sorted(
            {
                parse_key(x)[1]
                for x in self._keys
                if _is_probe_key(x)
                and parse_key(x)[0] == stack
                and parse_key(x)[2] == attention_name(kind, field, index)
            }
        )
        raise CacheKeyError(
            f"{k or stack!r} is not in this cache; its {stack} has {kind} {field} for layers {have}"
        )


def _is_probe_key(k: str) -> bool:
    try:
        parse_key(k)
    except ValueError:
        return False
    return True


def _pick(t: torch.Tensor, batch: int | None, head: int | None) -> torch.Tensor:
    for axis, value, what in ((1, head, "head"), (0, batch, "batch")):
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not -t.shape[axis] <= value < t.shape[axis]
        ):
            raise ProbeError(
                f"{what}={value!r} is out of range: the cache holds {t.shape[axis]}; "
                f"choose 0-{t.shape[axis] - 1}"
            )
        t = t.select(axis, value)
    return t
