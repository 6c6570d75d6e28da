"""The Triton backend for a block on a GPU: one program per row, and no wait per block.

:class:`RowKernel` hands each CUDA block to the row kernel (:mod:`~.kernels.rowkernel`): one
Triton program per row gives every per-row term: total, entropy, top weight and argmax, span, the
first key's weight and, for self-attention, the distances, ``beyond_<D>``, ``reach90``, the
diagonals, the word masses and each row's largest weight after its query (the causal audit); the
key-class masses, the column sums and the template pairs stay in torch
(:mod:`~.reference`). The host issues one launch per block and never reads the device back
between blocks, so it queues the next block's work while the device computes this one:

* blocks that probe computed with a softmax (SDPA's recomputed weights, the reader's
  ``softmax``) cannot hold a negative weight, so the kernel writes straight into one
  ``[B, H, Q, N]`` table of the attention, which is spread into the
  :class:`~probe.analysis.focus.definitions.terms.Terms` once, when the attention closes
  (:meth:`RowKernel.settle`);
* the causal audit is kept on the device and read once per attention.

Weights the model computed itself are read back per block (``neg``): a negative weight (a softmax
variant) breaks the span's bisection, and that block is left to the next backend (sorted).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from probe.analysis.focus.backends.base import RowTermsBackend, installed
from probe.analysis.focus.backends.reference import columns, gathered_pairs, key_masses
from probe.analysis.focus.definitions.table import BEYOND

KERNEL = "probe.analysis.focus.backends.kernels.rowkernel"


class RowKernel(RowTermsBackend):
    """The row kernel's share of one attention: :meth:`terms` a block, :meth:`settle` when the
    attention is done."""

    name = "triton-rows"
    order = 20

    def __init__(self, reader: Any) -> None:
        super().__init__(reader)
        self.table: torch.Tensor | None = None  # [B, H, Q, N] the kernel writes into
        self.span: tuple[int, int] | None = None  # its rows written and not yet spread
        self.above: torch.Tensor | None = None  # the largest weight after a real query so far

    @classmethod
    def available(cls) -> bool:
        return installed("triton")

    def terms(self, q0: int, q1: int, P: torch.Tensor, fill: Any = None, trim: bool = False) -> bool:
        """One kernel pass gives every per-row term (no prefix sums, no sort, no wait); the key-class
        masses, column sums and template pairs in torch."""
        sl = slice(q0, q1)
        if not self.take(P, sl):
            return False
        r = self.reader
        r.t.masks[:, :, sl] = key_masses(P, r.facts(P.device)["cols"][..., : P.shape[-1]])
        columns(r, P, q0, q1)
        if r.self_attn and r.t.tmpl is not None:
            gathered_pairs(r, P, sl)
        return True

    def take(self, P: torch.Tensor, sl: slice) -> bool:
        """The per-row terms of block ``P`` (rows ``sl``) from the kernel; False where it does
        not apply (a CPU, no Triton, rows too long, a negative weight): the caller computes them."""
        kernel = sys.modules.get(KERNEL)  # on a CPU only for the tests' interpreter
        if not P.is_cuda and not getattr(kernel, "CPU", False):
            return False
        from probe.analysis.focus.backends.kernels import rowkernel

        if not rowkernel.usable(P):
            self.flush()
            return False
        o = self.reader
        dev = o.facts(P.device)
        if "first32" not in dev:
            dev["first32"] = dev["first"].to(torch.int32)
            if o.words:  # one table of word ends for every block
                dev["ends"] = rowkernel.word_ends(dev["words"])
        words = dev["ends"][:, sl] if o.words else None
        K = o.shape[3] if o.self_attn else None
        if not o.softmax:  # the model's own weights: read back for a negative one
            got = rowkernel.row_terms(P, sl.start, K, words, check=True, first=dev["first32"])
            if got is None:
                return False
            self._store(got, sl)
            return True
        if self.table is None:
            n = len(rowkernel.columns(o.self_attn, o.words))
            self.table = torch.zeros(*o.shape[:3], n, device=P.device)
        if self.span is not None and self.span[1] != sl.start:
            self.flush()
        rowkernel.launch(P, self.table, dev["first32"], sl.start, K, words, at=sl.start)
        self.span = (sl.start if self.span is None else self.span[0], sl.stop)
        return True

    def flush(self) -> None:
        """Spread the table's rows written so far into the reader's terms."""
        if self.span is None:
            return
        from probe.analysis.focus.backends.kernels import rowkernel

        o = self.reader
        sl = slice(*self.span)
        names = rowkernel.columns(o.self_attn, o.words)
        got = {n: self.table[:, :, sl, c] for c, n in enumerate(names) if n != "neg"}
        got["arg"] = got["arg"].long()
        self._store(got, sl)
        self.span = None

    def settle(self) -> None:
        """The attention is done: spread the table, then read the causal audit once."""
        self.flush()
        self.table = None
        if self.above is not None:
            if bool(self.above > 0):
                self.reader.causal = False
            self.above = None

    def _store(self, got: dict[str, torch.Tensor], sl: slice) -> None:
        o = self.reader
        t = o.t
        for n in ("ent", "total", "top", "arg", "span", "first"):
            getattr(t, n)[..., sl] = got[n]
        if not o.self_attn:
            return
        t.signed[..., sl], t.dist[..., sl] = got["signed"], got["dist"]
        for D in BEYOND:
            if D not in t.beyond:
                t.beyond[D] = torch.zeros_like(t.ent)
            t.beyond[D][..., sl] = got[f"beyond_{D}"]
        if t.reach is None:
            t.reach = torch.zeros_like(t.ent)
        t.reach[..., sl] = got["reach"]
        for d in t.diag:
            t.diag[d][..., sl] = got[f"diag_{d}"]
        if t.word is not None:
            for n in t.word:
                t.word[n][..., sl] = got[n]
        qreal = o.facts(t.ent.device)["qreal"][:, None, sl]
        if t.tmpl is not None:
            t.tmpl["prev"][..., sl] = torch.where(qreal, t.diag[-1][..., sl], 0)
        if o.causal:  # kept on the device: read once, in settle
            m = (got["after"] * qreal).amax()
            self.above = m if self.above is None else torch.maximum(self.above, m)


BACKEND = RowKernel

__all__ = ["RowKernel"]
