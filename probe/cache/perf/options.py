"""The one switchboard of probe's performance machinery (:data:`OPTIONS`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any


def _user_tuned(env: Any = os.environ) -> bool:
    """Whether the user told glibc when to trim (``MALLOC_TRIM_THRESHOLD_`` or its tunable).

    Then probe leaves trimming to glibc: ``malloc_trim`` would override that choice (e.g. the
    no-page-fault setting ``MALLOC_TRIM_THRESHOLD_=1000000000000`` that keeps freed memory).
    """
    return "MALLOC_TRIM_THRESHOLD_" in env or "glibc.malloc.trim_threshold" in env.get("GLIBC_TUNABLES", "")


@dataclass
class Options:
    """Which parts of the performance machinery are on. None of them changes a stored value.

    * ``direct_io``: write streamed caches with ``O_DIRECT`` where the file system has it
      (:mod:`probe.cache.perf.direct`); False: always through the page cache.
    * ``io_thread``: write streamed tensors on a background thread while the model computes
      (:mod:`probe.cache.perf.iothread`); False: in the capture's own thread, as they are put.
    * ``sync_every``: bytes the I/O thread writes through the page cache between two flushes to
      disk (the final fsync then has less left to do).
    * ``heap_trim``: hand freed heap memory back to the system when a capture's tensors are let
      go (:mod:`probe.cache.perf.heap`); False keeps it in the process, so RSS stays at its
      high-water mark and the next capture reuses those pages without faulting them in again.
      Off by default when the user set glibc's own trim threshold.
    * ``planned_capture``: let :func:`probe.capture` learn a plan for repeated captures of one
      model on one kind of input and run later captures with the plan's hooks only
      (:mod:`probe.capture.engine.planned`); False: every capture runs the full tracer.
    * ``pool_bytes`` and ``pool_seconds``: how much of a dropped planned capture's mapped memory
      is kept for the next capture (:mod:`probe.cache.perf.pool`), and for how long without
      use; ``pool_seconds=0`` keeps none (each mapping is unmapped when its tensors are freed).
    """

    direct_io: bool = True
    io_thread: bool = True
    sync_every: int = 64 << 20
    heap_trim: bool = field(default_factory=lambda: not _user_tuned())
    planned_capture: bool = True
    pool_bytes: int = 2 << 30
    pool_seconds: float = 10.0


OPTIONS = Options()


@contextmanager
def using(**changes: Any) -> Iterator[Options]:
    """``with using(direct_io=False): ...`` changes :data:`OPTIONS` for the block, then restores them."""
    known = {f.name for f in fields(Options)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise TypeError(f"unknown performance option {unknown[0]!r}; known: {sorted(known)}")
    saved = {k: getattr(OPTIONS, k) for k in changes}
    for k, v in changes.items():
        setattr(OPTIONS, k, v)
    try:
        yield OPTIONS
    finally:
        for k, v in saved.items():
            setattr(OPTIONS, k, v)
