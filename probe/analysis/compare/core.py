"""Matching two caches head by head and measuring how their patterns and statistics differ."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from probe.analysis.compare.result import DELTA_COLUMNS, PATTERN_METRICS, Comparison
from probe.cache import Cache, load
from probe.cache.cache import ranges_text
from probe.errors import ProbeError

KINDS = ("self", "cross")

Key = tuple[str, int, int, str]  # (stack, layer, head, kind)


def pattern_difference(p: torch.Tensor, q: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-head differences of two patterns ``p``, ``q`` of shape ``[..., n_query, n_key]`` (real
    tokens only): a dict of :data:`PATTERN_METRICS`, each a float64 tensor of shape ``[...]``
    (see :mod:`probe.analysis.compare` for the definitions)."""
    if p.shape != q.shape:
        raise ProbeError(f"patterns of shapes {tuple(p.shape)} and {tuple(q.shape)} cannot be compared")
    p, q = p.double(), q.double()
    d = (p - q).abs()
    m = (p + q) / 2

    def kl_to_m(x: torch.Tensor) -> torch.Tensor:  # Σ_k x log(x / m), 0 log 0 = 0
        return torch.where(x > 0, x * (x / m).log(), torch.zeros_like(x)).sum(-1)

    return {
        "max_abs": d.amax((-2, -1)),
        "mean_abs": d.mean((-2, -1)),
        "tv": (0.5 * d.sum(-1)).mean(-1),
        "js": (0.5 * kl_to_m(p) + 0.5 * kl_to_m(q)).mean(-1),
    }


def _as_cache(c: Any, which: str) -> Cache:
    if isinstance(c, Cache):
        return c
    if isinstance(c, (str, os.PathLike)):
        return load(c)
    raise ProbeError(
        f"probe.compare takes two probe.Cache objects or cache file paths; {which} is a {type(c).__name__}"
    )


def _label(c: Cache, fallback: str) -> str:
    if c.path is not None:
        return c.path.name
    model = c.metadata.get("model")
    name = model.get("name") if isinstance(model, dict) else None
    return str(name) if name else fallback


def _only(what: str, xs: list, side: str) -> str:
    shown = ranges_text(xs) if all(isinstance(x, int) for x in xs) else ", ".join(map(str, xs))
    return f"{what} {shown} only in {side}"


def matched_layers(a: Cache, b: Cache, skipped: list[str]) -> list[tuple[str, str, int, list[int]]]:
    """``(stack, kind, layer, heads)`` present in both caches (heads: the model head indices both
    captured, in A's order); what only one cache has is appended to ``skipped``."""
    out = []
    for stack in a.stacks + [s for s in b.stacks if s not in a.stacks]:
        for kind in KINDS:
            la = a.pattern_layers(stack, kind) if stack in a.stacks else []
            lb = b.pattern_layers(stack, kind) if stack in b.stacks else []
            if not la and not lb:
                continue
            where = f"{stack} {kind}-attention"
            if not la or not lb:
                skipped.append(f"{where} only in {'A' if la else 'B'}")
                continue
            if set(la) - set(lb):
                skipped.append(_only(f"{where} layers", sorted(set(la) - set(lb)), "A"))
            if set(lb) - set(la):
                skipped.append(_only(f"{where} layers", sorted(set(lb) - set(la)), "B"))
            for layer in sorted(set(la) & set(lb)):
                ha, hb = a.head_ids(stack, layer, kind), b.head_ids(stack, layer, kind)
                heads = [h for h in ha if h in hb]
                for side, extra in (
                    ("A", [h for h in ha if h not in hb]),
                    ("B", [h for h in hb if h not in ha]),
                ):
                    if extra:
                        skipped.append(_only(f"{where} layer {layer} heads", extra, side))
                if heads:
                    out.append((stack, kind, layer, heads))
    return out


def _text_pairs(a: Cache, b: Cache, stack: str, kind: str, skipped: list[str]) -> list[tuple[int, Any, Any]]:
    """``(text, (qa, ka), (qb, kb))`` for the texts whose real lengths agree in both caches."""
    if a.n_texts != b.n_texts:
        return []
    pairs = []
    for t in range(a.n_texts):
        qa, ka = a.axes(stack, kind, t)
        qb, kb = b.axes(stack, kind, t)
        if (len(qa.positions), len(ka.positions)) != (len(qb.positions), len(kb.positions)):
            skipped.append(
                f"{stack} {kind}-attention, text {t}: A has {len(qa.positions)}×{len(ka.positions)} real "
                f"query×key tokens, B {len(qb.positions)}×{len(kb.positions)}; its patterns are not compared"
            )
            continue
        pairs.append((t, (qa.positions, ka.positions), (qb.positions, kb.positions)))
    return pairs


def _layer_differences(a, b, stack, kind, layer, heads, pairs) -> dict[str, torch.Tensor]:
    """:data:`PATTERN_METRICS` of ``heads`` of one layer, ``[n_heads]`` each, aggregated over the
    text ``pairs`` (max for ``max_abs``, mean for the others); NaN when there is no pair."""
    ia = [a.head_ids(stack, layer, kind).index(h) for h in heads]
    ib = [b.head_ids(stack, layer, kind).index(h) for h in heads]
    per_text = []
    for t, (qa, ka), (qb, kb) in pairs:
        pa = a.pattern(stack, layer, kind, batch=t)[ia][:, qa][:, :, ka]
        pb = b.pattern(stack, layer, kind, batch=t)[ib][:, qb][:, :, kb]
        per_text.append(pattern_difference(pa, pb))
    nan = torch.full((len(heads),), math.nan, dtype=torch.float64)
    if not per_text:
        return {m: nan for m in PATTERN_METRICS}
    out = {m: torch.stack([d[m] for d in per_text]).mean(0) for m in PATTERN_METRICS}
    out["max_abs"] = torch.stack([d["max_abs"] for d in per_text]).amax(0)
    return out


def _stat_rows(c: Cache) -> tuple[dict[Key, dict[str, Any]], list[str]]:
    from probe.analysis.focus import METRICS, head_stats

    s = head_stats(c, rollout=False, progress=False)
    return {(r["stack"], r["layer"], r["head"], r["kind"]): r for r in s.table}, list(METRICS)


def compare(a: Any, b: Any) -> Comparison:
    """Compare two captures head by head: ``a`` and ``b`` are :class:`probe.Cache` objects or
    cache file paths. Returns a :class:`~probe.analysis.compare.Comparison` (one row per head
    both hold, see :mod:`probe.analysis.compare`); raises :class:`ProbeError` when no head can
    be compared (different stacks, no patterns)."""
    ca, cb = _as_cache(a, "A"), _as_cache(b, "B")
    skipped: list[str] = []
    layers = matched_layers(ca, cb, skipped)
    if not layers:
        detail = "; ".join(skipped) or "neither holds attention patterns"
        raise ProbeError(
            f"nothing to compare: the two caches have no attention head in common ({detail}); "
            "compare captures that share a stack, layer and head"
        )
    if ca.n_texts != cb.n_texts:
        skipped.append(
            f"A holds {ca.n_texts} text(s), B {cb.n_texts}: patterns are compared text by text only "
            "when both hold the same number; statistics (means over texts) are still compared"
        )
    stats_a, metrics = _stat_rows(ca)
    stats_b, _ = _stat_rows(cb)
    rows, stat_rows, pairs_of = [], [], {}
    for stack, kind, layer, heads in layers:
        if (stack, kind) not in pairs_of:
            pairs_of[(stack, kind)] = _text_pairs(ca, cb, stack, kind, skipped)
        pairs = pairs_of[(stack, kind)]
        diffs = _layer_differences(ca, cb, stack, kind, layer, heads, pairs)
        for i, h in enumerate(heads):
            ra, rb = stats_a[(stack, layer, h, kind)], stats_b[(stack, layer, h, kind)]
            row: dict[str, Any] = {"stack": stack, "layer": layer, "head": h, "kind": kind}
            row["n_texts"] = len(pairs)
            row.update({m: float(diffs[m][i]) for m in PATTERN_METRICS})
            row.update({"role_a": ra["role"], "role_b": rb["role"], "role_changed": ra["role"] != rb["role"]})
            row.update({f"d_{m}": rb[m] - ra[m] for m in DELTA_COLUMNS})
            rows.append(row)
            for m in metrics:
                stat_rows.append(
                    {
                        "stack": stack,
                        "layer": layer,
                        "head": h,
                        "kind": kind,
                        "metric": m,
                        "a": ra[m],
                        "b": rb[m],
                        "delta": rb[m] - ra[m],
                    }
                )
    la, lb = _label(ca, "A"), _label(cb, "B")
    if la == lb:
        la, lb = f"A ({la})", f"B ({lb})"
    return Comparison(ca, cb, rows, stat_rows, skipped, labels=(la, lb))
