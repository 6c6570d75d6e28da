"""The data flow inside every layer call: which weighted modules feed each attention's q, k and v.

One forward of the unmodified model under a :class:`torch.overrides.TorchFunctionMode`. Inside a
layer call every weighted leaf module (a 2-D ``weight``: ``nn.Linear``, transformers' ``Conv1D``)
tags its output with its own name; every torch op's output carries the union of its inputs' tags.
At each attention op the tags say where its inputs came from:

* SDPA / ``flex_attention``: argument 0 is the query, 1 the key, 2 the value;
* eager attention: the matmul whose output reaches a softmax has the query's tags on its first
  operand and the key's on its second; the matmul whose first operand is that softmax's output
  (the pattern) has the value's tags on its second.

Tags are local to a layer call (cleared when one starts), so a tag names a module of that layer.
Besides the tags the scan records every submodule call of the layer (its first input and its
output: where the norms are found) and every leaf call outside the layers (where the read-out is
found, as the logit lens does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from probe.capture.hooks.record import FLEX, SDPA, SOFTMAX

_MATMUL = frozenset("matmul __matmul__ bmm einsum baddbmm addbmm".split())
_ADD_FIRST = frozenset("baddbmm addbmm".split())  # their first argument is added, not multiplied
NONE: frozenset = frozenset()


@dataclass
class _Info:
    t: Tensor
    tags: frozenset
    qk: tuple | None = None  # (query tags, key tags, query width) of a q @ k product
    pattern: bool = False


@dataclass
class AttnOp:
    """One attention op inside a layer call: the tags of its query, key and value inputs."""

    kind: str  # "sdpa" | "eager"
    q: frozenset
    k: frozenset
    v: frozenset = NONE
    d_qk: int = 0
    index: int = 0  # its place in the layer call's events


@dataclass
class LeafCall:
    """One call of a weighted leaf module inside a layer call."""

    name: str
    module: nn.Module
    call: int  # which call of this module in the whole forward
    x: Any
    out: Any
    index: int = 0


@dataclass
class ModCall:
    """One call of any submodule of a layer: its first positional input and its output."""

    name: str
    module: nn.Module
    x: Any
    out: Any


@dataclass
class LayerFlow:
    """What one layer call did: attention ops, weighted leaf calls and all submodule calls, in order."""

    path: str
    module: nn.Module
    args: tuple
    kwargs: dict
    ops: list[AttnOp] = field(default_factory=list)
    leaves: list[LeafCall] = field(default_factory=list)
    mods: list[ModCall] = field(default_factory=list)
    count: int = 0  # events so far (orders ops and leaves)


def _flat(x: Any) -> list[Tensor]:
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for a in x for t in _flat(a)]
    return []


def weighted_leaf(m: nn.Module) -> bool:
    """A module with a 2-D ``weight`` and no children (``nn.Linear``, ``Conv1D``, ``nn.Embedding``)."""
    w = getattr(m, "weight", None)
    return isinstance(w, Tensor) and w.dim() == 2 and not list(m.children())


class _Flow(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.info: dict[int, _Info] = {}
        self.layer: LayerFlow | None = None

    def get(self, t: Any) -> _Info | None:
        got = self.info.get(id(t)) if isinstance(t, Tensor) else None
        return got if got is not None and got.t is t else None

    def tags(self, t: Any) -> frozenset:
        got = self.get(t)
        return got.tags if got else NONE

    def set(self, out: Any, tags: frozenset, qk=None, pattern=False) -> None:
        if tags or qk or pattern:
            for t in _flat(out):
                self.info[id(t)] = _Info(t, tags, qk, pattern)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.layer is None:
            return out
        ins = _flat(list(args)) + _flat(list(kwargs.values()))
        infos = [i for i in (self.get(t) for t in ins) if i is not None]
        tags = frozenset().union(*(i.tags for i in infos)) if infos else NONE
        name = getattr(func, "__name__", "")
        if func is SDPA or (FLEX is not None and func is FLEX):
            q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")])[:3]
            if not isinstance(q, Tensor):
                q, k, v = (kwargs.get(n) for n in ("query", "key", "value"))
            self._op(AttnOp("sdpa", self.tags(q), self.tags(k), self.tags(v), q.shape[-1]))
            self.set(out, tags)
        elif func in SOFTMAX:
            qk = [i.qk for i in infos if i.qk]
            if qk:
                q = frozenset().union(*(a for a, _, _ in qk))
                k = frozenset().union(*(b for _, b, _ in qk))
                self._op(AttnOp("eager", q, k, NONE, qk[0][2]))
            self.set(out, tags, None, bool(qk))
        elif name in _MATMUL:
            ops = [t for t in ins if t.dim() >= 1]
            ops = ops[1:] if name in _ADD_FIRST else ops
            a = self.get(ops[0]) if ops else None
            if a is not None and a.pattern and len(ops) > 1:
                self._value(self.tags(ops[1]))
                self.set(out, tags)
            elif len(ops) > 1 and (self.tags(ops[0]) or self.tags(ops[1])):
                self.set(out, tags, (self.tags(ops[0]), self.tags(ops[1]), ops[0].shape[-1]))
            else:
                self.set(out, tags)
        else:
            qk = [i.qk for i in infos if i.qk]
            merged = None
            if qk:
                merged = (
                    frozenset().union(*(a for a, _, _ in qk)),
                    frozenset().union(*(b for _, b, _ in qk)),
                    qk[0][2],
                )
            self.set(out, tags, merged, any(i.pattern for i in infos))
        return out

    def _op(self, op: AttnOp) -> None:
        op.index = self.layer.count
        self.layer.count += 1
        self.layer.ops.append(op)

    def _value(self, v: frozenset) -> None:
        """The value of the latest eager attention op without one (pattern @ v)."""
        for op in reversed(self.layer.ops):
            if op.kind == "eager" and not op.v:
                op.v = v
                return


@dataclass
class Flow:
    """The whole scan: each layer call's :class:`LayerFlow` in run order, the leaf calls outside
    the layers (``outside``: objects with ``name``/``module``/``input``/``output``, as
    :func:`probe.analysis.residual.head.find_readout` reads them) and the model's outputs."""

    layers: list[LayerFlow]
    outside: list
    outputs: Any


@dataclass
class _Outside:
    name: str
    module: nn.Module
    input: Any
    output: Any
    order: int

    @property
    def x(self) -> Any:
        return self.input

    @property
    def out(self) -> Any:
        return self.output


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, (tuple, list)) and x else x


def scan_flow(model: nn.Module, run, layer_paths: set[str]) -> Flow:
    """Run ``run()`` once under the tagging mode (see the module docstring)."""
    mode = _Flow()
    flows: list[LayerFlow] = []
    outside: list = []
    counts: dict[int, int] = {}
    depth = {"n": 0}
    handles = []
    inner: set[str] = set()
    for path in layer_paths:
        inner |= {f"{path}.{n}" for n, _ in model.get_submodule(path).named_modules() if n}

    def enter(mod, args, kwargs, _p):
        depth["n"] += 1
        if depth["n"] == 1:
            mode.info.clear()
            mode.layer = LayerFlow(_p, mod, args, dict(kwargs))
            flows.append(mode.layer)

    def leave(mod, args, out, _p):
        depth["n"] -= 1
        if depth["n"] == 0:
            mode.layer = None
            mode.info.clear()

    def leaf(mod, args, out, _n):
        n = counts.get(id(mod), 0)
        counts[id(mod)] = n + 1
        if mode.layer is None:
            if not list(mod.children()):
                outside.append(_Outside(_n, mod, args[0] if args else None, _first(out), len(outside)))
            return
        if weighted_leaf(mod):
            lay = mode.layer
            lay.leaves.append(LeafCall(_n, mod, n, args[0] if args else None, out, lay.count))
            lay.count += 1
            mode.set(out, frozenset({_n}))
        mode.layer.mods.append(ModCall(_n, mod, args[0] if args else None, _first(out)))

    for name, m in model.named_modules(remove_duplicate=False):
        if name in layer_paths:
            handles.append(
                m.register_forward_pre_hook(
                    lambda mod, a, kw, _p=name: enter(mod, a, kw, _p), with_kwargs=True
                )
            )
            handles.append(m.register_forward_hook(lambda mod, a, o, _p=name: leave(mod, a, o, _p)))
        elif name in inner or not list(m.children()):
            handles.append(m.register_forward_hook(lambda mod, a, o, _n=name: leaf(mod, a, o, _n)))
    try:
        with torch.no_grad(), mode:
            outputs = run()
    finally:
        for h in handles:
            h.remove()
    return Flow(flows, outside, outputs)


__all__ = ["AttnOp", "LeafCall", "ModCall", "LayerFlow", "Flow", "scan_flow", "weighted_leaf"]
