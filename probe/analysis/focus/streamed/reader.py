"""Focus statistics while the model runs: every metric from row blocks, no pattern ever whole.

``probe.head_stats(model, inputs)`` runs one forward through :func:`probe.forward.stream_attention`,
which hands each attention's weights a block of query rows at a time (recomputed SDPA weights, or
slices of a softmax the model computed) to a :class:`RowTerms` made here. It keeps the attention's
per-query :class:`~probe.analysis.focus.definitions.terms.Terms` and hands each block to the first
backend that takes it (:mod:`probe.analysis.focus.backends`: a fused kernel for a whole SDPA call,
the Triton row kernel on a GPU, the compiled row loop on a CPU, else torch), then drops it; when the
forward is done, :func:`~probe.analysis.focus.definitions.terms.reduce` turns the terms into the
metrics, exactly as for a captured cache (the run itself, a reader per attention and the table,
is :mod:`probe.analysis.focus.streamed.run`); on a CPU each attention's terms are reduced when it
closes. Peak memory is one block (``[batch, heads, rows, keys]``) plus O(batch · heads · T) of
terms (one attention's on a CPU, every layer's on a GPU), never a ``T × T`` pattern.

Whether a self-attention layer is causal (which decides the counted queries) is judged on every
block as it passes: no weight above the diagonal between real tokens. Attention rollout needs every
layer's whole pattern, so it is not computed on this path (``HeadStats.not_computed`` says so).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from probe.analysis.focus.backends.registry import backends_for
from probe.analysis.focus.backends.workspace import Workspace
from probe.analysis.focus.definitions.layout import Layout
from probe.analysis.focus.definitions.table import LOCAL_WINDOW
from probe.analysis.focus.definitions.terms import Terms, reduce, word_targets
from probe.analysis.focus.definitions.tokens import Side
from probe.errors import ProbeError


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
    query rows at a time (each block by the first of its backends that takes it); :meth:`close`
    says whether it was causal, :meth:`values` gives the metrics ``[B, H, M]``."""

    def __init__(
        self, qs: Side, ks: Side, shape: tuple[int, ...], *, self_attn: bool, ws: Workspace | None = None
    ) -> None:
        B, H, Q, K = shape
        self.shape, self.self_attn, self.qs, self.ks = shape, self_attn, qs, ks
        self.ws = ws if ws is not None else Workspace()  # scratch shared by one run's readers
        self.lay = Layout(qs, ks, Q, K, causal=False)
        self.causal = self_attn and Q == K and Q >= 2
        self.words = self_attn and self.lay.words_split
        self.ids = self_attn and qs.ids is not None and ks.ids is not None
        self.t = self._new_terms()
        self.recv = torch.zeros(B, H, K, dtype=torch.float64)  # Σ over real queries of a_ij
        self.recv_first = torch.zeros(B, H, K, dtype=torch.float64)  # the first real query's row
        self._dev: dict[str, dict[str, Any]] = {}
        self.softmax = False  # see recomputed()
        self._done: tuple[torch.Tensor, torch.Tensor] | None = None  # (values, received), see close()
        self.backends = backends_for(self)

    def _new_terms(self) -> Terms:
        B, H, Q, _ = self.shape

        def new():
            return torch.zeros(B, H, Q)

        t = Terms(
            new(), new(), torch.zeros(B, H, Q, dtype=torch.long), new(), new(), torch.zeros(B, H, Q, 3), new()
        )
        if self.self_attn:
            t.diag = {d: new() for d in range(-LOCAL_WINDOW, LOCAL_WINDOW + 1)}
            t.signed, t.dist = new(), new()
            t.word = {n: new() for n in ("word_prev", "word_self", "word_next")} if self.words else None
            if self.ids:
                t.tmpl = {n: new() for n in ("prev", "dup", "induction")}
                t.hits = {n: torch.zeros(B, Q, dtype=torch.bool) for n in ("dup", "induction")}
        return t

    # -- what the backends read and write ------------------------------------------------------
    def facts(self, device: torch.device) -> dict[str, Any]:
        """The key-side facts on ``device`` (copied once per device; a backend may add its own)."""
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

    def hold_on(self, device: torch.device) -> None:
        """Hold the terms where the blocks are (a GPU's blocks are reduced there, no copy back
        per block); :meth:`values` and :meth:`received` bring them to the CPU."""
        if self.recv.device != device:
            self.t = self.t.to(device)
            self.recv, self.recv_first = self.recv.to(device), self.recv_first.to(device)

    def pair_keys(self, sl: slice, kend: int, device: torch.device) -> dict[str, tuple[torch.Tensor, ...]]:
        """The duplicate-token and induction pairs ``{name: (b, i, j, hits)}`` of rows ``sl``."""
        return self.ws.pairs(self.qs, self.ks, sl.start, sl.stop, kend, device)

    # -- the block loop (capture's BlockConsumer) -----------------------------------------------
    def sdpa_call(self, args: tuple, kwargs: dict) -> bool:
        """Fold in a whole SDPA call from its ``q`` and ``k`` where a backend reads it whole (the
        fused kernel: the weights are never written); False: hand the weights to :meth:`rows`."""
        return any(b.call(args, kwargs) for b in self.backends)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """The context of the block loop (``BlockConsumer``): each backend's (the compiled row
        loop's: torch single-threaded while it reads the blocks on the cores torch had)."""
        with contextlib.ExitStack() as stack:
            for b in self.backends:
                stack.enter_context(b.reading())
            yield

    def fills(self, device: torch.device) -> bool:
        """Whether :meth:`rows` may be handed blocks not yet computed, with their ``fill``: on a
        CPU with the compiled row loop, each part of a block is computed on the thread that reads
        it (see :func:`~probe.analysis.focus.backends.rowloop.rowfused.row_terms`)."""
        return any(b.fills(device) for b in self.backends)

    def recomputed(self) -> None:
        """The blocks that follow are probe's own softmax of the call's scores (never negative):
        the row kernel need not read a block back to look for a negative weight."""
        self.softmax = True

    def rows(self, q0: int, q1: int, blk: torch.Tensor, fill: Any = None) -> None:
        """Fold in the weights ``blk`` ``[B, H, q1 - q0, kend]`` of query rows ``q0:q1``;
        ``fill(bh, a, b)``: ``blk`` is computed part by part by the row loop (:meth:`fills`)."""
        kend = blk.shape[-1]
        self.hold_on(blk.device)
        P = blk.float()
        trim = bool(getattr(fill, "causal", False))  # is_causal: each row read to its query only
        if fill is not None:  # the row loop computes each part's scores, its softmax, zeroes padding
            fill = functools.partial(fill, softmax=False)
        elif self.lay.any_pad:  # weight on padding keys is not attention to the text
            buf = self.ws.get("pad", tuple(P.shape), P.dtype, P.device)
            P = torch.mul(P, self.facts(blk.device)["real"][:, None, None, :kend], out=buf)
        for b in self.backends:
            if b.terms(q0, q1, P, fill, trim):
                return
        raise ProbeError(f"internal: no backend took rows {q0}:{q1} ({[b.name for b in self.backends]})")

    def close(self) -> bool | None:
        """Whether this self-attention was causal (None for cross-attention). On the CPU the
        terms are reduced here and dropped: a forward then holds one attention's ``O(B·H·T)``
        terms at a time, not every layer's (at T = 16,384 about 25 MiB an attention). A GPU's
        stay on the device until :meth:`values` (reducing there would wait for the device)."""
        self._settle()
        if self._done is None and self.recv.device.type == "cpu":
            with one_thread():
                self._done = (self._values(), self._received())
            self.t = self.recv = self.recv_first = None
            self.backends = ()  # and what they held (the row loop's sink, which the terms viewed)
        return bool(self.causal) if self.self_attn else None

    # -- the result ----------------------------------------------------------------------------
    def _settle(self) -> None:
        for b in self.backends:
            b.settle()

    def layout(self) -> Layout:
        self._settle()
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


__all__ = ["RowTerms", "one_thread"]
