"""The threads the compiled row loops run on (numba releases the GIL): one per core torch was
told to use, the calling thread one of them, with torch single-threaded around and inside them.

:func:`cores` is the block loop's context (torch on one thread while the loops read, the cores it
had given to them); :func:`spread` cuts a loop's items into one run a thread, the first on the
calling thread and the others on :func:`pool`'s workers; :func:`threads` says how many.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from probe.analysis.focus.backends.rowloop.jit import numba

_POOL: tuple[int, ThreadPoolExecutor] | None = None


_CORES: int | None = None  # set by cores(): the thread count torch had before it was lowered
_CPUS = os.cpu_count() or 1  # (os.cpu_count() reads /sys each call: 80 µs, three times a block)


def threads() -> int:
    """Worker threads for the compiled loops: torch's intra-op thread count (the cores torch was
    told to use; inside :func:`cores`, the count it had before), so that the loops and torch's own
    kernels never ask for more cores than that."""
    return max(1, min(_CORES or torch.get_num_threads(), _CPUS))


@contextlib.contextmanager
def cores() -> Iterator[None]:
    """Torch single-threaded inside, the compiled loops on :func:`threads` cores. Torch's OpenMP
    workers spin for a while after each of its parallel kernels; with blocks of weights recomputed
    by torch and read by the loop's threads in turn, the spinning workers and the loop's threads
    took each other's cores at every hand-over (a block loop 3.6× slower than with torch on one
    thread, on a shared two-core machine). Nested uses keep the outer count."""
    global _CORES
    n = torch.get_num_threads()
    if _CORES is not None or n == 1 or not _compiled():
        yield
        return
    _CORES = n
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        _CORES = None


def _alone(fn: Callable[[int, int], None], a: int, b: int) -> None:
    """``fn(a, b)`` on a :func:`pool` worker with torch's own kernels single-threaded there too,
    inside :func:`cores`. Torch's thread count is per thread (OpenMP's and MKL's settings of the
    thread that calls it, set from torch's global count when the thread first asks for it):
    :func:`cores` lowers the calling thread's, and a fresh worker's matrix product (a part of a
    block, computed by the thread that reads it) went straight to MKL, which started threads of
    its own: four threads on two cores, and on a machine of ``c`` cores ``c − 1`` workers each
    starting ``c − 1`` more. Setting it also sets torch's global count, which :func:`cores` has
    already lowered and puts back when it ends."""
    if _CORES is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    fn(a, b)


def pool() -> ThreadPoolExecutor:
    """A thread pool of :func:`threads` − 1 workers (the calling thread is the other, see
    :func:`spread`). The compiled loops release the GIL and run on these plain threads, not on
    numba's own OpenMP pool: that pool's workers spin after each parallel loop, and with torch's
    OpenMP pool (a second runtime) spinning after each of torch's kernels, the two took each
    other's cores for milliseconds at every hand-over."""
    global _POOL
    n = max(1, threads() - 1)
    if _POOL is None or _POOL[0] != n:
        _POOL = (n, ThreadPoolExecutor(n, thread_name_prefix="probe-rows"))
    return _POOL[1]


def spread(fn: Callable[[int, int], None], n: int) -> None:
    """``fn(start, end)`` over ``n`` items cut into :func:`threads` runs (:func:`parts`): the first
    run on the calling thread, the others on :func:`pool`'s workers at the same time (inside
    :func:`cores`, each with torch single-threaded, as the calling thread is: :func:`_alone`)."""
    runs = parts(n, threads())
    if len(runs) == 1:
        fn(*runs[0])
        return
    others = [pool().submit(_alone, fn, *r) for r in runs[1:]]
    try:
        fn(*runs[0])
    finally:
        for f in others:
            f.result()


def parts(n: int, k: int) -> list[tuple[int, int]]:
    """``n`` items cut into at most ``k`` contiguous ``(start, end)`` runs of near-equal size."""
    k = max(1, min(k, n))
    return [(n * a // k, n * (a + 1) // k) for a in range(k)]


def _compiled() -> bool:
    """Whether the compiled loops are installed (numba, the ``fast`` extra)."""
    return numba is not None


__all__ = ["threads", "cores", "pool", "spread", "parts"]
