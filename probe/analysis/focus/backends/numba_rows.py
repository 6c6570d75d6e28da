"""The compiled CPU backend: every per-row term of a CPU block from one read of each row (numba).

:class:`RowLoop` hands each CPU block to the row loop of :mod:`~.rowloop` (the ``fast`` extra):
each row is read once while it sits in the core's cache, for every per-row term, the column sums
and the template pairs, on :func:`~.rowloop.workers.threads` threads with torch single-threaded
around them (:meth:`RowLoop.reading`). The row loop may be handed blocks never computed
(:meth:`RowLoop.fills`): each thread then computes its part of the block into its own buffer
right before it reads it. The terms are the views of one :class:`~.rowloop.rowparts.Sink` per
attention, which the loop writes each row's terms into; a block with a negative weight (a
softmax never gives one) is left to the torch reference, which writes into the same views.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from probe.analysis.focus.backends.base import RowTermsBackend
from probe.analysis.focus.backends.reference import columns
from probe.analysis.focus.definitions.table import BEYOND, LOCAL_WINDOW


class RowLoop(RowTermsBackend):
    """The compiled row loop's share of one attention: its sink, and each head's span bin passed
    on from block to block."""

    name = "numba-rows"
    order = 30

    def __init__(self, reader: Any) -> None:
        super().__init__(reader)
        B, H = reader.shape[:2]
        self.guesses = np.full(B * H, -1, np.int64)  # the row loop's span bin per head, passed on
        self.sink = None  # the row loop's arrays, which the terms view (see _sink)

    @classmethod
    def available(cls) -> bool:
        from probe.analysis.focus.backends.rowloop import rowfused

        return rowfused.available()

    def reading(self) -> contextlib.AbstractContextManager:
        """Torch single-threaded while the compiled row loop reads the blocks on the cores torch
        had (:func:`~.rowloop.workers.cores`)."""
        from probe.analysis.focus.backends.rowloop import rowfused, workers

        return workers.cores() if rowfused.available() else contextlib.nullcontext()

    def fills(self, device: torch.device) -> bool:
        """On a CPU each part of a block is computed on the thread that reads it (see
        :func:`~.rowloop.rowfused.row_terms`)."""
        from probe.analysis.focus.backends.rowloop import rowfused

        return torch.device(device).type == "cpu" and rowfused.available()

    def terms(self, q0: int, q1: int, P: torch.Tensor, fill: Any = None, trim: bool = False) -> bool:
        """Each row of a CPU block read once for every per-row term, written to its place (the sink
        the terms view); False without numba, off a CPU or at a negative weight."""
        sl = slice(q0, q1)
        got = self.loop_terms(P, sl, fill, trim)
        if got is None:
            return False
        columns(self.reader, P, q0, q1, got)
        if "pairs" in got:
            for n, (*_, hits) in got["pairs"].items():
                self.reader.t.hits[n][:, sl] = hits
        return True

    def loop_terms(self, P: torch.Tensor, sl: slice, fill: Any = None, trim: bool = False) -> dict | None:
        """The compiled row loop's terms of a CPU block (:mod:`~.rowloop.rowfused`), or None
        without numba (then the block is sorted); ``fill``: see :meth:`terms` (it leaves scores,
        whose softmax the loop takes, weights on padding keys then zeroed); ``trim``: its call is
        ``is_causal`` (each part computes, and each row is read, to the query only)."""
        from probe.analysis.focus.backends.rowloop import rowfused, rowparts

        if P.device.type != "cpu" or not rowfused.available():
            return None
        r = self.reader
        dev, kend = r.facts(P.device), P.shape[-1]
        if r.words and "word_bounds" not in dev:  # every row's, once
            dev["word_bounds"] = rowparts.word_bounds(dev["words"])
        words = dev["word_bounds"][:, sl] if r.words else None
        K = r.shape[3] if r.self_attn else None
        # the template pairs' sums too, each row read while it is in cache
        pairs = r.pair_keys(sl, kend, P.device) if r.self_attn and r.t.tmpl is not None else None
        sink = self._sink()
        got = rowfused.row_terms(
            P,
            sl.start,
            K,
            dev["cols"][..., :kend],
            dev["first"],
            words,
            colw=dev["qreal"][:, sl],
            fill=fill,
            guesses=self.guesses,
            keep=None if fill is None else dev["real"][:, :kend],
            pairs=pairs,
            kept=(LOCAL_WINDOW if r.self_attn else 0, r.qs.first) if fill is not None else None,
            trim=trim,
            into=sink,
        )
        if got is not None and pairs is not None:
            got["pairs"] = pairs  # their hits, for terms (not looked up a second time)
        return got

    def _sink(self):
        """The row loop's :class:`~.rowloop.rowparts.Sink` for this attention, made at its first
        block: the terms become views of its arrays, so the loop writes each row's terms to their
        place and a block summed another way (sorted: a negative weight) writes there too. Until
        :meth:`settle`, the causal audit (each row's largest weight after its query) and the
        previous-token template (the weight at ``d = −1``) wait in it."""
        from probe.analysis.focus.backends.rowloop.rowparts import Sink

        if self.sink is None:
            r = self.reader
            B, H, Q, _ = r.shape
            t = r.t
            names = tuple(t.hits) if t.hits is not None else ()
            s = self.sink = Sink(B, H, Q, LOCAL_WINDOW if r.self_attn else 0, names)
            t.ent, t.top, t.total, t.span = (s.term(n) for n in ("ent", "top", "total", "span"))
            t.arg, t.masks, t.first = s.args(), s.masks(), s.term("first")
            if r.self_attn:
                t.signed, t.dist, t.reach = (s.term(n) for n in ("signed", "dist", "reach"))
                t.diag = s.diag()
                t.beyond = {D: s.term(f"beyond_{D}") for D in BEYOND}
                if t.word is not None:
                    t.word = {n: s.term(n) for n in t.word}
                if t.tmpl is not None:
                    t.tmpl.update({n: s.pair(n) for n in names})
        return self.sink

    def settle(self) -> None:
        """The sink's rows folded into what the blocks leave for the end (see :meth:`_sink`):
        the layer is not causal where a real query's largest weight after it is above 0, and the
        previous-token template is each real query's weight at ``d = −1``."""
        s, r = self.sink, self.reader
        if s is None or r.t is None:
            return
        qreal = r.facts(torch.device("cpu"))["qreal"][:, None]
        if r.causal and bool((s.term("after") * qreal).amax() > 0):
            r.causal = False
        if r.t.tmpl is not None:
            r.t.tmpl["prev"] = torch.where(qreal, r.t.diag[-1], 0)


BACKEND = RowLoop

__all__ = ["RowLoop"]
