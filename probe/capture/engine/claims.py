"""One capture per model and thread at a time: the claim every capture takes on the model it runs.

Hooks are per module, so two captures of one model object in one thread would each see the
other's calls; :func:`claim` refuses the second (a capture inside ``probe.trace`` on the same
model) in one line, and :func:`release` lets the model go when the capture ends, whatever way it
ends. Captures in other threads each see their own forward (torch's function modes are per
thread), so they may run on one model at once.
"""

from __future__ import annotations

import threading
import weakref

from torch import nn

from probe.errors import ProbeError

# model -> the threads a capture is running in on it: hooks are per module, so each capture's
# watcher follows only its own thread's calls (torch's function modes are per thread already)
_RUNNING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_RUNNING_LOCK = threading.Lock()


def claim(model: nn.Module) -> None:
    me = threading.get_ident()
    with _RUNNING_LOCK:
        threads = _RUNNING.setdefault(model, set())
        if me in threads:
            raise ProbeError(
                f"probe is already capturing this {type(model).__name__} object in this thread (a "
                "capture inside probe.trace on the same model); one capture per forward: run the "
                "model inside the outer probe.trace and read its cache, or capture a copy of the model"
            )
        threads.add(me)


def release(model: nn.Module) -> None:
    with _RUNNING_LOCK:
        threads = _RUNNING.get(model)
        if threads is not None:
            threads.discard(threading.get_ident())
            if not threads:
                del _RUNNING[model]


__all__ = ["claim", "release"]
