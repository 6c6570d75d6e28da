"""Handing freed heap memory back to the system once a capture's tensors are dropped.

glibc serves tensors under its mmap threshold (which it raises up to 32 MiB as large blocks are
freed) from its heap, and returns freed heap memory to the system only from the heap's top. A
capture keeps every layer's residual tensors (a few MiB each, the model's own) while the
model's temporaries come and go around them, so when the cache is dropped its residuals and the
holes between them are free but stay resident: +300 MB of RSS after ``del cache`` for GPT-2 small
at T = 1024. ``malloc_trim(0)`` releases free pages anywhere in the heap; it costs about as much
as the kernel's work of unmapping them (tens of ms for a few hundred MB) and next to nothing when
little is free. Only on glibc; elsewhere :func:`trim` does nothing.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable
from typing import Any

import torch

# Tensors at or above this size are their own mmapped blocks, returned to the system when freed
# (glibc's largest dynamic mmap threshold on 64-bit systems); smaller ones may sit in the heap.
MMAP_ALWAYS = 32 << 20
# A dropped cache trims the heap when it held at least this much heap-sized CPU tensor memory
# (below it, the trim's pages would mostly be faulted in again by the next capture for little gain).
MIN_BYTES = 32 << 20


def _user_tuned(env: Any = os.environ) -> bool:
    """Whether the user told glibc when to trim (``MALLOC_TRIM_THRESHOLD_`` or its tunable).

    Then probe leaves trimming to glibc: ``malloc_trim`` would override that choice (e.g. the
    no-page-fault setting ``MALLOC_TRIM_THRESHOLD_=1000000000000`` that keeps freed memory).
    """
    return "MALLOC_TRIM_THRESHOLD_" in env or "glibc.malloc.trim_threshold" in env.get("GLIBC_TUNABLES", "")


# Set False to keep freed memory in the process: RSS stays at its high-water mark, and the next
# capture reuses those pages without faulting them in again. Off when the user set glibc's own
# trim threshold (see _user_tuned).
ENABLED = not _user_tuned()

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
    :data:`ENABLED` is False).
    """
    global _malloc_trim
    if not ENABLED:
        return False
    if _malloc_trim is _UNRESOLVED:
        _malloc_trim = _resolve()
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


def heap_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of CPU tensor storage in ``tensors`` small enough to live in the C heap (each storage once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_nested:
            s = t.untyped_storage()
            if s.nbytes() < MMAP_ALWAYS:
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


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
