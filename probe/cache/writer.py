"""Where captured tensors go while a capture runs: memory, or a safetensors file streamed to disk.

The streaming sink writes each tensor's bytes as soon as it is produced, so peak memory stays
about one layer of patterns. Safetensors puts its JSON header *before* the data, and the final
key names are only known when the capture ends, so the sink reserves room for the header at the
start of a temporary file (the format allows the header to be padded with spaces), appends
tensor data after it, and writes the header last. If the header outgrows the reservation (or
leaves most of it empty while the data is small) it rewrites the file once. The file only appears
at its final path (fsync, then atomic rename) when complete; every failure path removes the
temporary files.
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

from probe.errors import ProbeError, describe_os_error
from probe.files import atomic_path, umask_mode

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

    def put(self, tensor: torch.Tensor) -> int:
        """Store ``tensor``; returns a handle used to name it in :meth:`finish`."""
        self._tensors.append(tensor.detach().contiguous())
        return len(self._tensors) - 1

    def finish(self, names: dict[int, str], metadata: dict[str, str]) -> dict[str, torch.Tensor]:
        """Return ``{name: tensor}`` for the named handles."""
        return {name: self._tensors[h] for h, name in names.items()}

    def abort(self) -> None:
        self._tensors.clear()


def check_output(path: str | os.PathLike) -> Path:
    """Refuse an output path that cannot be written, before any work is done; returns it as a Path.

    Raises :class:`ProbeError` when ``path`` is an existing directory, when a part of its folder
    is a file, or when its folder (or the nearest existing ancestor) is not writable.
    """
    path = Path(path)
    if path.is_dir():
        raise ProbeError(f"output {path} is a directory; give a file path such as {path / 'run.safetensors'}")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ProbeError(f"cannot write {path}: {folder} is a file, not a folder; choose another output path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ProbeError(
            f"cannot write {path}: no permission to write in {folder}; choose another output path"
        )
    return path


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


# A reservation far larger than the header is trimmed by rewriting the file when its data is small
# (the copy is cheap); for a large cache the spare header bytes are a negligible fraction.
TRIM_SLACK = 4096
TRIM_DATA = 32 << 20


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
            self._reserve = max(1024, (int(reserve) + 7) // 8 * 8)
            self._f.write(b"\0" * (8 + self._reserve))
        except OSError as e:
            self.abort()
            raise ProbeError(describe_os_error(e)) from e
        except BaseException:
            self.abort()
            raise
        self._entries: list[tuple[str, list[int], int, int]] = []
        self._offset = 0
        self.bytes_written = 0

    def put(self, tensor: torch.Tensor) -> int:
        """Append ``tensor``'s bytes to the file now; returns a handle."""
        t = tensor.detach().to("cpu").contiguous()
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot store dtype {t.dtype} in a probe cache")
        nbytes = t.numel() * t.element_size()
        if nbytes:
            try:
                self._f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            except OSError as e:
                self.abort()
                raise ProbeError(describe_os_error(e, f"cannot write {self.path}")) from e
        self._entries.append((_DTYPES[t.dtype], list(t.shape), self._offset, self._offset + nbytes))
        self._offset += nbytes
        self.bytes_written += nbytes
        return len(self._entries) - 1

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
        if sorted(names) != list(range(len(self._entries))):
            raise RuntimeError("every streamed tensor must be named exactly once")
        header: dict = {"__metadata__": dict(metadata)}
        for h, name in names.items():
            dtype, shape, start, end = self._entries[h]
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}
        blob = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        try:
            slack = self._reserve - len(blob)
            if 0 <= slack and not (slack > TRIM_SLACK and self._offset <= TRIM_DATA):
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
            f = getattr(self, "_f", None)
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        finally:
            _unlink(self._tmp)
            self._tmp = None


def save_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Save ``tensors`` to ``path`` as safetensors atomically (temporary file, fsync, then rename)."""
    path = check_output(path)
    try:
        with atomic_path(path) as tmp:
            try:
                save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
            except SafetensorError as e:  # its I/O errors carry the OS error number in the text
                m = re.search(r"os error (\d+)", str(e))
                if m is None:
                    raise
                n = int(m[1])
                raise OSError(n, os.strerror(n), str(path)) from e
    except OSError as e:
        raise ProbeError(describe_os_error(e)) from e
    return path
