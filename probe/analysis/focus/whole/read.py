"""A cache's whole patterns folded into a :class:`~probe.analysis.focus.accumulator.FocusAccumulator`,
layer by layer, a block of heads at a time (:func:`add_patterns`), with each stack's rollout."""

from __future__ import annotations

import math
from typing import Any

import torch
from tqdm.auto import tqdm

from probe.analysis.focus.definitions.layout import Layout
from probe.analysis.focus.definitions.tokens import side
from probe.analysis.focus.whole.pattern import block_metrics, received
from probe.analysis.focus.whole.rollout import Rollout
from probe.analysis.focus.whole.rows import is_causal
from probe.cache.format import PATTERN_BY
from probe.errors import ProbeError

# A layer is causal when no head of it puts any weight above the diagonal (between real tokens).
# Self-attention heads are read in blocks of about a quarter of a layer, so the sort behind the
# effective span (values + int64 indices) keeps peak memory near one layer of patterns.
HEAD_BLOCKS = 4


def _numbered(cache: Any) -> list[str]:
    """The attentions numbered within their layer (several of one kind: ``self_attn.0``, ...)."""
    out = []
    for s in cache.stacks:
        for i in cache.layer_indices(s):
            out += [f"{s}.blocks.{i}.{k}_attn.{n}" for k, n in cache.attentions(s, i) if n is not None]
    return out


def _attentions(acc: Any, cache: Any, field: str = "pattern") -> list[tuple[str, int, str]]:
    """``(stack, layer, kind)`` of every attention pattern the cache holds (one of a kind per
    layer); where its layers hold several, those are left out and ``acc`` is told why."""
    layers = [
        (s, i, kind)
        for s in cache.stacks
        for i in cache.layer_indices(s)  # the layers it holds: some, with capture(layers=)
        for kind in ("self", "cross")
        if f"{s}.blocks.{i}.{kind}_attn.{field}" in cache
    ]
    several = _numbered(cache)
    if not layers and several:
        raise ProbeError(
            f"head_stats reads one attention of a kind per layer, and this cache's layers hold several "
            f"({', '.join(several[:2])}{', ...' if len(several) > 2 else ''}: Swin's blocks in a stage, "
            "two attention sublayers); read them with cache.pattern(stack, layer, index=i)"
        )
    if not layers:
        raise ProbeError("the cache holds no attention patterns; capture without dropping them")
    if several:
        acc.leave_out(
            {
                "several attentions per layer": (
                    f"not read: {', '.join(several)} (head_stats reads one attention of a kind per layer; "
                    "read them with cache.pattern(stack, layer, index=i))"
                )
            }
        )
    return layers


def holds_contributions(cache: Any) -> bool:
    """Whether ``cache`` holds whole patterns by contribution (``probe.contributions``)."""
    return any(k.endswith(f"_attn.{PATTERN_BY['contribution']}") for k in cache.keys())


def add_patterns(
    acc: Any, cache: Any, *, rollout: bool = False, progress: bool = False, by: str = "weight"
) -> None:
    """Fold every text of ``cache`` (whole patterns) into ``acc`` (a
    :class:`~probe.analysis.focus.accumulator.FocusAccumulator`); with ``rollout`` keep its
    attention rollout too (a cache captured with every head). ``by="contribution"``: the
    patterns by contribution, each row renormalised to sum 1, instead of the weights."""
    meta = cache.metadata
    captured = meta.get("heads_captured")
    layers = _attentions(acc, cache, PATTERN_BY[by])
    roll = Rollout()
    layouts: dict[tuple, Layout] = {}
    sides: dict[tuple, object] = {}
    all_heads = rollout and captured is None
    batch = None
    got: dict[str, torch.Tensor] = {}
    for stack, layer, kind in tqdm(
        layers, desc="head stats", unit="layer", disable=not progress, leave=False
    ):
        k = f"{stack}.blocks.{layer}.{kind}_attn.{PATTERN_BY[by]}"
        B, H, Q, K = cache.shape(k)
        batch = B
        qs = sides.get((stack, "own", B, Q)) or side(meta, stack, "own", B, Q)
        ks_role = "own" if kind == "self" else "source"
        ks = sides.get((stack, ks_role, B, K)) or side(meta, stack, ks_role, B, K)
        sides[(stack, "own", B, Q)], sides[(stack, ks_role, B, K)] = qs, ks
        want_sum = all_heads and kind == "self" and Q == K
        values, causal, head_sum, recv = _layer_values(
            cache, (stack, layer, kind), qs, ks, layouts, want_sum, by
        )
        name = f"{stack}/{layer}/{kind}"
        got[name] = recv
        acc.fold(name, values, [int(captured[h]) if captured else h for h in range(H)], causal)
        if head_sum is not None:
            roll.add(stack, head_sum, H, qs.real, causal)
    # per batch positions: kept for the first cache only (merged runs have none)
    acc.add_texts(batch or 0, received=got)
    if rollout:
        acc.keep_rollout(roll.R)


def _read(cache: Any, where: tuple, heads: slice, by: str) -> torch.Tensor:
    """A block of heads of one pattern on the CPU; by contribution, each row renormalised to sum 1."""
    P = cache.pattern(*where, head=heads, by=by).cpu()
    if by == "weight":
        return P
    P = P.float()
    total = P.sum(-1, keepdim=True)
    return torch.where(total > 0, P / total.clamp_min(torch.finfo(P.dtype).tiny), P)


def _layer_values(cache, where, qs, ks, layouts, want_sum, by="weight"):
    """``([B, H, M] per-text metrics, causal, Σ_h pattern or None, [B, H, K] sink profile)`` of one
    layer ``where`` = ``(stack, layer, kind)``, read a block of heads at a time. A layer is causal
    only if no block has weight above the diagonal; if a later block shows some, the earlier blocks
    are computed again as non-causal."""
    stack, layer, kind = where
    B, H, Q, K = cache.shape(f"{stack}.blocks.{layer}.{kind}_attn.{PATTERN_BY[by]}")
    step = max(1, math.ceil(H / HEAD_BLOCKS))
    blocks = [(h0, min(H, h0 + step)) for h0 in range(0, H, step)]

    def layout(c: bool) -> Layout:
        key = (stack, kind, B, Q, K, c)
        if key not in layouts:
            layouts[key] = Layout(qs, ks, Q, K, causal=c)
        return layouts[key]

    values, causal, head_sum, recv = [], None, None, []
    for n, (h0, h1) in enumerate(blocks):
        # a cache kept on a GPU is reduced on the CPU, a block of heads at a time (the layouts live there)
        P = _read(cache, where, slice(h0, h1), by)
        c = kind == "self" and is_causal(P, qs, ks)
        if causal and not c:
            values, recv = [], []
            for a, b in blocks[:n]:
                Pa = _read(cache, where, slice(a, b), by)
                values.append(block_metrics(Pa, layout(False), self_attn=True))
                recv.append(_received(Pa, layout(False)))
        causal = c if causal is None else causal and c
        values.append(block_metrics(P, layout(causal), self_attn=kind == "self"))
        recv.append(_received(P, layout(causal)))
        if want_sum:
            s = P.float().sum(1)
            head_sum = s if head_sum is None else head_sum + s
        del P
    return torch.cat(values, 1), bool(causal), head_sum, torch.cat(recv, 1)


def _received(P: torch.Tensor, lay: Layout) -> torch.Tensor:
    """The sink profile ``[B, h, K]`` of a block of heads (padding keys get no weight)."""
    P = P.float()
    if lay.any_pad:
        P = torch.where(lay.k.real[:, None, None, :], P, 0)
    return received(P, lay.counted)


__all__ = ["add_patterns", "holds_contributions", "HEAD_BLOCKS"]
