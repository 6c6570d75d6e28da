"""Writing a streamed cache's tensors on a background thread while the model computes.

The streaming sink hands each tensor to :class:`IOThread` as soon as it is produced: the model
computes layer l+1 while layer l is written. The thread writes in the order tensors were queued,
so the file is byte-identical to a synchronous write. At most about two of the largest tensors
are in flight (:meth:`IOThread.put` waits beyond that), so peak memory stays about two layers of
patterns. An error on the thread is kept in :attr:`IOThread.error` for the caller to raise; the
jobs after it are only drained. Switched by ``OPTIONS.io_thread`` (:mod:`probe.cache.perf.options`),
which the sink reads.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from probe.cache.perf.options import OPTIONS


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class IOThread:
    """Writes queued tensors with ``write(t)`` on one background thread, started by the first put.

    ``sync()`` is called after every ``OPTIONS.sync_every`` bytes written and returns whether it
    flushed the file to disk (a direct-I/O file has nothing to flush): flushing here, while the
    model computes, leaves the final fsync on the caller's thread less to do.
    """

    def __init__(self, write: Callable[[torch.Tensor], None], sync: Callable[[], bool]) -> None:
        # dropped by stop(): the sink holds this object, so these bound methods are a cycle
        self._write: Callable[[torch.Tensor], None] | None = write
        self._sync: Callable[[], bool] | None = sync
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._pending = 0  # bytes queued and not yet written
        self._limit = 0  # twice the largest tensor seen: about two layers in flight
        self._inflight: dict[int, int] = {}  # storage address -> queued tensors using it
        self.error: BaseException | None = None
        self._unsynced = 0  # bytes written since the last flush to disk

    def put(self, t: torch.Tensor, nbytes: int) -> None:
        """Queue ``t`` (``nbytes`` long) for writing; waits while too many bytes are in flight."""
        ptr = _storage(t)
        with self._cond:
            self._limit = max(self._limit, 2 * nbytes)
            while self._pending and self._pending + nbytes > self._limit and self.error is None:
                self._cond.wait()
            self._pending += nbytes
            self._inflight[ptr] = self._inflight.get(ptr, 0) + 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="probe-writer", daemon=True)
            self._thread.start()
        self._jobs.put((t, nbytes, ptr))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            t, nbytes, ptr = job
            job = None
            try:
                if self.error is None:
                    self._write(t)
                    self._unsynced += nbytes
                    if self._unsynced >= OPTIONS.sync_every and self._sync():
                        self._unsynced = 0
            except BaseException as e:  # handed to the caller; later jobs are only drained
                with self._cond:
                    self.error = e
            finally:
                t = None  # the memory is free before anyone waiting for it is woken
                with self._cond:
                    self._pending -= nbytes
                    left = self._inflight.pop(ptr) - 1
                    if left:
                        self._inflight[ptr] = left
                    self._cond.notify_all()

    def wait_written(self, tensor: torch.Tensor) -> None:
        """Block until no queued write still reads ``tensor``'s memory (so it may be reused)."""
        if not self._inflight:
            return
        ptr = _storage(tensor)
        with self._cond:
            while self._inflight.get(ptr) and self.error is None:
                self._cond.wait()

    def stop(self) -> None:
        """Write what is queued (skipped after an error), then end the thread."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        self._write = self._sync = None

    def abort(self, reason: BaseException) -> None:
        """End the thread without writing what is still queued (``reason`` becomes the error)."""
        if self._thread is not None:
            self.error = self.error or reason
        self.stop()
