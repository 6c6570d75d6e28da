"""Which backends compute an attention's per-row terms, and in which order: :func:`backends_for`.

Every module of :mod:`probe.analysis.focus.backends` that defines ``BACKEND`` (a
:class:`~.base.RowTermsBackend` subclass) is one; a new backend is a new file there. They are asked
from the lowest ``order`` up, each block by each until one takes it (the choice made block by
block, where each can decline: another device, a negative weight, rows too long):

====  ==============================  ==================================================================
order backend                         takes
====  ==============================  ==================================================================
10    ``triton-fused``                a whole SDPA call from its q and k (CUDA, ``PROBE_FUSED=1``)
20    ``triton-rows``                 a CUDA block, one Triton program per row (rows up to 32,768 keys)
30    ``numba-rows``                  a CPU block, the compiled row loop (numba: the ``fast`` extra)
90    ``reference``                   any block, in torch (the sort of each row)
====  ==============================  ==================================================================
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from pathlib import Path
from typing import Any

from probe.analysis.focus.backends.base import RowTermsBackend

PACKAGE = "probe.analysis.focus.backends"


@functools.cache
def registered() -> tuple[type[RowTermsBackend], ...]:
    """Every backend class of the package, in order (its modules imported once, on first use)."""
    found = []
    for m in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if m.ispkg:
            continue
        backend = getattr(importlib.import_module(f"{PACKAGE}.{m.name}"), "BACKEND", None)
        if backend is not None:
            found.append(backend)
    return tuple(sorted(found, key=lambda b: b.order))


def backends_for(reader: Any) -> tuple[RowTermsBackend, ...]:
    """One instance of each backend available here for the attention ``reader``, in order."""
    return tuple(b(reader) for b in registered() if b.available())


__all__ = ["backends_for", "registered"]
