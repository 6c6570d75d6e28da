"""Where captured tensors go while a capture runs: memory, or a safetensors file streamed to disk.

The streaming sink hands each tensor to a background I/O thread as soon as it is produced
(:mod:`probe.cache.perf.iothread`): the model computes layer l+1 while layer l is written, with
at most two layers' worth of bytes in flight, so peak memory stays about two layers of patterns;
an error in the thread is raised as :class:`ProbeError` by the next ``put`` or ``finish``. Where
the file system allows it the data is written with direct I/O (:mod:`probe.cache.perf.direct`):
the device reads the tensors' memory itself, without a copy into the page cache and its later
write-back. Both are switched in :data:`probe.cache.perf.OPTIONS`.

Safetensors puts its JSON header *before* the data, and the final key names are only known
when the capture ends, so the sink reserves room for the header at the start of a temporary
file (the format allows the header to be padded with spaces; the reservation ends on a 4096-byte
block, so the data starts on one), appends tensor data after it, and writes the header last. If
the header outgrows the reservation (or leaves spare bytes that are a noticeable part of a small
file) it rewrites the file once. The file only appears at its final path (fsync, then atomic
rename) when complete; every failure path removes the temporary files.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from probe.cache.perf.direct import ALIGN, DataWriter, aligned_empty
from probe.cache.perf.iothread import IOThread
from probe.cache.perf.options import OPTIONS
from probe.errors import ProbeError, describe_os_error
from probe.files import atomic_path, check_writable, umask_mode

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class MemorySink:
    """Keeps captured tensors in memory; :meth:`finish` returns them by name."""

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor] = []
        self._versions: list[tuple[int, int]] = []  # (handle, version at put) of the model's tensors

    def put(self, tensor: torch.Tensor, owned: bool = False) -> int:
        """Store ``tensor``; returns a handle used to name it in :meth:`finish`.

        The model's own tensors are kept without a copy; :meth:`finish` refuses the capture if
        the model overwrote one in place afterwards (the stored values would be wrong).
        """
        t = tensor.detach().contiguous()
        self._tensors.append(t)
        if not owned:
            self._versions.append((len(self._tensors) - 1, t._version))
        return len(self._tensors) - 1

    def held(self) -> list[torch.Tensor]:
        """The tensors stored so far (the sink's own list: do not modify)."""
        return self._tensors

    def wait_written(self, tensor: torch.Tensor) -> None:
        """Nothing to wait for: memory is written at once."""

    empty = None  # no special allocation: the tensors stay where they are

    def finish(self, names: dict[int, str], metadata: dict[str, str]) -> dict[str, torch.Tensor]:
        """Return ``{name: tensor}`` for the named handles."""
        for h, version in self._versions:
            if self._tensors[h]._version != version and h in names:
                raise ProbeError(
                    f"the model overwrote {names[h]} in place after probe recorded it, so the value "
                    "kept in memory is no longer the one computed; stream the capture to a file "
                    "(out=...), which copies such tensors as they are recorded"
                )
        out = {name: self._tensors[h] for h, name in names.items()}
        # the cache owns them now: a dropped cache frees them whether or not this sink lives on
        self._tensors, self._versions = [], []
        return out

    def abort(self) -> None:
        self._tensors.clear()


def check_output(path: str | os.PathLike) -> Path:
    """:func:`probe.files.check_writable` for a cache: a folder gets ``folder/run.safetensors`` suggested."""
    return check_writable(path, example="run.safetensors")


def _unlink(p: Path | None) -> None:
    if p is not None:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def _fsync_dir(folder: Path) -> None:
    # the rename itself survives a power loss only once the folder's entry is on disk
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# A reservation far larger than the header is trimmed by rewriting the file (a copy of the data)
# only when the spare bytes are a noticeable part of the file: more than TRIM_SLACK bytes and more
# than 1/TRIM_RATIO of the data (a small file's few spare kilobytes are not worth a copy).
TRIM_SLACK = 4096
TRIM_RATIO = 64

_datasync = getattr(os, "fdatasync", os.fsync)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class FileSink:
    """Streams tensors into a safetensors file at ``path`` (written atomically on :meth:`finish`).

    The temporary file lives beside ``path``; it is fsynced, given the mode the umask asks for and
    renamed only when complete. Any failure (an exception, a disk-full error, an interrupt) removes
    it, including the second temporary file of a header rewrite.
    """

    def __init__(self, path: str | os.PathLike, reserve: int = 65536) -> None:
        self.path = check_output(path)
        self._tmp: Path | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
            self._tmp = Path(tmp)
            self._f = os.fdopen(fd, "wb")
            # the data starts on a block boundary, so it can be written with direct I/O
            self._reserve = -(-(8 + max(1024, int(reserve))) // ALIGN) * ALIGN - 8
            self._f.write(b"\0" * (8 + self._reserve))
            self._f.flush()
            self._io = DataWriter(self._tmp, 8 + self._reserve, self._f.fileno())
        except OSError as e:
            self.abort()
            raise ProbeError(describe_os_error(e)) from e
        except BaseException:
            self.abort()
            raise
        self._entries: list[tuple[str, list[int], int, int]] = []
        self._offset = 0
        self.bytes_written = 0
        # the I/O thread (None: each tensor is written in the caller's thread as it is put)
        self._thread = IOThread(self._write, self._sync) if OPTIONS.io_thread else None

    def put(self, tensor: torch.Tensor, owned: bool = False) -> int:
        """Queue ``tensor``'s bytes for the file (written now without the I/O thread); returns a handle.

        ``owned``: the caller will not change the tensor's memory until :meth:`wait_written`
        says it is written; otherwise a tensor that still shares the caller's memory is copied
        before it is queued (the model may overwrite its own tensors in place later).
        """
        self._raise_if_failed()
        src = tensor.detach()
        t = src.to("cpu").contiguous()
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot store dtype {t.dtype} in a probe cache")
        nbytes = t.numel() * t.element_size()
        if nbytes:
            if self._thread is None:
                try:
                    self._write(t)
                except OSError as e:
                    self.abort()
                    raise ProbeError(describe_os_error(e, f"cannot write {self.path}")) from e
            else:
                if not owned and t.device == src.device and _storage(t) == _storage(src):
                    t = aligned_empty(t.shape, t.dtype, t.device).copy_(t)
                self._thread.put(t, nbytes)
                self._raise_if_failed()
        self._entries.append((_DTYPES[t.dtype], list(t.shape), self._offset, self._offset + nbytes))
        self._offset += nbytes
        self.bytes_written += nbytes
        return len(self._entries) - 1

    def _write(self, t: torch.Tensor) -> None:
        self._io.write(t)

    @staticmethod
    def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """An uninitialised tensor the I/O thread can write without a copy (block-aligned memory)."""
        return aligned_empty(shape, dtype, device)

    def _sync(self) -> bool:
        """Flush what the page cache holds of the file to disk (the I/O thread calls it as it goes);
        returns False for a direct-I/O file, which has nothing there."""
        if self._io.direct:
            return False
        self._f.flush()
        _datasync(self._f.fileno())
        return True

    def wait_written(self, tensor: torch.Tensor) -> None:
        """Block until no queued write still reads ``tensor``'s memory (so it may be reused)."""
        if self._thread is not None:
            self._thread.wait_written(tensor)

    def _raise_if_failed(self) -> None:
        e = self._thread.error if self._thread is not None else None
        if e is None:
            return
        self.abort()
        if isinstance(e, OSError):
            raise ProbeError(describe_os_error(e, f"cannot write {self.path}")) from e
        raise ProbeError(f"cannot write {self.path}: {e}") from e

    def finish(
        self,
        names: dict[int, str],
        metadata: dict[str, str],
        opener: Callable[[Path], Any] | None = None,
    ) -> Any:
        """Write the header for the named handles and move the file into place.

        Returns the path, or, with ``opener``, what ``opener(temporary_path)`` returns: it is
        called on the complete file just before the rename, so what it opens is this file even
        if another process writes ``path`` at the same moment.
        """
        try:
            if self._thread is not None:
                self._thread.stop()  # every queued tensor is in the file (or an error says why not)
        except BaseException:
            self.abort()
            raise
        self._raise_if_failed()
        try:
            self._io.close()  # the staged tail is in the file, which ends at its last byte
        except OSError as e:
            self.abort()
            raise ProbeError(describe_os_error(e, f"cannot write {self.path}")) from e
        if sorted(names) != list(range(len(self._entries))):
            raise RuntimeError("every streamed tensor must be named exactly once")
        header: dict = {"__metadata__": dict(metadata)}
        for h, name in names.items():
            dtype, shape, start, end = self._entries[h]
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}
        blob = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        try:
            slack = self._reserve - len(blob)
            if 0 <= slack and not (slack > TRIM_SLACK and slack * TRIM_RATIO > self._offset):
                self._f.seek(0)
                self._f.write(struct.pack("<Q", self._reserve))
                self._f.write(blob + b" " * (self._reserve - len(blob)))
            else:
                self._rewrite(blob)
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.chmod(self._tmp, umask_mode())
            result = opener(self._tmp) if opener is not None else self.path
            os.replace(self._tmp, self.path)
            self._tmp = None
        except OSError as e:
            self.abort()
            raise ProbeError(describe_os_error(e, f"cannot write {self.path}")) from e
        except BaseException:
            self.abort()
            raise
        _fsync_dir(self.path.parent)
        return result

    def _rewrite(self, blob: bytes) -> None:
        # The header did not fit the reservation (or left it mostly empty): copy the data behind a
        # header of the right size.
        self._f.flush()
        pad = (-len(blob)) % 8
        fd, tmp2 = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        out = os.fdopen(fd, "wb")
        try:
            out.write(struct.pack("<Q", len(blob) + pad))
            out.write(blob + b" " * pad)
            with open(self._tmp, "rb") as src:
                src.seek(8 + self._reserve)
                while chunk := src.read(1 << 24):
                    out.write(chunk)
        except BaseException:
            out.close()
            _unlink(Path(tmp2))
            raise
        self._f.close()
        _unlink(self._tmp)
        self._tmp, self._f = Path(tmp2), out

    def abort(self) -> None:
        """Close and delete the temporary file; nothing is left at ``path``. Safe to call twice."""
        try:
            if getattr(self, "_thread", None) is not None:
                self._thread.abort(ProbeError("the capture was aborted"))  # skip what is queued
            io = getattr(self, "_io", None)
            if io is not None:
                with contextlib.suppress(OSError):
                    io.release()
            f = getattr(self, "_f", None)
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        finally:
            _unlink(self._tmp)
            self._tmp = None


def _apart(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors``, contiguous, each key's memory its own as a safetensors file needs: a tensor
    that is another key's tensor (a planned capture keeps a layer's output, which is the next
    layer's input, once under both keys) or overlaps it is written from a copy."""
    out: dict[str, torch.Tensor] = {}
    spans: dict[tuple, list[tuple[int, int]]] = {}
    for k, v in tensors.items():
        v = v.contiguous()
        if v.numel():
            where = (v.device, v.untyped_storage().data_ptr())
            lo = v.storage_offset() * v.element_size()
            hi = lo + v.numel() * v.element_size()
            taken = spans.setdefault(where, [])
            if any(lo < b and a < hi for a, b in taken):
                v = v.clone()
            else:
                taken.append((lo, hi))
        out[k] = v
    return out


def save_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Save ``tensors`` to ``path`` as safetensors atomically (temporary file, fsync, then rename)."""
    path = check_output(path)
    try:
        with atomic_path(path) as tmp:
            try:
                save_file(_apart(tensors), tmp, metadata=metadata)
            except SafetensorError as e:  # its I/O errors carry the OS error number in the text
                m = re.search(r"os error (\d+)", str(e))
                if m is None:
                    raise
                n = int(m[1])
                raise OSError(n, os.strerror(n), str(path)) from e
    except OSError as e:
        raise ProbeError(describe_os_error(e)) from e
    return path
