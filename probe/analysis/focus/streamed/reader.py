"""Focus statistics while the model runs: every metric from row blocks, no pattern ever whole.

``probe.head_stats(model, inputs)`` runs one forward through :func:`probe.forward.stream_attention`,
which hands each attention's weights a block of query rows at a time (recomputed SDPA weights, or
slices of a softmax the model computed) to a :class:`RowTerms` made here. It turns each block into
the per-query :class:`~probe.analysis.focus.definitions.terms.Terms` of its rows and drops it; when the
forward is done, :func:`~probe.analysis.focus.definitions.terms.reduce` turns the terms into the metrics,
exactly as for a captured cache (the run itself, a reader per attention and the table, is
:mod:`probe.analysis.focus.streamed.run`); on a CPU each attention's terms are reduced when it closes.
Peak memory is one block (``[batch, heads, rows, keys]``) plus O(batch · heads · T) of terms (one
attention's on a CPU, every layer's on a GPU), never a ``T × T`` pattern.

On a CUDA device with Triton one kernel per block (:mod:`~probe.analysis.focus.backends.kernels.rowkernel`,
driven by
:mod:`probe.analysis.focus.backends.triton_rows`) gives every per-row term that otherwise takes a sort, prefix
sums or a gather, the host never waits for the device between blocks, and the terms stay on the
device until the forward ends.

Whether a self-attention layer is causal (which decides the counted queries) is judged on every
block as it passes: no weight above the diagonal between real tokens. Attention rollout needs every
layer's whole pattern, so it is not computed on this path (``HeadStats.not_computed`` says so).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import numpy as np
import torch

from probe.analysis.focus.backends import reference as rb
from probe.analysis.focus.backends.triton_rows import KernelTerms
from probe.analysis.focus.definitions.reach import BEYOND
from probe.analysis.focus.definitions.terms import (
    LOCAL_WINDOW,
    Layout,
    Terms,
    reduce,
    word_masses,
    word_targets,
)
from probe.analysis.focus.definitions.tokens import Side

ROLLOUT_NOTE = (
    "attention rollout multiplies every layer's whole T x T pattern; head_stats(model, ...) never "
    "holds one: capture the model (probe.capture) and pass the cache to compute it"
)
PIXELS_NOTE = (
    "{} needs what each position is (the image grid), which is named after the forward: capture "
    "the patterns (probe.capture) and pass the cache to compute it"
)
IMAGE_METRICS = ("distance_px", "on_class", "on_register", "on_image")


def streamed_not_computed(meta: dict[str, Any], rollout: str = ROLLOUT_NOTE) -> dict[str, str]:
    """What statistics computed while the model runs leave out, with the reason."""
    out = {"rollout": rollout}
    if any(isinstance(s, dict) and s.get("positions") for s in (meta.get("stacks") or {}).values()):
        out.update({m: PIXELS_NOTE.format(m) for m in IMAGE_METRICS})
    return out


@contextlib.contextmanager
def one_thread():
    """Torch on one thread inside: for the many small ops on ``[B, H, Q]`` terms, where torch's
    thread team would only wait at each op."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class RowTerms:
    """The :class:`Terms` of one attention ``[B, H, Q, K]``, filled by :meth:`rows` a block of
    query rows at a time; :meth:`close` says whether it was causal, :meth:`values` gives the
    metrics ``[B, H, M]``."""

    def __init__(
        self, qs: Side, ks: Side, shape: tuple[int, ...], *, self_attn: bool, ws: rb.Workspace | None = None
    ) -> None:
        B, H, Q, K = shape
        self.shape, self.self_attn, self.qs, self.ks = shape, self_attn, qs, ks
        self.ws = ws if ws is not None else rb.Workspace()  # scratch shared by one run's readers
        self.lay = Layout(qs, ks, Q, K, causal=False)
        self.causal = self_attn and Q == K and Q >= 2
        self.words = self_attn and self.lay.words_split
        self.ids = self_attn and qs.ids is not None and ks.ids is not None

        def new():
            return torch.zeros(B, H, Q)

        t = Terms(
            new(), new(), torch.zeros(B, H, Q, dtype=torch.long), new(), new(), torch.zeros(B, H, Q, 3), new()
        )
        if self_attn:
            t.diag = {d: new() for d in range(-LOCAL_WINDOW, LOCAL_WINDOW + 1)}
            t.signed, t.dist = new(), new()
            t.word = {n: new() for n in ("word_prev", "word_self", "word_next")} if self.words else None
            if self.ids:
                t.tmpl = {n: new() for n in ("prev", "dup", "induction")}
                t.hits = {n: torch.zeros(B, Q, dtype=torch.bool) for n in ("dup", "induction")}
        self.t = t
        self.recv = torch.zeros(B, H, K, dtype=torch.float64)  # Σ over real queries of a_ij
        self.recv_first = torch.zeros(B, H, K, dtype=torch.float64)  # the first real query's row
        self._dev: dict[str, dict[str, Any]] = {}
        self.softmax = False  # see recomputed()
        self.gpu = KernelTerms(self)  # the row kernel's share, on a GPU
        self.guesses = np.full(B * H, -1, np.int64)  # the CPU row loop's span bin per head, passed on
        self.sink = None  # the CPU row loop's arrays, which the terms view (see _sink)
        self._done: tuple[torch.Tensor, torch.Tensor] | None = None  # (values, received), see close()

    def _on(self, device: torch.device) -> dict[str, Any]:
        """The key-side facts on ``device`` (copied once per device; the row kernel adds its own)."""
        d = self._dev.get(str(device))
        if d is None:
            ks, lay = self.ks, self.lay
            d = {
                "real": ks.real.to(device),
                "cols": lay.masks[:, 0].permute(0, 2, 1).contiguous().to(device),  # [B, 3, K]
                "kf": lay.kj.float().to(device),
                "first": ks.first.to(device),
                "qreal": self.qs.real.to(device),
            }
            if self.words:
                d["words"] = {n: (s.to(device), e.to(device)) for n, (s, e) in word_targets(lay).items()}
            self._dev[str(device)] = d
        return d

    def _to(self, device: torch.device) -> None:
        """Hold the terms where the blocks are (a GPU's blocks are reduced there, no copy back
        per block); :meth:`values` and :meth:`received` bring them to the CPU."""
        if self.recv.device != device:
            self.t = self.t.to(device)
            self.recv, self.recv_first = self.recv.to(device), self.recv_first.to(device)

    def _sink(self):
        """The CPU row loop's :class:`~.rowparts.Sink` for this attention, made at its first
        block: the terms become views of its arrays, so the loop writes each row's terms to their
        place and a block summed another way (sorted: a negative weight) writes there too. Until
        :meth:`_settled`, the causal audit (each row's largest weight after its query) and the
        previous-token template (the weight at ``d = −1``) wait in it."""
        from probe.analysis.focus.backends.rowloop.rowparts import Sink

        if self.sink is None:
            B, H, Q, _ = self.shape
            t = self.t
            names = tuple(t.hits) if t.hits is not None else ()
            s = self.sink = Sink(B, H, Q, LOCAL_WINDOW if self.self_attn else 0, names)
            t.ent, t.top, t.total, t.span = (s.term(n) for n in ("ent", "top", "total", "span"))
            t.arg, t.masks, t.first = s.args(), s.masks(), s.term("first")
            if self.self_attn:
                t.signed, t.dist, t.reach = (s.term(n) for n in ("signed", "dist", "reach"))
                t.diag = s.diag()
                t.beyond = {D: s.term(f"beyond_{D}") for D in BEYOND}
                if t.word is not None:
                    t.word = {n: s.term(n) for n in t.word}
                if t.tmpl is not None:
                    t.tmpl.update({n: s.pair(n) for n in names})
        return self.sink

    def _settled(self) -> None:
        """The sink's rows folded into what the blocks leave for the end (see :meth:`_sink`):
        the layer is not causal where a real query's largest weight after it is above 0, and the
        previous-token template is each real query's weight at ``d = −1``."""
        s = self.sink
        if s is None or self.t is None:
            return
        qreal = self._on(torch.device("cpu"))["qreal"][:, None]
        if self.causal and bool((s.term("after") * qreal).amax() > 0):
            self.causal = False
        if self.t.tmpl is not None:
            self.t.tmpl["prev"] = torch.where(qreal, self.t.diag[-1], 0)

    def sdpa_call(self, args: tuple, kwargs: dict) -> bool:
        """Fold in a whole SDPA call from its ``q`` and ``k`` where the fused kernel applies
        (:mod:`probe.analysis.focus.backends.triton_fused`: the weights are never written); False: hand the
        weights to :meth:`rows` instead."""
        from probe.analysis.focus.backends import triton_fused as fused

        return fused.read_call(self, args, kwargs)

    def reading(self):
        """The context of the block loop (``BlockConsumer``): torch single-threaded while the
        compiled row loop reads the blocks on the cores torch had (:func:`~.workers.cores`)."""
        from probe.analysis.focus.backends.rowloop import rowfused, workers

        return workers.cores() if rowfused.available() else contextlib.nullcontext()

    def fills(self, device: torch.device) -> bool:
        """Whether :meth:`rows` may be handed blocks not yet computed, with their ``fill``: on a
        CPU with the compiled row loop, each part of a block is computed on the thread that reads
        it (see :func:`~probe.analysis.focus.backends.rowloop.rowfused.row_terms`)."""
        from probe.analysis.focus.backends.rowloop import rowfused

        return torch.device(device).type == "cpu" and rowfused.available()

    def rows(self, q0: int, q1: int, blk: torch.Tensor, fill: Any = None) -> None:
        """Fold in the weights ``blk`` ``[B, H, q1 - q0, kend]`` of query rows ``q0:q1``;
        ``fill(bh, a, b)``: ``blk`` is computed part by part by the row loop (:meth:`fills`)."""
        B, H, r, kend = blk.shape
        self._to(blk.device)
        dev, ws = self._on(blk.device), self.ws
        P = blk.float()
        trim = bool(getattr(fill, "causal", False))  # is_causal: each row read to its query only
        if fill is not None:  # the row loop computes each part's scores, its softmax, zeroes padding
            fill = functools.partial(fill, softmax=False)
        elif self.lay.any_pad:  # weight on padding keys is not attention to the text
            buf = ws.get("pad", tuple(P.shape), P.dtype, P.device)
            P = torch.mul(P, dev["real"][:, None, None, :kend], out=buf)
        t, sl = self.t, slice(q0, q1)
        # on a GPU one kernel pass gives every per-row term (no prefix sums, no sort, no wait)
        if self.gpu.take(P, sl):
            t.masks[:, :, sl] = torch.einsum("bhrk,bck->bhrc", P, dev["cols"][..., :kend])
            self._columns(P, q0, q1)
            if self.self_attn and t.tmpl is not None:
                self._pairs(P, sl)
            return
        rows = torch.arange(q0, q1, device=blk.device)
        # on a CPU a compiled loop reads each row once for every per-row term (numba, if installed),
        # each row's terms written to their place (the sink the terms view)
        got = self._cpu_terms(P, sl, fill, trim)
        if got is not None and self.sink is not None:
            self._columns(P, q0, q1, got)
            if "pairs" in got:
                for n, (*_, hits) in got["pairs"].items():
                    t.hits[n][:, sl] = hits
            return
        if got is None:
            got = {"ent": rb.entropy(P, ws), "total": P.sum(-1)}
            got["top"], got["arg"], got["span"] = rb.sorted_terms(P, ws)
        for n in ("ent", "total", "top", "arg", "span"):
            getattr(t, n)[..., sl] = got[n]
        if "first" in got:  # the compiled loop: masks, first weight and the causal audit too
            t.masks[:, :, sl] = torch.stack([got["special"], got["punct"], got["content"]], -1)
            t.first[..., sl] = got["first"]
            lower = self._after(got["after"], sl)
        else:
            lower = self._lower(P, q0, q1, rows)
            t.masks[:, :, sl] = torch.einsum("bhrk,bck->bhrc", P, dev["cols"][..., :kend])
            first = dev["first"].clamp(max=kend - 1)[:, None, None, None].expand(B, H, r, 1)
            at_first = P.gather(-1, first)[..., 0]
            t.first[..., sl] = torch.where((dev["first"] < kend)[:, None, None], at_first, 0)
        self._columns(P, q0, q1, got)  # the compiled loop sums the columns as it reads
        if self.self_attn:
            self._self_rows(P, rows, sl, lower, got)

    def _columns(self, P: torch.Tensor, q0: int, q1: int, got: dict | None = None) -> None:
        """The column sums of rows ``q0:q1`` (the sink profile) and the first real query's row;
        ``got``: the row loop's terms, with its column sums (and, where it read a block that was
        never written, each text's first real query's row)."""
        kend = P.shape[-1]
        qreal = self._on(P.device)["qreal"]
        got = got or {}
        self.recv[..., :kend] += rb.received(P, qreal[:, q0:q1]) if "recv" not in got else got["recv"]
        for b, f in enumerate(self.qs.first.tolist()):
            if q0 <= f < q1:
                row = got["first_row"][b] if "first_row" in got else P[b, :, f - q0]
                self.recv_first[b, :, :kend] = row

    def recomputed(self) -> None:
        """The blocks that follow are probe's own softmax of the call's scores (never negative):
        the row kernel need not read a block back to look for a negative weight."""
        self.softmax = True

    def _cpu_terms(
        self, P: torch.Tensor, sl: slice, fill: Any = None, trim: bool = False
    ) -> dict[str, Any] | None:
        """The compiled row loop's terms of a CPU block (:mod:`~.backends.rowloop.rowfused`),
        or None without numba (then the block is sorted); ``fill``: see :meth:`rows` (it leaves
        scores, whose softmax the loop takes, weights on padding keys then zeroed); ``trim``: its
        call is ``is_causal`` (each part computes, and each row is read, to the query only)."""
        from probe.analysis.focus.backends.rowloop import rowfused, rowparts

        if P.device.type != "cpu" or not rowfused.available():
            return None
        dev, kend = self._on(P.device), P.shape[-1]
        if self.words and "word_bounds" not in dev:  # every row's, once
            dev["word_bounds"] = rowparts.word_bounds(dev["words"])
        words = dev["word_bounds"][:, sl] if self.words else None
        K = self.shape[3] if self.self_attn else None
        # the template pairs' sums too, each row read while it is in cache
        pairs = self._pair_keys(sl, kend, P.device) if self.self_attn and self.t.tmpl is not None else None
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
            kept=(LOCAL_WINDOW if self.self_attn else 0, self.qs.first) if fill is not None else None,
            trim=trim,
            into=sink,
        )
        if got is not None and pairs is not None:
            got["pairs"] = pairs  # their hits, for _pairs (not looked up a second time)
        return got

    def _after(self, after: torch.Tensor, sl: slice) -> bool:
        """:meth:`_lower` from each row's largest weight after its query (real queries only)."""
        if self.causal and bool((after * self._on(after.device)["qreal"][:, None, sl]).amax() > 0):
            self.causal = False
        return bool(self.causal)

    def _lower(self, P: torch.Tensor, q0: int, q1: int, rows: torch.Tensor) -> bool:
        """Whether no real query of this block puts weight on a key after it (only keys after
        ``q0`` can be); a layer stays causal while every block is."""
        if not self.causal:
            return False
        kend = P.shape[-1]
        if kend <= q0 + 1:
            return True
        keys = torch.arange(q0 + 1, kend, device=P.device)
        dev = self._on(P.device)
        above = (keys[None, :] > rows[:, None]) & dev["qreal"][:, q0:q1, None]
        above = above & dev["real"][:, None, q0 + 1 : kend]
        sub = P[..., q0 + 1 :]
        hit = torch.mul(sub, above[:, None], out=self.ws.get("tmp", tuple(sub.shape), P.dtype, P.device))
        if bool(hit.amax() != 0):  # weights are non-negative: a positive maximum is one after the query
            self.causal = False
        return self.causal

    def _self_rows(self, P: torch.Tensor, rows: torch.Tensor, sl: slice, lower: bool, got: dict) -> None:
        t, kend, q0 = self.t, P.shape[-1], sl.start
        # the row loop's, where it read a block that was never written
        diag = got["diag"] if "diag" in got else rb.diagonals(P, rows, LOCAL_WINDOW)
        for d, v in diag.items():
            t.diag[d][..., sl] = v
        words_done = "word_prev" in got
        C = (
            rb.prefix_sums(P, self.ws)
            if "reach" not in got or (t.word is not None and not words_done)
            else None
        )
        if "reach" in got:  # the row kernel summed them (float64, no cancellation)
            t.signed[..., sl], t.dist[..., sl] = got["signed"], got["dist"]
            beyond, reach = {D: got[f"beyond_{D}"] for D in BEYOND}, got["reach"]
        else:
            # Σ (j − i)·a as Σ (j − q0)·a − (i − q0)·Σ a: no term grows with the position i
            shifted = P @ (self._on(P.device)["kf"][:kend] - q0)
            signed = shifted - (rows - q0).to(P.dtype) * t.total[..., sl]
            t.signed[..., sl] = signed
            # a block with no weight after the query: Σ a_ij |i − j| = −Σ a_ij (j − i)
            t.dist[..., sl] = -signed if lower else rb.abs_distance(P, rows, self.ws)
            beyond, reach = rb.distance_terms(C, rows, self.shape[3])
        for D, v in beyond.items():
            if D not in t.beyond:
                t.beyond[D] = torch.zeros_like(t.ent)
            t.beyond[D][..., sl] = v
        if t.reach is None:
            t.reach = torch.zeros_like(t.ent)
        t.reach[..., sl] = reach
        if t.word is not None and words_done:
            for n in t.word:
                t.word[n][..., sl] = got[n]
        elif t.word is not None:
            at = {n: (s[:, sl], e[:, sl]) for n, (s, e) in self._on(P.device)["words"].items()}
            for n, m in word_masses(C, self.lay, rows, at).items():
                t.word[n][..., sl] = m
        if t.tmpl is not None:
            real_q = self._on(P.device)["qreal"][:, None, sl]
            t.tmpl["prev"][..., sl] = torch.where(real_q, t.diag[-1][..., sl], 0)
            self._pairs(P, sl, got)

    def _pair_keys(self, sl: slice, kend: int, device: torch.device) -> dict[str, tuple[torch.Tensor, ...]]:
        """The duplicate-token and induction pairs ``{name: (b, i, j, hits)}`` of rows ``sl``."""
        return self.ws.pairs(self.qs, self.ks, sl.start, sl.stop, kend, device)

    def _pairs(self, P: torch.Tensor, sl: slice, got: dict | None = None) -> None:
        """The duplicate-token and induction sums of rows ``sl`` (templates of the token ids):
        the row loop's where ``got`` has its ``pairs``, else gathered from ``P``."""
        t = self.t
        if got and "pairs" in got:
            for n, (*_, hits) in got["pairs"].items():
                t.tmpl[n][..., sl], t.hits[n][:, sl] = got[n], hits
            return
        for n, (b, i, j, hits) in self._pair_keys(sl, P.shape[-1], P.device).items():
            t.tmpl[n][..., sl] = rb.pair_sums(P, b, i, j)
            t.hits[n][:, sl] = hits

    def close(self) -> bool | None:
        """Whether this self-attention was causal (None for cross-attention). On the CPU the
        terms are reduced here and dropped: a forward then holds one attention's ``O(B·H·T)``
        terms at a time, not every layer's (at T = 16,384 about 25 MiB an attention). A GPU's
        stay on the device until :meth:`values` (reducing there would wait for the device)."""
        self.gpu.settle()
        self._settled()
        if self._done is None and self.recv.device.type == "cpu":
            with one_thread():
                self._done = (self._values(), self._received())
            self.t = self.recv = self.recv_first = self.sink = None
        return bool(self.causal) if self.self_attn else None

    def layout(self) -> Layout:
        self.gpu.settle()
        self._settled()
        _, _, Q, K = self.shape
        return Layout(self.qs, self.ks, Q, K, causal=True) if self.causal else self.lay

    def values(self) -> torch.Tensor:
        """Every metric per text and head, ``[B, H, M]``."""
        return self._values() if self._done is None else self._done[0]

    def received(self) -> torch.Tensor:
        """The sink profile ``[B, H, K]`` (float64): each key's mean weight over the counted
        queries (the first real query of a causal layer is not counted)."""
        return self._received() if self._done is None else self._done[1]

    def _values(self) -> torch.Tensor:
        lay = self.layout()  # first: it spreads a GPU's kernel table into the terms
        return reduce(self.t.to("cpu"), lay, self_attn=self.self_attn)

    def _received(self) -> torch.Tensor:
        lay = self.layout()
        recv, first = self.recv.cpu(), self.recv_first.cpu()
        s = recv - first if self.causal else recv
        n = lay.counted[:, 0].sum(-1).double()[:, None, None]
        return torch.where(n > 0, s / n.clamp(min=1), float("nan"))


__all__ = [
    "RowTerms",
    "one_thread",
    "streamed_not_computed",
    "ROLLOUT_NOTE",
]
