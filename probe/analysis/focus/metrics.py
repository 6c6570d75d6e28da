"""The per-text value of every focus metric for a block of heads, vectorised over heads and texts.

:func:`block_metrics` takes one pattern block ``[batch, heads, query, key]`` and returns
``[batch, heads, len(METRICS)]``: each metric averaged over the text's counted queries (NaN where
a metric is undefined for that text or kind). Definitions and conventions are documented once, in
:mod:`probe.analysis.focus`.
"""

from __future__ import annotations

import torch

from probe.analysis.focus.tokens import Side

METRICS = (
    "entropy",
    "norm_entropy",
    "confidence",
    "first",
    "special",
    "punct",
    "content",
    "span",
    "prev",
    "self",
    "next",
    "local",
    "distance",
    "signed_distance",
    "pos_offset",
    "pos_frac",
    "word_prev",
    "word_self",
    "word_next",
    "prev_score",
    "dup_score",
    "induction_score",
    "dup_prefix",
    "induction_prefix",
)
IDX = {m: i for i, m in enumerate(METRICS)}
SPAN_MASS = 0.9  # effective span: keys needed to cover this share of a row's mass
LOCAL_WINDOW = 2  # local mass: keys with |i - j| <= this


def _mean(r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Mean of ``r`` ``[B, h, Q]`` over queries weighted by ``w`` (bool, broadcastable); NaN if none."""
    w = w.to(r.dtype).expand_as(r)
    n = w.sum(-1)
    return torch.where(n > 0, (torch.nan_to_num(r) * w).sum(-1) / n.clamp(min=1), float("nan"))


def _diag(P: torch.Tensor, d: int) -> torch.Tensor:
    """``out[..., i] = P[..., i, i + d]`` where that key exists, else 0; shape ``[B, h, Q]``."""
    Q, K = P.shape[-2:]
    out = P.new_zeros(P.shape[:-1])
    lo, hi = max(0, -d), min(Q, K - d)
    if hi > lo:
        out[..., lo:hi] = torch.diagonal(P, offset=d, dim1=-2, dim2=-1)[..., : hi - lo]
    return out


def _key_ok(k: Side, d: int, Q: int, vis_upper: bool) -> torch.Tensor:
    """``[B, 1, Q]``: whether key ``i + d`` exists, is real and visible to query ``i``."""
    K = k.real.shape[1]
    i = torch.arange(Q) + d
    inside = (i >= 0) & (i < K)
    ok = torch.zeros(k.real.shape[0], Q, dtype=torch.bool)
    ok[:, inside] = k.real[:, i[inside]]
    if d > 0 and not vis_upper:
        ok[:] = False
    return ok[:, None, :]


def is_causal(P: torch.Tensor, q: Side, k: Side) -> bool:
    """Whether every weight above the diagonal (between real tokens) is exactly zero."""
    Q, K = P.shape[-2:]
    if Q != K or Q < 2:
        return False
    upper = torch.ones(Q, K, dtype=torch.bool).triu(1)
    upper = upper & q.real[:, None, :, None] & k.real[:, None, None, :]
    return not bool(torch.where(upper, P, 0).any())


def block_metrics(P: torch.Tensor, q: Side, k: Side, *, self_attn: bool, causal: bool) -> torch.Tensor:
    """Every metric per text and head for the block ``P`` ``[B, h, Q, K]``; returns ``[B, h, M]``."""
    P = P.float()
    B, h, Q, K = P.shape
    out = torch.full((B, h, len(METRICS)), float("nan"))
    if k.real.logical_not().any():  # weight on padding keys is not attention to the text
        P = torch.where(k.real[:, None, None, :], P, 0)
    qi = torch.arange(Q)
    kj = torch.arange(K)
    n_vis = k.real.sum(-1)[:, None, None].expand(B, 1, Q)
    if causal:
        n_vis = (k.real[:, None, :] & (kj[None, :] <= qi[:, None])).sum(-1)[:, None, :]
    counted = q.real[:, None, :] & (n_vis >= 2)  # [B, 1, Q]: queries that have a choice

    ent = -torch.special.xlogy(P, P).sum(-1)
    out[..., IDX["entropy"]] = _mean(ent, counted)
    log_n = torch.log(n_vis.clamp(min=2).float())
    out[..., IDX["norm_entropy"]] = _mean(ent / log_n, counted)
    del ent
    top, arg = P.max(-1)
    not_end = (qi[None, :] != q.end[:, None])[:, None, :]
    out[..., IDX["confidence"]] = _mean(top, counted & not_end)

    first = P.gather(-1, k.first.clamp(max=K - 1)[:, None, None, None].expand(B, h, Q, 1))[..., 0]
    out[..., IDX["first"]] = _mean(first, counted)
    masks = torch.stack(
        [
            k.special,
            k.punct,
            k.real & ~k.special & (kj[None, :] != k.first[:, None]),
        ],
        -1,
    ).float()  # [B, K, 3]
    sums = P @ masks[:, None]  # [B, h, Q, 3]
    for c, name in enumerate(("special", "punct", "content")):
        out[..., IDX[name]] = _mean(sums[..., c], counted)

    vals = P.sort(-1, descending=True).values
    total = vals.sum(-1, keepdim=True)
    torch.cumsum(vals, -1, out=vals)
    span = (vals < SPAN_MASS * total).sum(-1).float() + 1
    del vals
    out[..., IDX["span"]] = _mean(span, counted)
    if not self_attn:
        return out

    for name, d in (("prev", -1), ("self", 0), ("next", 1)):
        out[..., IDX[name]] = _mean(_diag(P, d), counted & _key_ok(k, d, Q, not causal))
    local = sum(_diag(P, d) for d in range(-LOCAL_WINDOW, LOCAL_WINDOW + 1))
    out[..., IDX["local"]] = _mean(local, counted)
    signed = P @ kj.float()[:, None] - (qi.float()[:, None] * P.sum(-1, keepdim=True))
    signed = signed[..., 0]
    if causal:
        dist = -signed
    else:
        dist = (P * (kj[None, :] - qi[:, None]).abs().float()).sum(-1)
    out[..., IDX["distance"]] = _mean(dist, counted)
    out[..., IDX["signed_distance"]] = _mean(signed, counted)

    # positional: the most common offset (argmax key - query) and the share of queries using it
    offset = arg - qi + (K - 1)  # [B, h, Q] in 0 .. Q + K - 2
    hist = torch.zeros(B, h, Q + K - 1)
    hist.scatter_add_(-1, offset, counted.float().expand(B, h, Q))
    best, mode = hist.max(-1)
    n_counted = counted.sum(-1).float()  # [B, 1]
    has = n_counted > 0
    out[..., IDX["pos_offset"]] = torch.where(has, (mode - (K - 1)).float(), float("nan"))
    out[..., IDX["pos_frac"]] = torch.where(has, best / n_counted.clamp(min=1), float("nan"))

    _words(P, q, k, out, causal)
    if q.ids is not None and k.ids is not None:
        _templates(P, q, k, out)
    return out


def _words(P: torch.Tensor, q: Side, k: Side, out: torch.Tensor, causal: bool) -> None:
    """Word-level previous/self/next masses: attention to a word summed over its pieces, from a
    word averaged over its pieces (Clark et al. 2019)."""
    B, h, Q, K = P.shape
    W = max(q.n_words, k.n_words)
    to_word = torch.zeros(B, K, W)
    kw = k.word.clamp(min=0)
    to_word.scatter_(-1, kw[..., None], k.real[..., None].float())
    from_word = torch.zeros(B, W, Q)
    from_word.scatter_(1, q.word.clamp(min=0)[:, None, :], q.real[:, None, :].float())
    sizes = from_word.sum(-1, keepdim=True)
    from_word = from_word / sizes.clamp(min=1)
    Aw = from_word[:, None] @ (P @ to_word[:, None])  # [B, h, W, W]
    wi = torch.arange(W)
    real_w = sizes[..., 0] > 0  # [B, W]
    rows = real_w & ~((wi == 0) & causal)[None, :]
    for name, d in (("word_prev", -1), ("word_self", 0), ("word_next", 1)):
        j = wi + d
        ok = rows & (j >= 0) & (j < W)
        ok[:, (j >= 0) & (j < W)] &= real_w[:, j[(j >= 0) & (j < W)]]
        if d > 0 and causal:
            ok[:] = False
        out[..., IDX[name]] = _mean(_diag(Aw, d), ok[:, None, :])


def _templates(P: torch.Tensor, q: Side, k: Side, out: torch.Tensor) -> None:
    """Previous-token, duplicate-token and induction template scores (see the module docs)."""
    B, h, Q, K = P.shape
    qi, kj = torch.arange(Q)[:, None], torch.arange(K)[None, :]
    real = q.real[:, :, None] & k.real[:, None, :]  # [B, Q, K]
    same = (q.ids[:, :, None] == k.ids[:, None, :]) & real
    prev_same = torch.zeros_like(same)  # ids[i] == ids[j - 1]
    prev_same[:, :, 1:] = same[:, :, :-1] & k.real[:, None, 1:]
    templates = {
        "prev": real & (kj == qi - 1),
        "dup": same & (kj < qi),
        "induction": prev_same & (kj <= qi),
    }
    total = (P * real[:, None].float()).sum((-1, -2))  # [B, h]: ΣA over real queries and keys
    for name, D in templates.items():
        b, i, j = D.nonzero(as_tuple=True)
        picked = P[b, :, i, j]  # [n_pairs, h]
        per_query = torch.zeros(B, Q, h).index_put_((b, i), picked, accumulate=True)
        hits = torch.zeros(B, Q).index_put_((b, i), torch.ones(len(b)), accumulate=True) > 0
        mass = per_query.sum(1)  # [B, h]
        col = "prev_score" if name == "prev" else f"{name}_score"
        out[..., IDX[col]] = torch.where(total > 0, mass / total.clamp(min=1e-30), float("nan"))
        if name != "prev":
            n = hits.sum(-1, keepdim=True).float()  # [B, 1]
            prefix = (per_query * hits[..., None]).sum(1) / n.clamp(min=1)
            out[..., IDX[f"{name}_prefix"]] = torch.where(n > 0, prefix, float("nan"))


__all__ = ["METRICS", "IDX", "SPAN_MASS", "LOCAL_WINDOW", "block_metrics", "is_causal"]
