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

from probe.errors import ProbeError


def umask_mode() -> int:
    """The mode a new file gets under the user's umask (``0o644`` for umask ``022``)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


_umask_mode = umask_mode


def check_writable(path: str | os.PathLike, example: str | None = None) -> Path:
    """Refuse an output path that cannot be written, before any work is done; returns it as a Path.

    Raises :class:`ProbeError` when ``path`` is an existing directory (suggesting ``path/example``
    when given), when a part of its folder is a file, or when its folder (or the nearest existing
    ancestor) is not writable.
    """
    path = Path(path)
    if path.is_dir():
        hint = f"such as {path / example}" if example else "inside it or elsewhere"
        raise ProbeError(f"output {path} is a directory; give a file path {hint}")
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


def check_writable_dir(path: str | os.PathLike, first: str, what: str) -> Path:
    """``path`` as a Path when a folder of output can be written there (``first`` is the file
    written first inside it); else a one-line :class:`ProbeError` (a file, a file on the way, no
    permission) naming ``what`` goes there, raised before any work is done."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ProbeError(f"{out} is a file; give a directory for {what}")
    check_writable(out / first)
    return out


def input_file(path: str | os.PathLike, what: str, give: str) -> Path:
    """``path`` as a Path when it is an existing regular file; else a one-line :class:`ProbeError`
    naming ``what`` (e.g. ``"--texts"``), what is wrong (missing, a folder, a pipe) and ``give``."""
    p = Path(path)
    if p.is_dir():
        raise ProbeError(f"{what} {p} is a directory; {give}")
    if not p.exists():
        raise ProbeError(f"{what} {p}: no such file; {give}")
    if not p.is_file():
        raise ProbeError(f"{what} {p} is not a regular file; {give}")
    return p


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is fsynced and renamed to ``path``.

    A path that cannot be written (a folder, under a file, no permission) is a :class:`ProbeError`
    before anything is created.
    """
    path = check_writable(path)
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


def human_size(n: float) -> str:
    """A byte count as people read it: ``1536`` -> ``"1.5 KB"``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


__all__ = [
    "human_size",
    "atomic_path",
    "check_writable",
    "check_writable_dir",
    "input_file",
    "umask_mode",
    "write_bytes_atomic",
    "write_text_atomic",
]
