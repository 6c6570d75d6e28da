"""Where a circuit's nodes and targets are in the model, and the hooks that read and steer them.

Built from the model's anatomy (:mod:`probe.intervene.anatomy`), nothing per architecture:

* **node outputs**: the ``input`` node is the stream entering the first layer (the first argument
  of its layer module); head ``h``'s write is ``z_h @ W_O^h`` with ``z`` the input of the
  attention's output projection (head ``h``: columns ``h*d_head:(h+1)*d_head``); an MLP's output
  is its output leaf's output;
* **targets**: the stream ``x`` each group of targets reads (the input of its norm, or of its
  projections when it reads the stream itself); query/key/value target ``t`` is the block
  ``norm(x) @ W[:, cols] + b[cols]`` of its projection; an MLP reads ``norm(x)`` through its
  readers (gate/up/...); the logits read the stream the last layer returns (whatever the model
  does with it next: final norm, unembedding, a classifier on one position).

A :class:`Run` is one forward with hooks: it records every node's output (unless told not to),
and optionally

* **deviates** targets: target ``t`` reads ``x + dev_t`` instead of ``x`` (its block or its
  readers' input recomputed from it), ``dev`` given per group by a function of the run so far
  (evaluation, patching and path patching are all this);
* **interpolates** the input: the stream entering the first layer becomes
  ``corrupt + alpha * (x - corrupt)`` (EAP-IG);
* keeps what the **gradients** need: each projection's output and an alias of each MLP reader's
  and the final module's input, so ``dM/d(target input)`` through that target alone follows by
  ``g @ W[:, cols].T`` and the norm's vector-Jacobian product at the run's own ``x``
  (:meth:`Wiring.target_grads`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from probe.errors import ProbeError
from probe.intervene.circuit.graph import Graph


@dataclass
class Block:
    """One target's columns in a projection's output, as ``y @ W + b`` (``y``: the normed stream)."""

    target: int
    cols: slice
    W: Tensor  # [d_in, cols]
    b: Tensor | None


@dataclass
class Proj:
    module: nn.Module
    blocks: list[Block]


@dataclass
class Group:
    """Targets that read one stream through one norm: a layer's attention, its MLP, or the logits."""

    kind: str  # "attn" | "mlp" | "logits"
    layer: int
    norm: nn.Module | None
    targets: list[int]
    upstream: int  # nodes [0, upstream) feed these targets
    projs: list[Proj] = field(default_factory=list)  # attention: q/k/v projections
    readers: list[nn.Module] = field(default_factory=list)  # MLP readers (logits: none, see Wiring.exit)
    form: Any = None  # the norm's affine form (FrozenNorm) where the anatomy found one


@dataclass
class Writer:
    """Where nodes ``start ..`` get their outputs: an attention's output projection (its input,
    split by head, times ``W_O`` ``[heads, d_head, d]``) or an MLP's output leaf."""

    kind: str  # "heads" | "mlp"
    layer: int
    module: nn.Module
    start: int
    W_O: Tensor | None = None
    bias: Tensor | None = None


@dataclass
class Wiring:
    """The model's parts for the circuit graph ``graph`` (see the module docstring)."""

    graph: Graph
    entry: nn.Module  # its first argument is the stream entering the first layer
    writers: list[Writer]
    groups: list[Group]
    exit: nn.Module | None = None  # the last layer: its output is the stream the logits read

    def constants(self, group: Group) -> Tensor | float:
        """The part of the stream entering ``group`` that no node writes: the output biases of the
        attentions before it (head writes exclude them)."""
        total: Tensor | float = 0.0
        for w in self.writers:
            if w.kind == "heads" and w.bias is not None and w.start < group.upstream:
                total = total + w.bias.float()
        return total


Deviate = Callable[["Run", int], "dict[int, Tensor] | None"]


class Run:
    """One forward's hooks (see the module docstring): ``values`` ``[(start, [k, B, T, d])]`` node
    outputs in order, ``streams`` ``{group: x}``, and the kept tensors ``slots`` for gradients."""

    def __init__(
        self,
        wiring: Wiring,
        *,
        deviate: Deviate | None = None,
        interpolate: tuple[Tensor, float] | None = None,
        grads: bool = False,
        record: bool = True,
    ) -> None:
        self.wiring, self.deviate, self.interpolate, self.grads = wiring, deviate, interpolate, grads
        self.record = record  # False: the heads' and MLPs' outputs are not kept (EAP-IG's later steps)
        self.values: list[tuple[int, Tensor]] = []
        self.streams: dict[int, Tensor] = {}
        self.slots: list[Tensor] = []
        self.slot_index: dict[tuple[int, int], int] = {}
        self.entry_leaf: Tensor | None = None
        self._devs: dict[int, dict[int, Tensor] | None] = {}
        self._normed: dict[int, Tensor] = {}
        self._calls: dict[int, int] = {}

    # -- values -------------------------------------------------------------------------------
    def value_groups(self, upstream: int) -> list[tuple[int, Tensor]]:
        """The recorded node-output groups that lie before node ``upstream``."""
        return [(s, v) for s, v in self.values if s < upstream]

    def stacked(self) -> Tensor:
        """All node outputs ``[nodes, B, T, d]``."""
        return torch.cat([v for _, v in self.values], 0)

    def _once(self, module: nn.Module, what: str) -> None:
        n = self._calls.get(id(module), 0) + 1
        self._calls[id(module)] = n
        if n > 1:
            raise ProbeError(f"{what} ran twice in one forward; circuits need every part to run once")

    # -- hooks ---------------------------------------------------------------------------------
    def _entry(self, mod, args, kwargs):
        self._once(mod, "the first layer")
        x = args[0]
        if self.interpolate is not None:
            corrupt, alpha = self.interpolate
            x = corrupt.to(x.dtype) + alpha * (x.detach() - corrupt.to(x.dtype))
        if self.grads:
            x = x.detach().requires_grad_(True)
            self.entry_leaf = x
        self.values.append((0, x.detach().float().unsqueeze(0)))
        return (x, *args[1:]), kwargs

    def _writer(self, w: Writer):
        if w.kind == "heads":

            def pre(mod, args):
                self._once(mod, f"layer {w.layer}'s attention output projection")
                if not self.record:
                    return
                z = args[0].detach().float()
                H, dh, d = w.W_O.shape
                zh = z.reshape(-1, H, dh).transpose(0, 1)  # [H, B*T, dh]
                writes = torch.bmm(zh, w.W_O.float()).reshape(H, *z.shape[:-1], d)
                self.values.append((w.start, writes))

            return w.module.register_forward_pre_hook(pre)

        def post(mod, args, out):
            self._once(mod, f"layer {w.layer}'s MLP output")
            if self.record:
                self.values.append((w.start, out.detach().float().unsqueeze(0)))

        return w.module.register_forward_hook(post)

    def _devs_of(self, gi: int) -> dict[int, Tensor] | None:
        if self.deviate is None:
            return None
        if gi not in self._devs:
            self._devs[gi] = self.deviate(self, gi)
        return self._devs[gi]

    def _normed_dev(self, gi: int, g: Group, dev: Tensor) -> Tensor:
        x = self.streams[gi]
        y = x + dev.to(x.dtype)
        return g.norm.forward(y) if g.norm is not None else y

    def _hooks_for(self, gi: int, g: Group) -> list:
        hs = []
        if g.norm is not None:

            def norm_pre(mod, args):
                self.streams[gi] = args[0]

            hs.append(g.norm.register_forward_pre_hook(norm_pre))
        if g.kind == "attn":
            for pi, p in enumerate(g.projs):
                hs.append(p.module.register_forward_hook(self._proj_hook(gi, g, pi, p)))
        elif g.kind == "logits":
            hs.append(self.wiring.exit.register_forward_hook(self._exit_hook(gi, g)))
        else:
            for ri, r in enumerate(g.readers):
                hs.append(r.register_forward_pre_hook(self._reader_hook(gi, g, ri)))
        return hs

    def _proj_hook(self, gi: int, g: Group, pi: int, p: Proj):
        def post(mod, args, out):
            if g.norm is None:
                self.streams[gi] = args[0]
            devs = self._devs_of(gi)
            if devs:
                out = out.clone()
                for blk in p.blocks:
                    if blk.target in devs:
                        y = self._normed_dev(gi, g, devs[blk.target]).float()
                        new = y @ blk.W.float() + (blk.b.float() if blk.b is not None else 0.0)
                        out[..., blk.cols] = new.to(out.dtype)
            if self.grads:
                self.slot_index[(gi, pi)] = len(self.slots)
                self.slots.append(out)
            return out

        return post

    def _reader_hook(self, gi: int, g: Group, ri: int):
        def pre(mod, args):
            x = args[0]
            if g.norm is None:
                self.streams[gi] = x
            devs = self._devs_of(gi)
            if devs and g.targets[0] in devs:
                if gi not in self._normed:
                    self._normed[gi] = self._normed_dev(gi, g, devs[g.targets[0]])
                x = self._normed[gi].to(x.dtype)
            if self.grads:
                x = x.view_as(x)
                self.slot_index[(gi, ri)] = len(self.slots)
                self.slots.append(x)
            return (x, *args[1:])

        return pre

    def _exit_hook(self, gi: int, g: Group):
        def post(mod, args, out):
            x = out[0] if isinstance(out, (tuple, list)) else out
            self.streams[gi] = x
            devs = self._devs_of(gi)
            if devs and g.targets[0] in devs:
                x = x + devs[g.targets[0]].to(x.dtype)
            if self.grads:
                x = x.view_as(x)
                self.slot_index[(gi, 0)] = len(self.slots)
                self.slots.append(x)
            if isinstance(out, tuple):
                return (x, *out[1:])
            if isinstance(out, list):
                return [x, *out[1:]]
            return x

        return post

    @contextlib.contextmanager
    def hooked(self):
        """The hooks on the model for the duration of one forward."""
        w = self.wiring
        hs = [w.entry.register_forward_pre_hook(self._entry, with_kwargs=True)]
        try:
            hs += [self._writer(x) for x in w.writers]
            for gi, g in enumerate(w.groups):
                hs += self._hooks_for(gi, g)
            yield self
        finally:
            for h in hs:
                h.remove()


def run_forward(run: Run, call: Callable[[], Any]) -> Any:
    """``call()`` under ``run``'s hooks (with gradients enabled when ``run.grads``)."""
    ctx = torch.enable_grad() if run.grads else torch.no_grad()
    with ctx, run.hooked():
        return call()


__all__ = ["Wiring", "Group", "Writer", "Proj", "Block", "Run", "run_forward"]
