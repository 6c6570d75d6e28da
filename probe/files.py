"""Whole files or none: every file probe writes goes through :func:`atomic_path`.

A temporary file is created beside the destination, written, flushed and fsynced, given the mode
the user's umask asks for, and renamed over the destination; on any failure (an exception, or
``KeyboardInterrupt``) it is removed, so the destination is either the old file or the new one,
never half of one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def umask_mode() -> int:
    """The mode a new file gets under the user's umask (``0o644`` for umask ``022``)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


_umask_mode = umask_mode


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is fsynced and renamed to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp_path, _umask_mode())
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns the path."""
    return write_bytes_atomic(path, text.encode("utf-8"))


__all__ = ["atomic_path", "umask_mode", "write_bytes_atomic", "write_text_atomic"]
