"""Where a capture's tensors go: converted to ``dtype=``, handed to the sink, memory reused.

The :class:`Store` is the only part that talks to the sink (:mod:`probe.cache.writer`). It
converts what it is given to the capture's storage dtype, tells the sink whether a tensor is
probe's own memory (a recomputed pattern, a converted copy) or the model's, and records the
dtypes stored. For a streamed capture it lends two pattern buffers used in turn (the I/O thread
writes one while the next layer fills the other), which saves allocating and page-faulting a
fresh one every layer; they are let go after a list's last layer, so what runs next (a final
norm, an LM head and its logits) does not run beside them. A capture kept in memory trims the
C heap there instead (:mod:`probe.cache.perf.heap`). :func:`parse_dtype` reads ``dtype=`` for it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from probe.cache.perf import heap
from probe.cache.writer import MemorySink
from probe.errors import ProbeError

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(dtype: Any) -> torch.dtype | None:
    """``dtype=`` as a torch float dtype (None: as computed); a one-line ProbeError otherwise."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ProbeError(f"dtype {dtype!r} is not supported; use float32, float16 or bfloat16")


class Store:
    """Hands tensors to ``sink`` (a :class:`~probe.cache.writer.MemorySink` or ``FileSink``),
    floats converted to ``dtype`` (None: as they are)."""

    def __init__(self, sink: Any, dtype: torch.dtype | None) -> None:
        self.sink = sink
        self.dtype = dtype
        self.empty = sink.empty  # how the sink wants fresh pattern memory allocated (None: torch.empty)
        self.dtypes: set[str] = set()  # the float dtypes stored, as "float32" (indices are integers)
        self._reuse = not isinstance(sink, MemorySink)
        self._buffers: list[Tensor | None] = [None, None]
        self._clean = [False, False]  # last filled by a causal call: zeros above the diagonal stay
        self._turn = 0
        self._busy = False  # this turn's buffer holds a pattern not yet stored

    def put(self, t: Tensor, owned: bool = False) -> int:
        """Hand ``t`` to the sink (converted to ``dtype``; a converted copy is probe's own memory);
        returns the sink's handle for naming it when the capture ends."""
        stored = self._convert(t)
        if not owned and stored.device == t.device and not stored.is_nested and not t.is_nested:
            owned = stored.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        return self.sink.put(stored, owned=owned)

    def _convert(self, t: Tensor) -> Tensor:
        t = t.detach()
        if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
            t = t.to(self.dtype)
        if t.is_floating_point():  # the metadata's dtype: how the weights and residuals are stored
            self.dtypes.add(str(t.dtype).replace("torch.", ""))
        return t

    # -- the two pattern buffers of a streamed capture -----------------------------------------
    def buffer(self) -> tuple[Tensor | None, bool]:
        """A buffer the next recomputed pattern may be written into (or None), and whether it is
        clean (last filled by a causal call of its shape: its unseen keys are zeros already)."""
        if not self._reuse or self._busy:
            return None, False
        buf = self._buffers[self._turn]
        if buf is not None:
            self.sink.wait_written(buf)  # its previous pattern may still be on its way to disk
        return buf, buf is not None and self._clean[self._turn]

    def filled(self, pattern: Tensor, causal: bool) -> None:
        """``pattern`` was just recomputed (into :meth:`buffer`'s buffer or fresh memory): it is
        this turn's buffer from now on; ``causal``: written by a causal call (stays clean)."""
        if self._reuse and not self._busy:
            self._buffers[self._turn], self._busy = pattern, True
            # same shape next time: the recompute writes the same causal region, the rest stays 0
            self._clean[self._turn] = causal

    def stored(self, parts: list[Tensor]) -> None:
        """A pattern made of ``parts`` went to the sink: if this turn's buffer was one of them, the
        next pattern takes the other buffer."""
        if self._busy and any(p is self._buffers[self._turn] for p in parts):
            self._busy = False
            self._turn ^= 1

    # -- the end of a list of layers -----------------------------------------------------------
    def let_go(self) -> None:
        """Drop the pattern buffers (the I/O thread frees each once written)."""
        self._buffers, self._clean = [None, None], [False, False]

    def trim(self) -> None:
        """In memory: hand the heap's free pages back if the stored tensors left holes worth it."""
        if not self._reuse:
            # Kept in memory, each layer's residuals stay in the C heap while the model's
            # temporaries come and go around them: the holes left are free but resident. Handed
            # back now, they do not add to what runs next (an LM head's logits are the plain
            # forward's own peak). Short inputs keep too little to be worth the trim.
            heap.trim_if_held(self.sink.held())
