"""``keep="stats"`` caches: the focus statistics computed while the model ran, stored and read back.

``probe.capture(model, inputs, keep="stats")`` (:func:`probe.entry.capture`) runs one forward through
:func:`probe.forward.capture_stats`: every attention's weights pass row block by row block
through the readers of :func:`~probe.analysis.focus.streamed.run.stats_readers` and are dropped;
:func:`stats_fields` then stores, per attention of every layer,

* ``<attn>.stat.<metric>`` ``[batch, head]`` (float32): each text's value of every metric of
  :data:`~probe.analysis.focus.definitions.table.METRICS`, the values ``head_stats`` averages over
  texts;
* ``<attn>.received`` ``[batch, head, key]`` (float64): the sink profile, the mean weight each key
  position receives over the counted queries of each text (``HeadStats.received``);

* ``<attn>.stat.contrib_<metric>`` ``[batch, head]``, where the capture read a derived
  ``contribution`` kind beside the weights (``probe.contributions(model, inputs, keep="stats")``):
  the same metrics over each row of contributions renormalised to sum 1;

and in the metadata ``keep: "stats"`` and ``stats``: ``{"metrics": [...], "causal": {"stack/layer/kind":
bool}, "not_computed": {"rollout": reason}}``. The capture adds each residual tensor's norm.

:func:`add_stats` folds such a cache into a
:class:`~probe.analysis.focus.accumulator.FocusAccumulator`, so ``probe.head_stats(cache)`` is the
same :class:`HeadStats` as ``probe.head_stats(model, inputs)`` (and, less the rollout, as
``head_stats`` of a full capture); such caches merge with each other and with full ones.
"""

from __future__ import annotations

from typing import Any

import torch

from probe.analysis.focus.definitions.table import METRICS
from probe.analysis.focus.streamed.notes import streamed_not_computed
from probe.cache.format import parse_key, parse_name
from probe.errors import ProbeError

CONTRIB = "contrib_"  # statistics by contribution: <attn>.stat.contrib_<metric>
ROLLOUT_NOTE = (
    "attention rollout multiplies every layer's whole T x T pattern; a keep='stats' capture never holds "
    "one: capture without keep= (whole patterns) and pass that cache to compute it"
)


def _ordered(meta: dict[str, Any], keys) -> list[tuple[str, int, str, str]]:
    """``(stack, layer, kind, base)`` of each attention key, in stack, layer, self-then-cross
    order (``base`` is the key without its field: ``decoder.blocks.0.self_attn``)."""
    order = {s: i for i, s in enumerate(meta.get("stacks", {}))}
    out = []
    for k in keys:
        stack, layer, name = parse_key(k)
        n = parse_name(name)
        base = k[: -len(n.field) - 1]
        out.append((order.get(stack, 99), layer, 0 if n.role == "self" else 1, (stack, layer, n.role, base)))
    return [x[-1] for x in sorted(out)]


def stats_fields(meta: dict[str, Any], readers: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, metadata)`` of a ``keep="stats"`` cache from one forward's readers (each under
    its pattern's cache key, a contribution kind's under ``<attn>.contribution``): see the module
    docstring for what each holds."""
    tensors: dict[str, torch.Tensor] = {}
    causal: dict[str, bool] = {}
    for stack, layer, kind, base in _ordered(meta, [k for k in readers if k.endswith(".pattern")]):
        terms = readers[f"{base}.pattern"].of(stack)
        values = terms.values()  # [B, H, M]
        for i, m in enumerate(METRICS):
            tensors[f"{base}.stat.{m}"] = values[..., i].contiguous()
        by = readers.get(f"{base}.contribution")
        if by is not None:
            cv = by.of(stack).values()
            for i, m in enumerate(METRICS):
                tensors[f"{base}.stat.{CONTRIB}{m}"] = cv[..., i].contiguous()
        tensors[f"{base}.received"] = terms.received()
        causal[f"{stack}/{layer}/{kind}"] = bool(terms.causal)
    extra = {
        "stats": {
            "metrics": list(METRICS),
            "causal": causal,
            "not_computed": streamed_not_computed(meta, ROLLOUT_NOTE),
        }
    }
    return tensors, extra


def holds_contributions(cache: Any) -> bool:
    """Whether a ``keep="stats"`` cache holds statistics by contribution."""
    return any(k.endswith(f".stat.{CONTRIB}{METRICS[0]}") for k in cache.keys())


def add_stats(acc: Any, cache: Any, *, prefix: str = "") -> None:
    """Fold a ``keep="stats"`` cache into the accumulator ``acc`` (a :class:`FocusAccumulator`);
    ``prefix`` :data:`CONTRIB`: its statistics by contribution instead of by weight."""
    meta = cache.metadata
    info = meta.get("stats") or {}
    if list(info.get("metrics", [])) != list(METRICS):
        raise ProbeError(
            "this statistics cache was written by another probe version (its metrics differ); "
            "capture it again with keep='stats'"
        )
    first = f"stat.{prefix}{METRICS[0]}"
    keys = [k for k in cache.keys() if k.endswith(f".{first}")]
    if not keys:
        raise ProbeError("this keep='stats' cache holds no statistics; capture it again with keep='stats'")
    captured = meta.get("heads_captured")
    received = {}
    batch = 0
    for stack, layer, kind, base in _ordered(meta, keys):
        values = torch.stack([cache[f"{base}.stat.{prefix}{m}"] for m in METRICS], -1)
        B, H, _ = values.shape
        batch = B
        name = f"{stack}/{layer}/{kind}"
        heads = [int(captured[h]) if captured else h for h in range(H)]
        acc.fold(name, values, heads, bool(info["causal"][name]))
        if not prefix and f"{base}.received" in cache:
            received[name] = cache[f"{base}.received"]
    acc.add_texts(batch, received=received)  # (kept for the first texts only: positions are per batch)
    acc.leave_out(info.get("not_computed") or {})


__all__ = ["add_stats", "stats_fields", "holds_contributions", "CONTRIB"]
