"""Focus statistics of a cache that kept selected query rows (``keep={"rows": [...]}``).

Every metric defined per query row (:data:`ROW_METRICS`) is computed exactly as for whole
patterns, with the same conventions (padding keys dropped, visible keys, counted queries), but
averaged over the *kept* rows of each text instead of every counted query. The metrics that need
every row of a pattern (:data:`NOT_COMPUTED`, with the reason) are NaN; rollout is not computed.
A top-k cache gives no exact per-row metric (the other keys' weights are gone): it is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from probe.analysis.focus.definitions.table import IDX, LOCAL_WINDOW, METRICS, SPAN_MASS
from probe.analysis.focus.definitions.terms import query_mean
from probe.analysis.focus.definitions.tokens import CLASS, IMAGE, REGISTER, Side, side
from probe.cache.format import parse_key, parse_name
from probe.cache.pictures import stack_positions
from probe.errors import ProbeError

# the metrics of one query row at a time: the table's first ones, up to the first that needs
# every query row of a text (positions, words, duplicates, distances over the text), and the
# masses on the kinds of an image stack's positions
KIND_METRICS = ("on_class", "on_register", "on_image")
ROW_METRICS = METRICS[: METRICS.index("pos_offset")] + KIND_METRICS
_EVERY_ROW = "needs every query row of the pattern"
NOT_COMPUTED = {m: _EVERY_ROW for m in METRICS if m not in ROW_METRICS} | {"rollout": _EVERY_ROW}


def _length(meta: dict[str, Any], stack: str, fallback: int) -> int:
    """The number of query positions of ``stack`` (its own side's padded length)."""
    prefix = "target_" if meta.get("target_tokens") is not None and stack == "decoder" else ""
    pos = stack_positions(meta, stack)
    if pos is not None and "grid" in pos:  # an image stack: its own sequence of positions
        return len(pos["kinds"])
    mask = meta.get(f"{prefix}attention_mask")
    if mask:
        return len(mask[0])
    tokens = meta.get(f"{prefix}tokens")
    return max((len(t) for t in tokens), default=fallback) if tokens else fallback


def row_values(
    rows: torch.Tensor, index: torch.Tensor, qs: Side, ks: Side, *, self_attn: bool, decoder: bool
):
    """``([B, H, M] per-text metrics over the kept rows, causal)`` of one attention.

    ``rows`` ``[B, H, R, K]``, ``index`` ``[B, R]`` (their query positions). The layer counts as
    causal when no kept row puts weight on a real key after its own position (when no kept row
    has such a key, as the last row, when the stack is a ``decoder``: the capture judged it so).
    """
    P = rows.float()
    B, H, R, K = P.shape
    kj = torch.arange(K)
    i = index.long()
    real_k = ks.real[:, None, :]  # [B, 1, K]
    after = kj[None, None, :] > i[:, :, None]  # [B, R, K]
    future = real_k & after
    causal = self_attn and not bool((P * future[:, None]).amax() > 0)
    if causal and not bool(future.any()):  # no kept row has a later key: the stack says it
        causal = decoder
    if bool((~ks.real).any()):
        P = torch.where(ks.real[:, None, None, :], P, 0)
    vis = real_k & ~after if causal else real_k.expand(B, R, K)
    n_vis = vis.sum(-1)  # [B, R]
    counted = (qs.real.gather(1, i) & (n_vis >= 2))[:, None, :]  # [B, 1, R]
    out = torch.full((B, H, len(METRICS)), float("nan"))
    tiny = torch.finfo(P.dtype).tiny
    ent = -(P.clamp_min(tiny).log() * P).sum(-1)
    out[..., IDX["entropy"]] = query_mean(ent, counted)
    out[..., IDX["norm_entropy"]] = query_mean(ent / torch.log(n_vis.clamp(min=2).float())[:, None], counted)
    not_end = (i != qs.end[:, None])[:, None, :]
    out[..., IDX["confidence"]] = query_mean(P.amax(-1), counted & not_end)
    first = ks.first.clamp(max=K - 1)[:, None, None, None].expand(B, H, R, 1)
    out[..., IDX["first"]] = query_mean(P.gather(-1, first)[..., 0], counted)
    content = ks.real & ~ks.special & (kj[None, :] != ks.first[:, None])
    for name, mask in (("special", ks.special), ("punct", ks.punct), ("content", content)):
        out[..., IDX[name]] = query_mean((P * mask[:, None, None, :]).sum(-1), counted)
    cum = P.sort(-1).values.cumsum(-1)
    left = torch.searchsorted(cum, ((1 - SPAN_MASS) * cum[..., -1:]).contiguous(), side="right")[..., 0]
    out[..., IDX["span"]] = query_mean((K - left).float(), counted)
    if not self_attn:
        return out, causal
    at = {}
    for d in range(-LOCAL_WINDOW, LOCAL_WINDOW + 1):
        j = i + d
        inside = (j >= 0) & (j < K)
        w = P.gather(-1, j.clamp(0, K - 1)[:, None, :, None].expand(B, H, R, 1))[..., 0]
        ok = inside & ks.real.gather(1, j.clamp(0, K - 1))
        at[d] = (torch.where(inside[:, None], w, 0), ok[:, None] & counted)
    for name, d in (("prev", -1), ("self", 0), ("next", 1)):
        ok = at[d][1] if not (d > 0 and causal) else torch.zeros_like(counted)
        out[..., IDX[name]] = query_mean(at[d][0], ok)
    out[..., IDX["local"]] = query_mean(sum(v for v, _ in at.values()), counted)
    offset = kj[None, None, :].float() - i[:, :, None].float()  # [B, R, K]: j - i
    signed = (P * offset[:, None]).sum(-1)
    out[..., IDX["distance"]] = query_mean((P * offset.abs()[:, None]).sum(-1), counted)
    out[..., IDX["signed_distance"]] = query_mean(signed, counted)
    if qs.kind is not None and ks.kind is not None:
        _kind_rows(P, i, qs, ks, counted, causal, out)
    return out, causal


def _kind_rows(P, i, qs: Side, ks: Side, counted, causal: bool, out: torch.Tensor) -> None:
    """``on_class``, ``on_register`` and ``on_image`` over the kept rows (the definitions of
    :mod:`probe.analysis.focus`): rows ``P`` ``[B, H, R, K]`` at query positions ``i`` ``[B, R]``."""
    kind, real = ks.kind, ks.real
    for name, code in (("on_class", CLASS), ("on_register", REGISTER)):
        mask = (kind == code) & real
        has = mask.any(-1)[:, None, None]
        out[..., IDX[name]] = query_mean((P * mask[:, None, None, :]).sum(-1), counted & has)
    img = (kind == IMAGE) & real  # [B, K]
    if causal:
        first = torch.where(img, torch.arange(img.shape[1]), img.shape[1]).amin(-1)  # [B]
        sees = i >= first[:, None]
    else:
        sees = img.any(-1, keepdim=True).expand_as(i)
    text = (qs.kind.gather(1, i) == 0) & sees
    out[..., IDX["on_image"]] = query_mean((P * img[:, None, None, :]).sum(-1), counted & text[:, None, :])


def add_rows(acc: Any, cache: Any) -> None:
    """Fold a rows cache into the accumulator ``acc`` (a :class:`FocusAccumulator`)."""
    kept = cache.kept
    if not cache.partial or (acc.kept is None and acc.stats):
        raise ProbeError(
            "cannot combine statistics of whole patterns with statistics over kept query rows: their "
            "means are over different queries; compute them apart"
        )
    if not (isinstance(kept, dict) and "rows" in kept):
        raise cache.not_kept("whole patterns or kept query rows, which head_stats reads")
    if acc.kept not in (None, kept):
        raise ProbeError(
            f"cannot combine statistics of caches that kept {acc.kept} and {kept}: their means are over "
            "different query rows; compute them apart"
        )
    acc.keep_rows(kept)
    meta = cache.metadata
    captured = meta.get("heads_captured")
    batch = 0
    for k in cache.keys():
        try:
            stack, layer, name = parse_key(k)
        except ValueError:
            continue
        n = parse_name(name)
        if n.field != "rows" or n.index is not None:
            continue
        rows, index = cache[k], cache[k.replace(".rows", ".row_index")]
        B, H, _, K = rows.shape
        batch = B
        qs = side(meta, stack, "own", B, _length(meta, stack, K))
        ks = side(meta, stack, "own" if n.role == "self" else "source", B, K)
        values, causal = row_values(
            rows, index, qs, ks, self_attn=n.role == "self", decoder=stack == "decoder"
        )
        key = f"{stack}/{layer}/{n.role}"
        heads = [int(captured[h]) if captured else h for h in range(H)]
        acc.fold(key, values, heads, causal, same_heads=False)
    if not batch:
        raise ProbeError("the cache holds no kept rows; capture with keep={'rows': [-1]}")
    acc.add_texts(batch)
