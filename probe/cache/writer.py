"""Where captured tensors go while a capture runs: memory, or a safetensors file streamed to disk.

The streaming sink writes each tensor's bytes as soon as it is produced, so peak memory stays
about one layer of patterns. Safetensors puts its JSON header *before* the data, and the final
key names are only known when the capture ends, so the sink reserves room for the header at the
start of a temporary file (the format allows the header to be padded with spaces), appends
tensor data after it, and writes the header last. If the header outgrows the reservation it
rewrites the file once. The file only appears at its final path (atomic rename) when complete.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

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


class FileSink:
    """Streams tensors into a safetensors file at ``path`` (written atomically on :meth:`finish`)."""

    def __init__(self, path: str | os.PathLike, reserve: int = 65536) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self._tmp = Path(tmp)
        self._f = os.fdopen(fd, "wb")
        self._reserve = max(1024, (int(reserve) + 7) // 8 * 8)
        self._f.write(b"\0" * (8 + self._reserve))
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
            self._f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self._entries.append((_DTYPES[t.dtype], list(t.shape), self._offset, self._offset + nbytes))
        self._offset += nbytes
        self.bytes_written += nbytes
        return len(self._entries) - 1

    def finish(self, names: dict[int, str], metadata: dict[str, str]) -> Path:
        """Write the header for the named handles and move the file into place; returns the path."""
        if sorted(names) != list(range(len(self._entries))):
            raise RuntimeError("every streamed tensor must be named exactly once")
        header: dict = {"__metadata__": dict(metadata)}
        for h, name in names.items():
            dtype, shape, start, end = self._entries[h]
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}
        blob = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        try:
            if len(blob) <= self._reserve:
                self._f.seek(0)
                self._f.write(struct.pack("<Q", self._reserve))
                self._f.write(blob + b" " * (self._reserve - len(blob)))
                self._f.close()
            else:
                self._f.close()
                self._rewrite(blob)
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return self.path

    def _rewrite(self, blob: bytes) -> None:
        # The header did not fit the reservation: copy the data behind a header of the right size.
        pad = (-len(blob)) % 8
        fd, tmp2 = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        with os.fdopen(fd, "wb") as out, open(self._tmp, "rb") as src:
            out.write(struct.pack("<Q", len(blob) + pad))
            out.write(blob + b" " * pad)
            src.seek(8 + self._reserve)
            while chunk := src.read(1 << 24):
                out.write(chunk)
        os.unlink(self._tmp)
        self._tmp = Path(tmp2)

    def abort(self) -> None:
        """Close and delete the temporary file; nothing is left at ``path``."""
        try:
            self._f.close()
        finally:
            if self._tmp.exists():
                self._tmp.unlink()


def save_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Save ``tensors`` to ``path`` as safetensors atomically (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
