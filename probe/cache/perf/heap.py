"""Handing freed heap memory back to the system once a capture's tensors are dropped.

glibc serves tensors under its mmap threshold (which it raises up to 32 MiB as large blocks are
freed) from its heap, and returns freed heap memory to the system only from the heap's top. A
capture keeps every layer's residual tensors (a few MiB each, the model's own) while the
model's temporaries come and go around them, so when the cache is dropped its residuals and the
holes between them are free but stay resident. ``malloc_trim(0)`` releases free pages anywhere
in the heap; it costs about as much as the kernel's work of unmapping them, and next to nothing
when little is free. Only on glibc; elsewhere :func:`trim` does nothing. Switched by
``OPTIONS.heap_trim`` (:mod:`probe.cache.perf.options`).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from probe.cache.perf import pool
from probe.cache.perf.options import OPTIONS

# Tensors at or above this size are their own mmapped blocks, returned to the system when freed
# (glibc's largest dynamic mmap threshold on 64-bit systems); smaller ones may sit in the heap.
MMAP_ALWAYS = 32 << 20
# A dropped cache trims the heap when it held at least this much heap-sized CPU tensor memory
# (below it, the trim's pages would mostly be faulted in again by the next capture for little gain).
MIN_BYTES = 32 << 20


_UNRESOLVED: Any = object()
_malloc_trim: Any = _UNRESOLVED


def _resolve() -> Any:
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return None
        f = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, ValueError):  # not glibc, or no confstr name on this system
        return None
    f.argtypes = [ctypes.c_size_t]
    f.restype = ctypes.c_int
    return f


def trim() -> bool:
    """Return the heap's free pages to the system (glibc's ``malloc_trim(0)``).

    Returns whether the call was made (False where the C library is not glibc, or when
    ``OPTIONS.heap_trim`` is False).
    """
    global _malloc_trim
    if not OPTIONS.heap_trim:
        return False
    if _malloc_trim is _UNRESOLVED:
        _malloc_trim = _resolve()
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


def heap_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of CPU tensor storage in ``tensors`` small enough to live in the C heap (each storage
    once; not the mappings of :mod:`~probe.cache.perf.pool`, which are never in the heap)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_nested:
            s = t.untyped_storage()
            if s.nbytes() < MMAP_ALWAYS and not pool.lends(s.data_ptr()):
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def trim_if_held(tensors: Iterable[Any]) -> bool:
    """:func:`trim` when ``tensors`` hold at least :data:`MIN_BYTES` of heap-sized CPU memory
    (less leaves too few holes to be worth the trim and the page faults that follow it).

    Returns whether the trim was made.
    """
    return heap_bytes(tensors) >= MIN_BYTES and trim()


class HeapTensors(dict):
    """A ``{name: tensor}`` dict that, once dropped, frees its tensors and trims the heap.

    Trims only when the tensors held at least :data:`MIN_BYTES` of heap-sized memory; tensors
    still referenced elsewhere stay alive (and resident) as usual.
    """

    def __del__(self) -> None:
        try:
            big = heap_bytes(self.values()) >= MIN_BYTES
            self.clear()  # free the tensors first: the trim returns their pages
            if big:
                trim()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass


# -- fresh pages for large tensors -------------------------------------------------------------
HUGE = pool.HUGE  # the size of a transparent huge page on x86-64 and arm64 Linux


def mapped_empty(shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> torch.Tensor:
    """A zero-filled tensor of ``shape`` in memory of its own, mapped from the system.

    A capture writes each pattern once into fresh memory and keeps it. Allocated with
    ``torch.empty`` it comes from the C heap, among the model's own temporaries, whose pages it
    then displaces (the next layer's activations fault new pages in), and every 4 KiB page is a
    fault. A CPU tensor of at least :data:`HUGE` bytes is instead an anonymous ``mmap`` of its
    own, marked for transparent huge pages where the system offers them (one fault per 2 MiB),
    returned to the system when the tensor is freed, and zero-filled by the kernel (``zeroed``:
    a writer need not clear what it does not write). Smaller ones, other devices, and systems
    without ``mmap``, or a system out of mappings: ``torch.zeros``.
    """
    numel = math.prod(shape)
    itemsize = dtype.itemsize
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cpu" or numel * itemsize < HUGE or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype, device=dev)
    try:
        buf = mmap.mmap(-1, numel * itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # out of mappings (vm.max_map_count) or address space: the heap, as before
        return torch.zeros(shape, dtype=dtype, device=dev)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # no transparent huge pages here: 4 KiB pages
            buf.madvise(mmap.MADV_HUGEPAGE)
    with warnings.catch_warnings():  # torch notes that the buffer is writable: it is meant to be
        warnings.simplefilter("ignore")
        return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


mapped_empty.zeroed = True  # type: ignore[attr-defined]
