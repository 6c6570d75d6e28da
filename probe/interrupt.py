"""Ctrl-C that is never lost.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be when SIGINT arrives.
Landing inside a ``__del__`` or a weakref callback (a tensor's storage being freed, say), the
exception is printed as "Exception ignored in ..." and swallowed: the run goes on as if the user
had not pressed Ctrl-C. The command line therefore installs :func:`on_sigint`, which also sets a
flag; long loops call :func:`check` between units of work (a corpus calls it after each batch),
and the command's error boundary calls it once more before it reports success, so a swallowed
interrupt still stops the run with exit code 130 and every temporary file removed.

Outside the command line (``probe.run_corpus`` in a notebook) the handler is not installed and
:func:`check` does nothing.
"""

from __future__ import annotations

import signal

_pending = False


def on_sigint(signum: int, frame: object) -> None:
    """SIGINT handler: remember the interrupt, then raise ``KeyboardInterrupt`` as Python does."""
    global _pending
    _pending = True
    raise KeyboardInterrupt


def check() -> None:
    """Raise ``KeyboardInterrupt`` if a Ctrl-C arrived (even one swallowed where it landed)."""
    if _pending:
        raise KeyboardInterrupt


def install() -> object | None:
    """Install :func:`on_sigint` if SIGINT has Python's default handler; returns the handler it
    replaced (to give back to :func:`restore`), or None when it left SIGINT alone."""
    global _pending
    _pending = False
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return None
    try:
        return signal.signal(signal.SIGINT, on_sigint)
    except ValueError:  # not the main thread
        return None


def restore(previous: object | None) -> None:
    """Put back the SIGINT handler :func:`install` replaced, and forget any pending interrupt."""
    global _pending
    _pending = False
    if previous is not None:
        signal.signal(signal.SIGINT, previous)
