"""Mapped memory that one capture's dropped cache hands on to the next capture.

A planned capture (:mod:`probe.capture.engine.planned`) writes its patterns and its copies of the
residual stream into memory mapped from the system, one mapping per pattern and per layer. A
fresh mapping costs the kernel's zero-filling of each page before probe writes it: at 512 tokens
on SmolLM2 (283 MB of patterns) about a quarter of the patterns' cost. So when the last tensor
of a mapping is freed (its cache dropped), the mapping comes back here, and the next capture that
asks for about that many bytes takes it, already resident.

Like an allocator's freed memory, what is kept is bounded: at most ``OPTIONS.pool_bytes`` in
all, each mapping for at most ``OPTIONS.pool_seconds`` without being taken again (10 s, as
jemalloc's default decay of freed memory; then a background timer unmaps it).
:func:`release` unmaps everything kept at once. (Marking kept mappings ``MADV_FREE``, so the
kernel could reclaim them under pressure, made writing them again two to three times slower
here: they are not marked.) Memory taken again is not zeroed: :func:`take` says which it gives.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from probe.cache.perf.options import OPTIONS

HUGE = 2 << 20  # a transparent huge page on x86-64 and arm64 Linux
ALIGN = 64  # each tensor a caller carves out of a mapping starts on a cache line


@dataclass
class _Kept:
    mm: mmap.mmap
    size: int
    since: float  # time.monotonic() when it came back


_LOCK = threading.RLock()  # reentrant: a tensor freed while the lock is held gives its mapping back
_kept: list[_Kept] = []  # changed only through _push, _pop and _drop (which keep _total in step)
_total = 0  # bytes in _kept
_lent: dict[int, int] = {}  # address -> bytes, of the mappings whose tensors are alive
_timer: threading.Timer | None = None


def available() -> bool:
    """Whether this system maps anonymous memory (else :func:`take` raises OSError)."""
    return hasattr(mmap, "MAP_ANONYMOUS")


def take(nbytes: int, kept_only: bool = False) -> tuple[torch.Tensor, bool] | None:
    """A flat ``uint8`` CPU tensor of ``nbytes`` in a mapping of its own, and whether its memory
    is zero-filled (a fresh mapping) or not (a kept one, with whatever its last user wrote);
    ``kept_only``: None where no kept mapping fits (none is mapped).

    The mapping comes back to the pool when the last tensor viewing it is freed. Raises OSError
    where the system cannot map memory (no ``mmap``, out of mappings or address space)."""
    if not available():
        raise OSError("no anonymous memory mappings on this system")
    nbytes = max(int(nbytes), 1)
    mm = _reuse(nbytes)
    if mm is None and kept_only:
        return None
    zeroed = mm is None
    if mm is None:
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if nbytes >= HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):  # no transparent huge pages here: 4 KiB pages
                mm.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(mm)
    with warnings.catch_warnings():  # torch notes that the buffer is writable: it is meant to be
        warnings.simplefilter("ignore")
        t = torch.frombuffer(view, dtype=torch.uint8, count=nbytes)
    address = t.data_ptr()
    with _LOCK:
        _lent[address] = len(mm)
    # the tensor's storage holds the memoryview; when the last view of it is freed, so is the
    # memoryview, and the mapping (held by the finaliser, not by the view) comes back
    weakref.finalize(view, _give, address, mm).atexit = False  # at exit there is no next capture
    return t, zeroed


def lends(address: int) -> bool:
    """Whether ``address`` starts a mapping of the pool that a live tensor holds."""
    with _LOCK:
        return address in _lent


def kept_bytes() -> int:
    """Bytes of mappings the pool keeps for the next capture."""
    with _LOCK:
        return _total


def release() -> int:
    """Unmap every mapping the pool keeps now; returns how many bytes that gave back."""
    global _timer
    with _LOCK:
        gone = _drop(lambda k: True)
        if _timer is not None:
            _timer.cancel()
            _timer = None
    for k in gone:
        _close(k.mm)
    return sum(k.size for k in gone)


def purge(now: float | None = None) -> int:
    """Unmap the kept mappings that waited ``OPTIONS.pool_seconds`` or longer (at ``now``, a
    ``time.monotonic()`` value); returns how many are still kept."""
    now = time.monotonic() if now is None else now
    with _LOCK:
        old = _drop(lambda k: now - k.since >= OPTIONS.pool_seconds)
        left = len(_kept)
    for k in old:
        _close(k.mm)
    return left


# -- inside ------------------------------------------------------------------------------------
def _push(mm: mmap.mmap) -> None:
    global _total
    _kept.append(_Kept(mm, len(mm), time.monotonic()))
    _total += len(mm)


def _pop(i: int) -> mmap.mmap:
    global _total
    k = _kept.pop(i)
    _total -= k.size
    return k.mm


def _drop(which: Any) -> list[_Kept]:
    """Take the kept mappings ``which(k)`` selects out of the pool (under ``_LOCK``)."""
    global _total
    gone = [k for k in _kept if which(k)]
    _kept[:] = [k for k in _kept if not which(k)]
    _total -= sum(k.size for k in gone)
    return gone


def _reuse(nbytes: int) -> mmap.mmap | None:
    """The last kept mapping of exactly ``nbytes`` (a capture like the last asks for the same
    sizes), else the smallest of ``nbytes`` to ``nbytes`` plus a quarter (or a huge page)."""
    most = nbytes + max(nbytes // 4, HUGE)
    with _LOCK:
        for i in range(len(_kept) - 1, -1, -1):
            if _kept[i].size == nbytes:
                return _pop(i)
        fits = [(k.size, i) for i, k in enumerate(_kept) if nbytes <= k.size <= most]
        return _pop(min(fits)[1]) if fits else None


def _give(address: int, mm: mmap.mmap) -> None:
    """The last tensor of a lent mapping was freed: keep the mapping, or unmap it."""
    try:
        with _LOCK:
            _lent.pop(address, None)
            room = OPTIONS.pool_bytes - _total
            keep = OPTIONS.pool_seconds > 0 and len(mm) <= room
            if keep:
                _push(mm)
                _schedule()
        if not keep:
            _close(mm)
    except Exception:  # interpreter shutdown: modules may already be gone
        pass


def _schedule() -> None:
    """Start the timer that unmaps what waited too long (under ``_LOCK``)."""
    global _timer
    if _timer is not None or not _kept:
        return
    wait = max(0.0, min(k.since for k in _kept) + OPTIONS.pool_seconds - time.monotonic())
    _timer = threading.Timer(wait + 0.01, _on_timer)
    _timer.daemon = True  # never keeps the interpreter from exiting
    _timer.start()


def _on_timer() -> None:
    global _timer
    try:
        purge()
        with _LOCK:
            _timer = None
            _schedule()
    except Exception:  # interpreter shutdown: modules may already be gone
        pass


def _after_fork() -> None:
    """In a forked child: no timer thread came along, and the lock may have been held by one."""
    global _LOCK, _timer
    _LOCK, _timer = threading.RLock(), None


def _close(mm: mmap.mmap) -> None:
    with contextlib.suppress(BufferError, ValueError):  # still viewed (cannot be) or already closed
        mm.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


__all__ = ["ALIGN", "available", "kept_bytes", "lends", "purge", "release", "take"]
