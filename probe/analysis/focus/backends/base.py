"""The one interface of the per-row terms of a block: :class:`RowTermsBackend`.

A streamed attention (:class:`~probe.analysis.focus.streamed.reader.RowTerms`, the *reader*) is
handed its weights a block of query rows at a time, ``P`` ``[B, H, rows, keys]``, and keeps one
:class:`~probe.analysis.focus.definitions.terms.Terms` per attention. A backend is one way of
turning a block into those terms: it writes every per-row term of the block's rows (``reader.t``,
rows ``q0:q1``), their column sums (the sink profile, :func:`~.reference.columns`) and the causal
audit (``reader.causal = False`` where a real query puts weight after itself). The registry
(:mod:`~.registry`) asks the backends in their ``order``; the first whose :meth:`terms` returns
True has done the block, and one that returns False (not on its device, a negative weight, a row
too long for it) leaves it to the next. The torch reference takes every block.

What a backend may use of the reader: ``shape`` ``(B, H, Q, K)``, ``self_attn``, ``qs``/``ks``
(:class:`~probe.analysis.focus.definitions.tokens.Side`), ``lay``
(:class:`~probe.analysis.focus.definitions.layout.Layout`), ``words`` (word masses asked for),
``ws`` (:class:`~.workspace.Workspace`), ``softmax`` (the blocks are probe's own softmax: no
negative weight), ``t``, ``recv``/``recv_first`` (the column sums and the first real query's row)
and ``causal``; ``facts(device)`` (the key-side facts on a device), ``hold_on(device)`` (the terms
moved where the blocks are) and ``pair_keys(rows, kend, device)`` (the template pairs of rows).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch


@functools.cache
def installed(module: str) -> bool:
    """Whether ``module`` is installed: looked up, not imported (a CPU run never imports Triton)."""
    return importlib.util.find_spec(module) is not None


class RowTermsBackend(ABC):
    """One way of computing the per-row terms of an attention's blocks; one instance per
    attention (``reader``), so a backend keeps what it carries from block to block on itself."""

    name: ClassVar[str]  # what the docs and errors call it
    order: ClassVar[int]  # the registry asks the backends from the lowest order up

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    @classmethod
    @abstractmethod
    def available(cls) -> bool:
        """Whether this backend can run in this install (its compiler is there); cheap, and
        importing nothing heavy where it is not."""

    @abstractmethod
    def terms(self, q0: int, q1: int, P: torch.Tensor, fill: Any = None, trim: bool = False) -> bool:
        """Fold in the block ``P`` ``[B, H, q1 - q0, kend]`` of query rows ``q0:q1`` (keys past
        ``kend`` are zero); False: not done here, the next backend is asked. ``fill``: the block
        was never computed (only where :meth:`fills` said so), ``fill(bh, a, b, out=...)`` computes
        each part of it; ``trim``: each row need only be read to its query (an ``is_causal`` call)."""

    def call(self, args: tuple, kwargs: dict) -> bool:
        """Fold in a whole SDPA call from its arguments (``q``, ``k``, the mask, the scale), the
        weights never computed; False (the default): the blocks come one by one instead."""
        return False

    def fills(self, device: torch.device) -> bool:
        """Whether the blocks on ``device`` may come uncomputed, with a ``fill`` (see :meth:`terms`)."""
        return False

    def reading(self) -> contextlib.AbstractContextManager:
        """The context around the attention's block loop (the compiled CPU loop's threads)."""
        return contextlib.nullcontext()

    def settle(self) -> None:
        """The blocks are done (or the terms are about to be read): bring what this backend holds
        back for the end into the reader's terms; called again before each read."""
        return None


__all__ = ["RowTermsBackend", "installed"]
