"""Per-row quantities of a whole pattern, computed band by band (:class:`PatternRows`), and
whether a layer is causal (:func:`is_causal`): causal rows read only the lower triangle."""

from __future__ import annotations

import functools

import numpy as np
import torch

from probe.analysis.focus.definitions.layout import Layout
from probe.analysis.focus.definitions.table import SPAN_MASS
from probe.analysis.focus.definitions.tokens import Side

BANDS = 8  # causal rows are sorted in bands of queries, each over the keys it can see


def _bands(Q: int, K: int, causal: bool) -> list[tuple[int, int, int]]:
    """``(q0, q1, n)`` row bands: causal rows ``q0:q1`` read only the ``n = q1`` keys they can see
    (everything right of that is exactly zero), other rows read all ``K`` keys in one band."""
    if not causal:
        return [(0, Q, K)]
    step = max(1, -(-Q // BANDS))
    return [(q0, min(Q, q0 + step), min(Q, q0 + step)) for q0 in range(0, Q, step)]


class PatternRows:
    """Per-row quantities of a block ``[B, h, Q, K]``, computed band by band in one sweep so that
    causal layers read only the lower triangle: entropy, max and argmax, row sum, masses on the
    key masks, Σ_j j·P_ij, the effective span and (when words are split) cumulative row sums.

    Each is the cheapest exact way measured on CPU: matrix-vector products (not a skinny matrix
    product) for the masked sums, numpy's SIMD sort for the span and its argmax (first occurrence),
    and p·log(max(p, tiny)) for the entropy terms, equal to xlogy(p, p) except for subnormal p
    (where both are below float32 resolution of the sum)."""

    def __init__(self, P: torch.Tensor, lay: Layout, *, self_attn: bool, cumsum: bool) -> None:
        B, h, Q, K = P.shape
        new = functools.partial(P.new_empty, (B, h, Q))
        self.ent, self.top, self.total, self.span = new(), new(), new(), new()
        self.arg = torch.empty((B, h, Q), dtype=torch.long)
        cols = lay.masks[:, 0].permute(0, 2, 1).contiguous()  # [B, 3, K]
        self.masks = P.new_empty((B, h, Q, cols.shape[1]))
        self.signed = new() if self_attn else None
        self.cum = P.new_empty((B, h, Q, K)) if cumsum else None
        kf = lay.kj.to(P.dtype)
        tiny = torch.finfo(P.dtype).tiny
        for q0, q1, n in _bands(Q, K, lay.causal):
            band = P[..., q0:q1, :n].contiguous()
            terms = band.clamp_min(tiny).log_().mul_(band)
            self.ent[..., q0:q1] = terms.sum(-1).neg_()
            del terms
            self.arg[..., q0:q1] = torch.from_numpy(band.numpy().argmax(-1))
            self.total[..., q0:q1] = band.sum(-1)
            for b in range(B):
                for c in range(cols.shape[1]):
                    self.masks[b, :, q0:q1, c] = band[b] @ cols[b, c, :n]
            if self_attn:
                # Σ (j − i)·a as Σ (j − q0)·a − (i − q0)·Σ a: the terms stay near the band, not i
                self.signed[..., q0:q1] = band @ (kf[:n] - q0) - (kf[q0:q1] - q0) * self.total[..., q0:q1]
            self.top[..., q0:q1], self.span[..., q0:q1] = _top_span(band, n)
            if cumsum:
                c = self.cum[..., q0:q1, :]
                c[..., :n] = band.cumsum(-1)
                if n < K:  # right of the visible keys a causal row adds nothing: its sum stays
                    c[..., n:] = c[..., n - 1 : n]


def _top_span(band: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest weight and effective span: the compiled CPU row loop's selection
    (:mod:`~probe.analysis.focus.backends.rowloop.rowfused`) where numba is installed (as the
    streamed path uses), else numpy's sort with float32 running sums (as the streamed path then
    does)."""
    from probe.analysis.focus.backends.rowloop import rowfused

    if rowfused.available() and bool((band >= 0).all()):
        return band.amax(-1), rowfused.spans(band).to(band.dtype)
    vals = torch.from_numpy(np.sort(band.numpy(), -1))
    top = vals[..., -1].clone()
    torch.cumsum(vals, -1, out=vals)
    # leftover keys: the most smallest weights whose sum stays within the (1 − SPAN_MASS) rest
    rest = (1 - SPAN_MASS) * vals[..., -1:]
    left = torch.searchsorted(vals, rest.contiguous(), side="right")[..., 0]
    return top, (n - left).to(band.dtype)


def is_causal(P: torch.Tensor, q: Side, k: Side) -> bool:
    """Whether every weight above the diagonal (between real tokens) is exactly zero."""
    Q, K = P.shape[-2:]
    if Q != K or Q < 2:
        return False
    padded = bool((~q.real).any() or (~k.real).any())
    real = q.real[:, None, :, None] & k.real[:, None, None, :] if padded else None
    step = max(1, -(-Q // BANDS))
    for q0 in range(0, Q, step):
        q1 = min(Q, q0 + step)
        above = P[..., q0:q1, q1:]  # wholly above the diagonal
        band = P[..., q0:q1, q0:q1].triu(1)
        if padded:
            above = torch.where(real[..., q0:q1, q1:], above, 0)
            band = torch.where(real[..., q0:q1, q0:q1], band, 0)
        # patterns are non-negative: a positive maximum is a weight above the diagonal
        if (above.numel() and bool(above.amax() != 0)) or (band.numel() and bool(band.amax() != 0)):
            return False
    return True


__all__ = ["PatternRows", "is_causal", "BANDS"]
