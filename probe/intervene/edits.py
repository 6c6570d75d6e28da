"""Edits applied while the model runs: a slice of a projection's input or its whole output replaced.

An :class:`Edit` names a :class:`~probe.intervene.locate.Site` (a module and which of its calls
in a forward), where (``"input"``: the heads side by side, or ``"output"``), which features
(``cols``, a slice; None for all) and the new value: a function of the current tensor returning
the replacement for those features. :func:`applied` installs the edits as forward hooks for a
``with`` block; the model's own tensors are never modified in place (the hook returns a copy).
Records: :func:`recording` keeps the tensors at sites instead of changing them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor, nn

from probe.errors import ProbeError
from probe.intervene.locate import Site


@dataclass
class Edit:
    """Replace ``site``'s ``where`` tensor's features ``cols`` (at position ``pos``, or all) by
    ``value(current)``."""

    site: Site
    where: str  # "input" | "output"
    cols: slice | None
    value: Callable[[Tensor], Tensor]
    pos: int | None = None  # only this position (dim 1 of a [batch, pos, ...] tensor)


def _replace(x: Tensor, edits: list[Edit]) -> Tensor:
    y = x.clone()
    for e in edits:
        cols = e.cols if e.cols is not None else slice(None)
        if e.pos is None:
            y[..., cols] = e.value(x[..., cols]).to(y.dtype)
        else:
            y[:, e.pos, cols] = e.value(x[:, e.pos, cols]).to(y.dtype)
    return y


_ACTIVE: list[nn.Module] = []  # the models with an intervention installed now


def check_free(model: nn.Module) -> None:
    """A :class:`ProbeError` if an intervention is installed on ``model`` (or a module of or
    around it) now."""
    for a in _ACTIVE:
        if a is model or any(m is model for m in a.modules()) or any(m is a for m in model.modules()):
            raise ProbeError(
                f"an intervention is already installed on this {type(model).__name__} (probe.intervene "
                "blocks do not nest, and the plain functions do not run inside one); name every "
                "edit in one probe.intervene(...) call, or run this after the block"
            )


@contextmanager
def exclusive(model: nn.Module) -> Iterator[None]:
    """Mark ``model`` as intervened on for the block; refused (:func:`check_free`) if it already is."""
    check_free(model)
    _ACTIVE.append(model)
    try:
        yield
    finally:
        _ACTIVE.remove(model)


@contextmanager
def hooked(model: nn.Module, edits: list[Edit]) -> Iterator[None]:
    """Hooks that apply ``edits`` during every forward of ``model`` run inside the block (no
    exclusivity check: see :func:`applied`)."""
    by_module: dict[int, tuple[nn.Module, dict[tuple[str, int], list[Edit]]]] = {}
    for e in edits:
        m, table = by_module.setdefault(id(e.site.module), (e.site.module, {}))
        table.setdefault((e.where, e.site.call), []).append(e)
    if not by_module:
        yield
        return
    counts: dict[int, int] = {}
    handles = [model.register_forward_pre_hook(lambda mod, args: counts.clear())]

    def pre(mod, args, _t):
        n = counts.get(id(mod), 0)
        todo = _t.get(("input", n))
        if not todo or not args:
            return None
        return (_replace(args[0], todo),) + tuple(args[1:])

    def post(mod, args, out, _t):
        n = counts.get(id(mod), 0)
        counts[id(mod)] = n + 1
        todo = _t.get(("output", n))
        if not todo:
            return None
        if isinstance(out, Tensor):
            return _replace(out, todo)
        return (_replace(out[0], todo),) + tuple(out[1:])

    for m, table in by_module.values():
        handles.append(m.register_forward_pre_hook(lambda mod, a, _t=table: pre(mod, a, _t)))
        handles.append(m.register_forward_hook(lambda mod, a, o, _t=table: post(mod, a, o, _t)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def applied(model: nn.Module, edits: list[Edit]) -> Iterator[None]:
    """:func:`hooked` for a block in which no other intervention is installed on ``model``."""
    with exclusive(model), hooked(model, edits):
        yield


@contextmanager
def recording(model: nn.Module, sites: list[tuple[Site, str]]) -> Iterator[dict[tuple[int, str], Tensor]]:
    """Keep a detached copy of each ``(site, where)`` tensor of the next forward, keyed by
    ``(index in sites, where)``."""
    got: dict[tuple[int, str], Tensor] = {}
    edits = []
    for i, (s, where) in enumerate(sites):

        def keep(x: Tensor, _i=i, _w=where) -> Tensor:
            got[(_i, _w)] = x.detach().clone()
            return x

        edits.append(Edit(s, where, None, keep))
    with applied(model, edits):
        yield got


__all__ = ["Edit", "applied", "hooked", "exclusive", "check_free", "recording"]
