"""``probe.serve``: the explorer on a real ASGI server (uvicorn), bound to 127.0.0.1 by default."""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

from probe.corpus.store import INSTALL
from probe.errors import ProbeError
from probe.explore.app import create_app
from probe.explore.data import Explorer

HOST = "127.0.0.1"
PORT = 8765


def require() -> None:
    """One line naming the install command when starlette or uvicorn is missing."""
    for name in ("starlette", "uvicorn", "duckdb"):
        try:
            __import__(name)
        except ImportError:
            raise ProbeError(f"probe serve needs {name}; install it with `{INSTALL}`") from None


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port`` (0: a free port); one-line ProbeError when it cannot."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ProbeError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        why = "in use" if e.errno in (98, 48, 10048) else e.strerror
        raise ProbeError(
            f"cannot listen on {host}:{port} ({why}); pass another --port (0 picks a free one)"
        ) from None
    sock.set_inheritable(True)
    return sock


def serve(
    run_dir: str | os.PathLike,
    *,
    host: str = HOST,
    port: int = PORT,
    model: Any = None,
    tokenizer: Any = None,
    composition: Any = None,
    log_level: str = "warning",
) -> None:
    """Serve the corpus run at ``run_dir`` until interrupted (Ctrl-C); prints its address first.

    ``model``/``tokenizer``: the run's model, to capture texts again (their report, examples the
    run did not keep); ``composition``: rows of ``probe.composition(model).table`` for the head
    pages. Read-only: the run's files are never written. See :mod:`probe.explore.app`.
    """
    require()
    import uvicorn

    ex = Explorer(run_dir, model=model, tokenizer=tokenizer, composition=composition)
    sock = listen(host, port)
    shown = sock.getsockname()
    where = f"[{shown[0]}]" if ":" in shown[0] else shown[0]
    print(f"serving {ex.corpus.path} on http://{where}:{shown[1]}/ (Ctrl-C stops)", flush=True)
    server = uvicorn.Server(
        uvicorn.Config(create_app(ex), log_level=log_level, access_log=False, lifespan="off")
    )
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        ex.close()
        sys.stdout.flush()


__all__ = ["HOST", "PORT", "listen", "require", "serve"]
