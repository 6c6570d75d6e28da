"""What a corpus run stores of each capture: ``keep="stats"`` (nothing), ``"all"``, ``"residuals"``,
or the layers and heads of ``{"layers": [...], "heads": [...]}``, validated by the one
:class:`~probe.cache.selection.Selection` that capture uses too."""

from __future__ import annotations

from typing import Any

from probe.cache import Cache
from probe.cache.selection import Selection
from probe.capture.hooks.store import parse_dtype
from probe.errors import ProbeError

KEEPS = ("stats", "all", "residuals")


def keep_spec(keep: Any) -> Any:
    """``keep`` checked: one of :data:`KEEPS`, or ``{"layers": [...], "heads": [...]}`` with its
    indices parsed by :meth:`Selection.from_keep <probe.cache.selection.Selection.from_keep>`."""
    if isinstance(keep, str):
        if keep not in KEEPS:
            raise ProbeError(f"keep={keep!r}: use one of {KEEPS} or {{'layers': [...], 'heads': [...]}}")
        return keep
    if isinstance(keep, dict) and set(keep) <= {"layers", "heads"} and keep:
        sel = Selection.from_keep(keep)
        return {"layers": sel.layers, "heads": sel.heads}
    raise ProbeError(f"keep={keep!r}: use one of {KEEPS} or {{'layers': [...], 'heads': [...]}}")


def kept(cache: Cache, keep: Any, dtype: Any = None) -> Cache | None:
    """The part of ``cache`` that ``keep`` stores (None: nothing), its floats cast to ``dtype``."""
    part = _select(cache, keep)
    if part is None or dtype is None:
        return part
    dt = parse_dtype(dtype)
    tensors = {k: part[k].to(dt) if part[k].is_floating_point() else part[k] for k in part.keys()}
    meta = dict(part.metadata)
    meta["dtype"] = ", ".join(sorted({str(t.dtype).replace("torch.", "") for t in tensors.values()}))
    return Cache(tensors, meta)


def _select(cache: Cache, keep: Any) -> Cache | None:
    """What ``keep`` stores of ``cache``, uncast (None for ``"stats"``)."""
    if keep == "stats":
        return None
    if keep == "all":
        return cache
    if keep == "residuals":
        residuals = {k: cache[k] for k in cache.keys() if not k.endswith("_attn.pattern")}
        return Cache(residuals, dict(cache.metadata))
    return Selection.from_keep(keep).patterns(cache)


__all__ = ["KEEPS", "keep_spec", "kept"]
