"""A circuit task: the model wired as a graph, clean and corrupted inputs in chunks, and the metric.

Everything that runs the model for a circuit (:mod:`~probe.intervene.circuit.attribute`,
:mod:`~probe.intervene.circuit.evaluate`, :mod:`~probe.intervene.circuit.paths`) goes through a
:class:`Task`: it prepares each chunk of the batch once (clean and corrupted side by side, checked
to have the same positions), runs a forward with a :class:`~probe.intervene.circuit.wiring.Run`'s
hooks, and turns the logits into the metric's per-example values. The metric of the whole batch
is the mean over all examples, so a chunk contributes ``sum(rows) / n``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from probe.errors import ProbeError
from probe.forward import outputs_of
from probe.intervene.circuit.inputs import Chunk, Examples, check_pair, chunks, run_chunk
from probe.intervene.circuit.metrics import CircuitMetric, at_last, last_positions
from probe.intervene.circuit.wiring import Run, Wiring, run_forward


@dataclass
class Task:
    """See the module docstring. ``batch_size``: examples per chunk (memory grows with it)."""

    model: nn.Module
    wiring: Wiring
    clean: Examples
    corrupt: Examples
    metric: CircuitMetric
    options: dict = field(default_factory=dict)
    batch_size: int = 16
    _pairs: list[tuple[Chunk, Chunk]] | None = None
    _clean_logp: dict[int, Tensor] = field(default_factory=dict)
    _refs: dict[str, float] = field(default_factory=dict)
    _corrupted: dict[int, Run] = field(default_factory=dict)
    keep_bytes: int = 512 * 2**20  # the corrupted runs' node outputs kept between calls, at most

    @property
    def n(self) -> int:
        return self.clean.n

    def pairs(self) -> list[tuple[Chunk, Chunk]]:
        """The (clean, corrupted) chunks, prepared once and checked position by position."""
        if self._pairs is None:
            out = []
            for idx in chunks(self.n, self.batch_size):
                a = run_chunk(self.model, self.clean, idx, self.options)
                b = run_chunk(self.model, self.corrupt, idx, self.options)
                check_pair(a, b, self.clean.n, self.corrupt.n)
                out.append((a, b))
            self._pairs = out
        return self._pairs

    def chunk_of(self, examples: list[int], which: str = "clean") -> Chunk:
        """A chunk of any examples (repeats allowed), clean or corrupted."""
        ex = self.clean if which == "clean" else self.corrupt
        return run_chunk(self.model, ex, examples, self.options)

    def forward(self, run: Run, chunk: Chunk) -> Tensor:
        """The logits of ``chunk`` under ``run``'s hooks."""
        return outputs_of(run_forward(run, chunk.run))

    def last(self, logits: Tensor, chunk: Chunk) -> Tensor:
        return last_positions(chunk.mask, logits.shape[1] if logits.dim() > 2 else 1, logits.shape[0])

    def rows(self, logits: Tensor, chunk: Chunk, ci: int, repeat: int = 1) -> Tensor:
        """The metric's per-example values of a chunk's logits (``repeat`` copies of chunk ``ci``'s
        examples one after the other, as the patching runs use)."""
        clean = self._clean_logp.get(ci)
        if self.metric.needs_clean and clean is None:
            raise ProbeError("internal: the clean run of this chunk was not recorded before the KL metric")
        if clean is not None and repeat > 1:
            clean = clean.repeat(repeat, 1)
        return self.metric.rows(logits, self.last(logits, chunk), chunk.examples, clean)

    def keep_clean(self, ci: int, logits: Tensor, chunk: Chunk) -> None:
        """Remember the clean log-probabilities of chunk ``ci`` (for KL)."""
        self._clean_logp[ci] = at_last(logits.detach(), self.last(logits, chunk)).float().log_softmax(-1)

    def ensure_clean(self, ci: int) -> None:
        """Record chunk ``ci``'s clean log-probabilities if the metric needs them and they are not kept."""
        if self.metric.needs_clean and ci not in self._clean_logp:
            self.record(self.pairs()[ci][0], ci=ci)

    def record(self, chunk: Chunk, *, ci: int | None = None) -> tuple[Run, Tensor]:
        """A plain forward recording every node's output: ``(run, logits)``."""
        run = Run(self.wiring)
        logits = self.forward(run, chunk)
        if ci is not None and ci not in self._clean_logp:
            self.keep_clean(ci, logits, chunk)
        return run, logits

    def corrupted(self, ci: int) -> Run:
        """The recorded corrupted run of chunk ``ci`` (kept for the next call while the kept runs'
        node outputs stay within :attr:`keep_bytes`)."""
        if ci in self._corrupted:
            return self._corrupted[ci]
        run, _ = self.record(self.pairs()[ci][1])
        size = sum(v.numel() * v.element_size() for _, v in run.values)
        held = sum(v.numel() * v.element_size() for r in self._corrupted.values() for _, v in r.values)
        if held + size <= self.keep_bytes:
            self._corrupted[ci] = run
        return run

    def forget(self) -> None:
        """Drop the kept corrupted runs and clean log-probabilities (the next call recomputes them)."""
        self._corrupted.clear()
        self._clean_logp.clear()

    def references(self) -> dict[str, float]:
        """The metric on the clean and on the corrupted inputs (whole batch), computed once."""
        if not self._refs:
            tot = {"clean": 0.0, "corrupted": 0.0}
            for ci, (a, b) in enumerate(self.pairs()):
                _, la = self.record(a, ci=ci)
                _, lb = self.record(b)
                tot["clean"] += float(self.rows(la, a, ci).sum())
                tot["corrupted"] += float(self.rows(lb, b, ci).sum())
            self._refs = {k: v / self.n for k, v in tot.items()}
        return dict(self._refs)


def diffs(a: Run, b: Run) -> Tensor:
    """Every node's output in run ``a`` minus in run ``b``, ``[nodes, B, T, d]``."""
    if [s for s, _ in a.values] != [s for s, _ in b.values]:
        raise ProbeError("the clean and corrupted runs went through different parts of the model")
    return a.stacked() - b.stacked()


def real_positions(D: Tensor, chunk: Chunk) -> Tensor:
    """``D [k, B, T, d]`` with the padding positions set to 0 (in place)."""
    if chunk.mask is not None and tuple(chunk.mask.shape) == tuple(D.shape[1:3]):
        D.masked_fill_(~chunk.mask.to(D.device, torch.bool)[None, :, :, None], 0.0)
    return D


__all__ = ["Task", "diffs", "real_positions"]
