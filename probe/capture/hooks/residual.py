"""The residual stream of one layer: which tensors are the stream, which are sublayer outputs.

The watcher hands on every operation it sees inside a layer; this module follows the data flow
with labels instead of guessing from the order of ``+`` operands:

* a tensor is *stream-derived* when it is computed from the layer's input (``resid_pre``);
* its *sources* are the sublayers (the layer's child module calls) whose parameters mixed into
  it: an operation that takes a weight matrix (an ``nn.Parameter`` of two or more dimensions,
  or a slice of one) inside sublayer ``S`` adds ``S``. Norms (one-dimensional weights), dropout,
  activations, reshapes and scalings only carry labels along.

A *residual add* is an addition of two stream-sized tensors (``[..., d_model]`` with the
stream's number of elements, so ``[b·t, d]`` views count) where one operand is the stream (no
sources) and the other is a sublayer output (some sources); its result is the stream again.
Two sublayer outputs added together (parallel attention + MLP, expert sums, shared experts)
form a *combination* whose parts are remembered, so a later residual add can split it.

:func:`probe.capture.hooks.deltas.decompose` turns the residual adds into verified deltas.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

EMPTY: frozenset[int] = frozenset()
# the sublayer an op runs in (a key into the layer's calls, or None), asked only when needed
Source = Callable[[], "int | None"]
_NO_LABEL = (False, EMPTY)
ADD = {torch.add, Tensor.add, Tensor.__add__, Tensor.__radd__}
ADD_INPLACE = {Tensor.add_, Tensor.__iadd__}
# tensors whose values do not depend on their input's (only its shape): never the stream
FRESH = {
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
    torch.rand_like,
    torch.randn_like,
    torch.randint_like,
    Tensor.new_zeros,
    Tensor.new_ones,
    Tensor.new_empty,
    Tensor.new_full,
    Tensor.new_tensor,
}
# a stream times (or over) a constant is not the stream a sublayer hands on (DeepNorm's α·x + f(x))
SCALE = {torch.mul, Tensor.mul, Tensor.__mul__, Tensor.__rmul__, torch.div, Tensor.div, Tensor.__truediv__}


class ByIdentity:
    """A map keyed by tensor identity that cannot be fooled by a recycled ``id()``.

    (Tensors compare elementwise, so they cannot be dict keys; an ``id`` outlives its tensor.)
    """

    def __init__(self) -> None:
        self._items: dict[int, tuple[Any, Any]] = {}

    def get(self, t: Any) -> Any:
        held = self._items.get(id(t))
        return held[1] if held is not None and held[0]() is t else None

    def put(self, t: Tensor, value: Any) -> None:
        self._items[id(t)] = (weakref.ref(t), value)

    def clear(self) -> None:
        self._items.clear()


@dataclass
class ResidualAdd:
    """One ``stream + sublayer output``, flattened to ``[n, d_model]``.

    The tensors are the model's own (copied only where an in-place add overwrites one); their
    versions at the add are kept so that a later in-place write is noticed, never silently read.
    """

    stream: Tensor
    added: Tensor
    result: Tensor
    sources: frozenset[int]
    parts: list[tuple[frozenset[int], Tensor]] | None
    versions: tuple[int, ...] = ()
    base: Tensor | None = None  # the stream before a constant rescaled it into ``stream``

    def held(self) -> tuple[Tensor, ...]:
        return (self.stream, self.added, self.result) + ((self.base,) if self.base is not None else ())

    def intact(self) -> bool:
        return self.versions == tuple(t._version for t in self.held())


def _is_param(t: Tensor) -> bool:
    """``isinstance(t, nn.Parameter)`` without the metaclass's Python check for plain tensors and
    parameters (the common cases); other subclasses ask it (custom tensors flagged ``_is_param``)."""
    cls = type(t)
    if cls is nn.Parameter:
        return True
    if cls is Tensor:
        return bool(getattr(t, "_is_param", False))
    return isinstance(t, nn.Parameter)


def _outputs(out: Any):
    if isinstance(out, Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for t in out:
            if isinstance(t, Tensor):
                yield t


class LayerStream:
    """Labels and residual adds of one layer call whose input is ``pre`` (``[..., d_model]``)."""

    def __init__(self, pre: Tensor) -> None:
        self.pre = pre.detach().clone()
        # the tensor the copy was taken from and its version then: a residual add whose stream is
        # that memory, unchanged since, holds the copy's values (decompose skips comparing them)
        self.origin, self.origin_version = pre.detach(), pre._version
        self.shape = pre.shape
        self.numel = pre.numel()
        self.width = pre.shape[-1]
        self.labels = ByIdentity()  # tensor -> (stream-derived, sources)
        self.labels.put(pre, (True, EMPTY))
        self.combos = ByIdentity()  # sum of sublayer outputs -> its parts
        self.scaled = ByIdentity()  # stream times a constant -> the stream before it
        self.adds: list[ResidualAdd] = []
        self.touched: set[int] = set()  # sources whose output reached a stream-sized tensor

    # -- labels --------------------------------------------------------------------------------
    def sized(self, t: Any) -> bool:
        """Whether ``t`` holds one value per stream element (the stream or a view of it)."""
        return (
            isinstance(t, Tensor)
            and not t.is_nested
            and t.dim() > 0
            and t.shape[-1] == self.width
            and t.numel() == self.numel
            and t.is_floating_point()
        )

    def label(self, t: Any) -> tuple[bool, frozenset[int]]:
        lab = self.labels.get(t)
        return lab if lab is not None else _NO_LABEL

    def _inputs_label(self, args: tuple, kwargs: dict, source: Source) -> tuple[bool, frozenset[int]]:
        # runs for every op inside a layer: plain loops, and the cheap type tests first; the
        # sublayer running is looked up (a walk up the call stack) only for an op with a weight
        stream, sources, weight = False, EMPTY, False
        for v in itertools.chain(args, kwargs.values()) if kwargs else args:
            if isinstance(v, Tensor):
                group = (v,)
            elif isinstance(v, (tuple, list)):  # tensors one level down (torch.cat's list)
                group = v
            else:
                continue
            for t in group:
                if not isinstance(t, Tensor):
                    continue
                if _is_param(t):
                    weight = weight or t.dim() >= 2
                    continue
                lab = self.labels.get(t)
                if lab is not None:
                    stream = stream or lab[0]
                    if lab[1] and lab[1] is not sources:
                        sources = lab[1] if not sources else sources | lab[1]
        if weight:
            src = source()
            if src is not None and src not in sources:
                sources = sources | {src}
        return stream, sources

    def after_op(self, func: Any, args: tuple, kwargs: dict, out: Any, source: Source) -> None:
        """Label what an operation inside the layer produced (``source()``: the sublayer it ran in)."""
        if func in FRESH:
            return  # BLOOM's zeros_like(residual), summed into: not the stream, not a sublayer output
        if isinstance(out, Tensor):
            outs = [out]
        elif isinstance(out, (tuple, list)):
            outs = list(_outputs(out))
        elif func is Tensor.__setitem__ and args and isinstance(args[0], Tensor):
            outs = [args[0]]  # written in place
        else:
            return  # sizes, flags, numbers: nothing to label
        if not outs:
            return
        lab = self._inputs_label(args, kwargs, source)
        if not lab[0] and not lab[1]:
            return
        if func in SCALE and lab == (True, EMPTY) and len(outs) == 1 and self.sized(outs[0]):
            self._note_scaled(args, outs[0])
        for o in outs:
            self.labels.put(o, lab)
            if lab[1] and not lab[1] <= self.touched and self.sized(o):
                self.touched |= lab[1]

    def _note_scaled(self, args: tuple, out: Tensor) -> None:
        # ``stream * c`` or ``stream / c`` with c a number or a 0-d tensor: remember the stream
        # it came from, which is the value the previous sublayer handed on
        if len(args) != 2:
            return
        t, c = args
        if not isinstance(t, Tensor) or isinstance(c, Tensor) and c.dim() != 0:
            t, c = c, t
        if not (isinstance(t, Tensor) and self.sized(t)) or isinstance(c, Tensor) and c.dim() != 0:
            return
        if not isinstance(c, (int, float, Tensor)) or self.label(t) != (True, EMPTY):
            return
        base = self.scaled.get(t)
        self.scaled.put(out, t if base is None else base)

    def mark(self, t: Any, stream: bool, source: int) -> None:
        """Label ``t``, an output computed where the tracer could not watch (a fused kernel)."""
        if isinstance(t, Tensor) and self.labels.get(t) is None:
            self.labels.put(t, (stream, frozenset((source,))))
            if self.sized(t):
                self.touched.add(source)

    def _parts(self, t: Tensor, sources: frozenset[int], copy: bool) -> list[tuple[frozenset[int], Tensor]]:
        held = self.combos.get(t)
        if held is not None:
            return list(held)
        flat = t.detach().reshape(-1, self.width)
        return [(sources, flat.clone() if copy else flat)]

    # -- additions -----------------------------------------------------------------------------
    def on_add(self, func: Any, args: tuple, kwargs: dict, source: Source) -> Any:
        """Run the addition ``func(*args, **kwargs)`` and record it if it touches the stream."""
        a = args[0] if args else kwargs.get("input")
        b = args[1] if len(args) > 1 else kwargs.get("other")
        if not (self.sized(a) and self.sized(b)) or kwargs.get("alpha", 1) != 1:
            out = func(*args, **kwargs)
            self.after_op(func, args, kwargs, out, source)
            return out
        (sa, srca), (sb, srcb) = self.label(a), self.label(b)
        if srca and srcb:
            # two sublayer outputs summed before they meet the stream: keep the parts apart
            inplace = func in ADD_INPLACE  # Falcon's `mlp_output += attention_output`
            parts = self._parts(a, srca, inplace) + self._parts(b, srcb, False)
            out = func(*args, **kwargs)
            self.labels.put(out, (sa or sb, srca | srcb))
            self.combos.put(out, parts)
            return out
        if sa and not srca and srcb:
            stream, added, sources = a, b, srcb
        elif sb and not srcb and srca:
            stream, added, sources = b, a, srca
        else:
            out = func(*args, **kwargs)
            self.after_op(func, args, kwargs, out, source)
            return out
        w = self.width
        held = self.combos.get(added)
        overwritten = a if func in ADD_INPLACE else None  # an in-place add overwrites its first operand
        s_val = stream.detach().reshape(-1, w)
        c_val = added.detach().reshape(-1, w)
        s_val = s_val.clone() if stream is overwritten else s_val
        c_val = c_val.clone() if added is overwritten else c_val
        out = func(*args, **kwargs)
        r_val = out.detach().reshape(-1, w)
        rec = ResidualAdd(s_val, c_val, r_val, sources, list(held) if held is not None else None)
        base = self.scaled.get(stream)
        if base is not None:
            rec.base = base.detach().reshape(-1, w)
        rec.versions = tuple(t._version for t in rec.held())
        self.labels.put(out, (True, EMPTY))
        self.adds.append(rec)
        return out

    # -- deltas --------------------------------------------------------------------------------
