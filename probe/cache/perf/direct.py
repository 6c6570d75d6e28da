"""Writing a streamed cache's data with direct I/O (``O_DIRECT``), where the file system has it.

A streamed capture writes hundreds of MB. Through the page cache every byte is first copied
into kernel pages, and the flushes to disk that make the file durable then write those pages
back; on a machine with few cores the copying and the write-back take CPU time from the model's
own threads. With ``O_DIRECT`` the device reads the tensor's memory itself (the measurements are
in ``docs/performance.md``: ``benchmarks/costs.py --parts disk``).

Direct I/O needs the file offset, the length and the memory address of every write aligned to
the device's block size. :class:`DataWriter` writes a tensor straight from its memory when its
bytes line up (its address and its place in the file agree modulo :data:`ALIGN`, as for buffers
made by :func:`aligned_empty`); everything else goes through a small aligned staging buffer,
which is flushed in whole blocks after every tensor (at most one block stays behind, so the file
grows as the capture runs). The last partial block is written padded and the file cut
back to its true length. Where ``O_DIRECT`` is missing or refused (macOS, Windows, some network
or FUSE file systems) the same bytes are written through the page cache: the file is
byte-identical either way. Switched by ``OPTIONS.direct_io`` (:mod:`probe.cache.perf.options`).
"""

from __future__ import annotations

import contextlib
import errno
import math
import mmap
import os

import torch

from probe.cache.perf.options import OPTIONS

# Block alignment for direct writes: a multiple of every common logical block size (512, 4096).
ALIGN = 4096
# The staging buffer for bytes that do not line up (small tensors, tails, odd sizes).
STAGE = 4 << 20


def _pwrite(fd: int, data: memoryview, offset: int) -> int:
    if hasattr(os, "pwrite"):
        return os.pwrite(fd, data, offset)
    os.lseek(fd, offset, os.SEEK_SET)  # Windows: no pwrite (and no O_DIRECT: one writer per fd)
    return os.write(fd, data)


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.empty(shape)`` whose first byte sits on an :data:`ALIGN` boundary (CPU; else plain).

    A streamed capture fills its pattern buffers and residual copies from here, so the I/O thread
    can hand their memory to the device without a copy.
    """
    if torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(n + ALIGN, dtype=torch.uint8)
    off = (-raw.data_ptr()) % ALIGN
    return raw[off : off + n].view(dtype).view(shape)


class DataWriter:
    """Writes a sequence of tensors' bytes one after another into ``path`` from offset ``start``.

    ``fd`` is an open, writable descriptor of ``path`` used where direct I/O is not possible; the
    writer opens its own ``O_DIRECT`` descriptor when it can (``start`` must then be a multiple of
    :data:`ALIGN`). :meth:`close` writes what is staged and cuts the file to ``start`` plus the
    bytes written; the caller still fsyncs and closes ``fd``.
    """

    def __init__(self, path: str | os.PathLike, start: int, fd: int) -> None:
        self._fd = self._buffered = fd
        self._align = 1
        self.direct = False
        self._pos = start  # file offset where the staging buffer's bytes go
        self._stage: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._fill = 0
        flag = getattr(os, "O_DIRECT", 0)
        if OPTIONS.direct_io and flag and start % ALIGN == 0:
            try:
                self._fd = os.open(path, os.O_WRONLY | flag | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                self._fd = fd  # the file system refuses direct I/O (tmpfs on older kernels, ...)
            else:
                self._align, self.direct = ALIGN, True

    def write(self, t: torch.Tensor) -> None:
        """Append the bytes of the contiguous CPU tensor ``t``."""
        n = t.numel() * t.element_size()
        if not n:
            return
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        addr, i, a = t.data_ptr(), 0, self._align
        while i < n:
            if self._fill == 0 and (addr + i) % a == 0 and n - i >= a:
                k = (n - i) // a * a  # lined up: straight from the tensor's memory
                self._pwrite(data[i : i + k], self._pos)
                self._pos += k
                i += k
                continue
            if self._stage is None:
                self._stage = mmap.mmap(-1, STAGE)  # page-aligned
                self._view = memoryview(self._stage)
            k = min(STAGE - self._fill, n - i)
            if (addr + i - self._fill) % a == 0 and self._fill % a:
                k = min(k, a - self._fill % a)  # complete the block only: the rest can go direct
            self._view[self._fill : self._fill + k] = data[i : i + k]
            self._fill += k
            i += k
            if self._fill == STAGE or (self._fill % a == 0 and i < n and (addr + i) % a == 0):
                self._flush_stage(self._fill)
        if self._fill >= a:
            # the whole blocks go now (a streamed file grows as the capture runs); less than a
            # block stays staged for the next tensor
            whole = self._fill // a * a
            self._pwrite(self._view[:whole], self._pos)
            self._pos += whole
            rest = self._fill - whole
            self._view[:rest] = self._view[whole : self._fill]
            self._fill = rest

    def _flush_stage(self, length: int) -> None:
        self._pwrite(self._view[:length], self._pos)
        self._pos += self._fill
        self._fill = 0

    def _pwrite(self, data: memoryview, offset: int) -> None:
        done = 0
        while done < len(data):
            try:
                done += _pwrite(self._fd, data[done:], offset + done)
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                self._fall_back()  # opened, yet refused on write: the page cache writes the rest

    def _fall_back(self) -> None:
        os.close(self._fd)
        self._fd, self._align, self.direct = self._buffered, 1, False

    def close(self) -> None:
        """Write the staged tail (padded to a block, then cut back) and close the direct descriptor."""
        try:
            if self._fill:
                fill = self._fill
                padded = -(-fill // self._align) * self._align
                self._flush_stage(padded)
                if padded != fill:
                    os.ftruncate(self._fd, self._pos)  # the padding goes: the file ends at its data
        finally:
            self.release()

    def release(self) -> None:
        """Close the direct descriptor and free the staging buffer (nothing more is written)."""
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._stage is not None:
            # slices may still be alive (in the traceback of a failed write): the map is then
            # unmapped when the last of them goes
            with contextlib.suppress(BufferError):
                self._stage.close()
            self._stage = None
        if self.direct:
            self.direct = False
            os.close(self._fd)
            self._fd = self._buffered
