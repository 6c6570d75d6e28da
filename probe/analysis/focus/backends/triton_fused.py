"""The fused Triton backend: a self-attention's statistics straight from its SDPA call's ``q`` and ``k``.

A streamed attention (:class:`~probe.analysis.focus.streamed.reader.RowTerms`) is normally handed
the recomputed weights block by block. When the attention was one SDPA call on a CUDA device and
Triton is installed, :class:`FusedCall` (:func:`read_call`) instead hands ``q``, ``k``, the mask
and the scale to the kernel of :mod:`~.kernels.qkkernel`, which never writes the weights; it returns
each row's log-sum-exp, from which the few single weights the other terms need (the diagonals ``a_i,i+d``,
the duplicate-token and induction pairs, the first real query's row) are recomputed here as dot
products: ``exp(scale · q_i·k_j + mask_ij − lse_i)``.

It runs only where ``PROBE_FUSED=1`` is set (:func:`enabled`; the benchmark's ``stats_fused``
mode). Where it does not apply (not enabled, cross-attention, several SDPA calls per sublayer,
another device) :func:`read_call` returns False and the weights come block by block.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from probe.analysis.focus.backends.base import RowTermsBackend, installed
from probe.analysis.focus.definitions.table import BEYOND, LOCAL_WINDOW

CPU = False  # run on CPU tensors too (the tests, with Triton's interpreter); off: a CPU sorts faster
PAIRS = 1 << 16  # weights recomputed per chunk by weights_at (bounds its [n, heads, E] gathers)
ROWS = 1024  # query rows whose template pairs are found at a time


def _call(args: tuple, kwargs: dict) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    out = dict(zip(names, args, strict=False))
    out.update(kwargs)
    return out


def enabled(device: torch.device) -> bool:
    """Whether the fused path runs on ``device``: only where ``PROBE_FUSED=1`` is set, on a CUDA
    device (or on CPU tensors with :data:`CPU` set: the interpreter tests). Off by default: on an
    H100 at 16,384 tokens its passes over ``K`` (one per narrowing of the span's threshold) took
    longer than recomputing the weights block by block (docs/long-context.md)."""
    if os.environ.get("PROBE_FUSED") != "1":
        return False
    return device.type == "cuda" or CPU


def read_call(reader: Any, args: tuple, kwargs: dict) -> bool:
    """Fill the :class:`RowTerms` ``reader`` from one SDPA call; False where the fused kernel does
    not apply (then the caller hands the weights block by block)."""
    c = _call(args, kwargs)
    q, k, mask = c.get("query"), c.get("key"), c.get("attn_mask")
    if q is None or k is None or not enabled(q.device):
        return False
    from probe.analysis.focus.backends.kernels import qkkernel

    B, H, Q, K = reader.shape
    if not (reader.self_attn and qkkernel.usable(q, k, mask)):
        return False
    if tuple(q.shape[:3]) != (B, H, Q) or k.size(2) != K:
        return False
    dev = reader.facts(q.device)
    causal, scale = bool(c.get("is_causal", False)), c.get("scale")
    words = dev.get("words") if reader.t.word is not None else None
    got = qkkernel.qk_terms(
        q,
        k,
        mask,
        causal,
        scale,
        kreal=dev["real"],
        qreal=dev["qreal"],
        cols=dev["cols"],
        first=dev["first"],
        words=words,
    )
    reader.hold_on(q.device)
    w = _Weights(q, k, mask, causal, got["lse"], dev["real"], scale)
    _fill(reader, got, w, dev)
    return True


class _Weights:
    """Single weights ``a_ij`` of one SDPA call from its row log-sum-exps (:meth:`at`)."""

    def __init__(self, q, k, mask, causal, lse, kreal, scale) -> None:
        B, H, L, E = q.shape
        self.q, self.lse, self.kreal, self.causal = q.float(), lse, kreal, causal
        self.k = k.float().expand(B, *k.shape[1:]).repeat_interleave(H // k.size(1), dim=1)
        self.scale = E**-0.5 if scale is None else float(scale)
        m = mask
        if m is not None:
            while m.dim() < 4:
                m = m.unsqueeze(0)
            m = m.expand(B, H, L, k.size(2))
        self.mask = m

    def at(self, b: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """``a[b, :, i, j]`` ``[n, H]`` for index tensors ``b``, ``i``, ``j`` ``[n]``."""
        out = []
        for s in range(0, b.numel(), PAIRS):
            bb, ii, jj = b[s : s + PAIRS], i[s : s + PAIRS], j[s : s + PAIRS]
            sc = (self.q[bb, :, ii] * self.k[bb, :, jj]).sum(-1) * self.scale  # [n, H]
            ok = self.kreal[bb, jj][:, None] & (self.lse[bb, :, ii] > float("-inf"))
            if self.causal:
                ok = ok & (jj <= ii)[:, None]
            if self.mask is not None:
                mv = self.mask[bb, :, ii, jj]
                if mv.dtype == torch.bool:
                    ok = ok & mv
                else:
                    sc = sc + mv.float()
            p = torch.exp(sc - self.lse[bb, :, ii])
            out.append(torch.where(ok & (sc > float("-inf")), p, 0.0))
        return torch.cat(out) if out else self.q.new_zeros(0, self.q.size(1))


def _fill(r: Any, got: dict, w: _Weights, dev: dict) -> None:
    """Write the kernel's terms and the single weights into the reader's terms."""
    B, H, Q, K = r.shape
    t, device = r.t, w.q.device
    for n in ("ent", "total", "top", "arg", "span", "signed", "dist"):
        getattr(t, n)[:] = got[n]
    t.reach = got["reach"].clone()
    t.masks[:] = torch.stack([got["special"], got["punct"], got["content"]], -1)
    t.first[:] = torch.where((dev["first"] < K)[:, None, None], got["first"], 0)
    for D in BEYOND:
        t.beyond[D] = got[f"beyond_{D}"].clone()
    if t.word is not None:
        for n in t.word:
            t.word[n][:] = got[n]
    r.recv += got["recv"]
    keys = torch.arange(K, device=device)
    for b, f in enumerate(r.qs.first.tolist()):
        if 0 <= f < Q:
            r.recv_first[b] = w.at(torch.full_like(keys, b), torch.full_like(keys, f), keys).T
    if r.causal and bool(got["after"].amax() > 0):
        r.causal = False
    rows = torch.arange(Q, device=device)
    for d in range(-LOCAL_WINDOW, LOCAL_WINDOW + 1):
        ok = (rows + d >= 0) & (rows + d < K)
        i = rows[ok].repeat(B)
        b = torch.arange(B, device=device).repeat_interleave(int(ok.sum()))
        t.diag[d].zero_()
        t.diag[d][b, :, i] = w.at(b, i, i + d)
    if t.tmpl is not None:
        real_q = dev["qreal"][:, None, :]
        t.tmpl["prev"][:] = torch.where(real_q, t.diag[-1], 0)
        for q0 in range(0, Q, ROWS):
            q1 = min(Q, q0 + ROWS)
            for n, (b, i, j, hits) in r.ws.pairs(r.qs, r.ks, q0, q1, K, device).items():
                per = torch.zeros(B * (q1 - q0), H, device=device).index_add_(
                    0, b * (q1 - q0) + i, w.at(b, i + q0, j)
                )
                t.tmpl[n][..., q0:q1] = per.view(B, q1 - q0, H).permute(0, 2, 1)
                t.hits[n][:, q0:q1] = hits


class FusedCall(RowTermsBackend):
    """A whole SDPA call through the fused kernel (:func:`read_call`); blocks are not its."""

    name = "triton-fused"
    order = 10

    @classmethod
    def available(cls) -> bool:
        return installed("triton")

    def call(self, args: tuple, kwargs: dict) -> bool:
        return read_call(self.reader, args, kwargs)

    def terms(self, q0: int, q1: int, P: torch.Tensor, fill: Any = None, trim: bool = False) -> bool:
        return False


BACKEND = FusedCall

__all__ = ["FusedCall", "read_call", "enabled", "CPU"]
