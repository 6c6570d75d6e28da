"""Which block of a projection's output is which head's query, key or value: checked, not assumed.

A projection that feeds an attention (found by :mod:`probe.intervene.anatomy_flow`) is cut into
blocks of ``d_head`` output channels. Each block gets its own copy of the input in one batched
forward; in that copy a small vector is added to the block at one position ``p`` (the middle of
its sequence), and the layer's captured pattern and attention output (the output projection's
input) are compared with the unperturbed copy:

* a query block of head ``h``: only row ``p`` of head ``h``'s pattern changes;
* a key block: several rows change, in every head that reads that key head (GQA groups);
* a value block: the pattern stays the same and the output of the heads that read it changes,
  by exactly ``pattern[h, i, p] * delta`` at every query ``i`` when the block is the value
  itself (no transform between it and the head's output): then ``W_V`` can be read off it.

Blocks that change nothing in their attention are not its q/k/v (e.g. another attention's part
of a fused projection). One forward covers many layers: the batch holds one copy per block,
at most :data:`MAX_COPIES` copies and :data:`MAX_BYTES` of captured patterns per forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from probe.capture.engine import Trace
from probe.errors import ProbeError
from probe.intervene.anatomy_flow import LeafCall

MAX_COPIES = 256
MAX_BYTES = 256 << 20
SCALE = 4.0  # the added vector's norm, in units of the block's own norm at p


@dataclass
class Cand:
    """One candidate block: ``cols`` of ``leaf``'s output, perturbed in batch row ``copy``."""

    key: tuple  # (stack, layer, role)
    leaf: LeafCall
    cols: slice
    layout: str  # "batch" ([B, T, F]), "flat" ([B*T, F]), "seq" ([T, B, F])
    length: int  # the positions of the leaf's sequence
    copy: int = 0
    delta: Tensor | None = None
    found: tuple = ()  # ("q", h) | ("k", heads) | ("v", heads, exact) | ("none",) | ("unclear",)

    @property
    def pos(self) -> int:
        return self.length // 2


def layout_of(out: Any) -> tuple[str, int] | None:
    """``(layout, positions)`` of a leaf's output in a batch-1 forward, or None if not per position."""
    if not isinstance(out, Tensor) or not out.is_floating_point():
        return None
    if out.dim() == 3 and out.shape[0] == 1:
        return "batch", out.shape[1]
    if out.dim() == 3 and out.shape[1] == 1:
        return "seq", out.shape[0]
    if out.dim() == 2:
        return "flat", out.shape[0]
    return None


def _index(c: Cand) -> tuple:
    p = c.pos
    if c.layout == "batch":
        return (c.copy, p, c.cols)
    if c.layout == "seq":
        return (p, c.copy, c.cols)
    return (c.copy * c.length + p, c.cols)


def _clean_block(c: Cand) -> Tensor:
    o = c.leaf.out
    p = c.pos
    return o[0, p, c.cols] if c.layout == "batch" else o[p, 0, c.cols] if c.layout == "seq" else o[p, c.cols]


def _delta(c: Cand, seed: int) -> Tensor:
    b = _clean_block(c).detach().float()
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(b.shape[-1], generator=g)
    d = d / d.norm() * SCALE * max(b.norm().item(), 1e-2)
    return d.to(b.device)


def _hooks(model: nn.Module, cands: list[Cand], outs: dict[int, tuple]) -> list:
    """Forward hooks adding each candidate's delta, and pre-hooks recording each out site's input."""
    by_mod: dict[int, list[Cand]] = {}
    mods: dict[int, nn.Module] = {}
    for c in cands:
        by_mod.setdefault(id(c.leaf.module), []).append(c)
        mods[id(c.leaf.module)] = c.leaf.module
    seen: dict[int, int] = {}

    def add(mod, args, out):
        n = seen.get(id(mod), 0)
        seen[id(mod)] = n + 1
        mine = [c for c in by_mod[id(mod)] if c.leaf.call == n]
        if not mine:
            return None
        out = out.clone()
        for c in mine:
            out[_index(c)] += c.delta.to(out.dtype)
        return out

    got: dict[tuple, int] = {}

    def record(mod, args, _k):
        n = got.get(_k, 0)
        got[_k] = n + 1
        _m, site_call, box = outs[_k]
        if n == site_call and args and isinstance(args[0], Tensor):
            box.append(args[0].detach())

    handles = [m.register_forward_hook(add) for m in mods.values()]
    for k, (m, _call, _box) in outs.items():
        handles.append(m.register_forward_pre_hook(lambda mod, a, _k=k: record(mod, a, _k)))
    return handles


@dataclass
class Observed:
    """One attention's pattern ``[N, H, Tq, Tk]`` and attention output ``[N, Tq, H, dv]`` in a run."""

    pattern: Tensor
    z: Tensor


def classify(c: Cand, obs: Observed) -> tuple:
    """What perturbing ``c`` did to its attention (see the module docstring)."""
    dp = (obs.pattern[c.copy] - obs.pattern[0]).float()
    dz = (obs.z[c.copy] - obs.z[0]).float()
    mp, mz = dp.abs().max().item(), dz.abs().max().item()
    if mp > 1e-6:
        heads = [h for h in range(dp.shape[0]) if dp[h].abs().max().item() > 1e-3 * mp]
        rows = [i for i in range(dp.shape[1]) if dp[:, i].abs().max().item() > 1e-3 * mp]
        if len(heads) == 1 and rows == [c.pos] and dp.shape[1] == c.length:
            return ("q", heads[0])
        if len(rows) >= 2:
            return ("k", frozenset(heads))
        return ("unclear",)
    if mz > 1e-6 * (1 + obs.z[0].abs().max().item()):
        heads = [h for h in range(dz.shape[1]) if dz[:, h].abs().max().item() > 1e-3 * mz]
        a = obs.pattern[0].float()[:, :, c.pos]  # [H, Tq]: each query's weight on the key p
        exact = dz.shape[-1] == c.delta.numel()
        if exact:
            for h in heads:
                want = a[h][:, None] * c.delta.float()[None, :]
                exact &= (dz[:, h] - want).abs().max().item() <= 1e-4 * (1 + want.abs().max().item())
        return ("v", frozenset(heads), bool(exact))
    return ("none",)


def _chunks(cands: list[Cand], cost: Callable[[tuple], int]) -> list[list[Cand]]:
    """Candidates grouped into runs of at most MAX_COPIES copies and MAX_BYTES of patterns,
    whole layers at a time (``cost(key)``: one copy's pattern bytes for that attention)."""
    layers: dict[tuple, list[Cand]] = {}
    for c in cands:
        layers.setdefault(c.key[:2], []).append(c)
    chunks, cur, per_copy = [], [], 0
    for group in layers.values():
        b = sum({cost(c.key) for c in group})
        if cur and (
            len(cur) + len(group) + 1 > MAX_COPIES or (len(cur) + len(group) + 1) * (per_copy + b) > MAX_BYTES
        ):
            chunks.append(cur)
            cur, per_copy = [], 0
        cur += group
        per_copy += b
    if cur:
        chunks.append(cur)
    return chunks


@dataclass
class Perturbation:
    """How to run the model on N copies of the one input: ``make(n)`` -> a zero-argument call."""

    make: Callable[[int], Callable[[], Any]]
    sites: dict  # (stack, layer, role) -> locate's Site (the output projection)
    observed: dict = field(default_factory=dict)


def run_checks(model: nn.Module, cands: list[Cand], pert: Perturbation, heads: dict) -> None:
    """Set ``found`` on every candidate (one batched forward per chunk of layers)."""

    def cost(key):
        site = pert.sites[key]
        c = next(c for c in cands if c.key == key)
        return 4 * heads[key] * c.length * max(c.length, 1) + 4 * site.heads * site.d_head * c.length

    for chunk in _chunks(cands, cost):
        for i, c in enumerate(chunk):
            c.copy = i + 1
            c.delta = _delta(c, 1000 + i)
        keys = sorted({c.key for c in chunk}, key=str)
        outs = {k: (pert.sites[k].module, pert.sites[k].call, []) for k in keys}
        call = pert.make(len(chunk) + 1)
        t = Trace(model, layers=sorted({k[1] for k in keys}))
        handles = _hooks(model, chunk, outs)
        try:
            with torch.no_grad(), t:
                call()
        finally:
            for h in handles:
                h.remove()
        for k in keys:
            stack, layer, role = k
            pk = f"{stack}.blocks.{layer}.{role}_attn.pattern"
            box = outs[k][2]
            if pk not in t.cache or not box:
                raise ProbeError(
                    f"{stack} layer {layer}: the perturbation run did not show its {role} attention"
                )
            site = pert.sites[k]
            z = box[0]
            if z.dim() != 3:
                raise ProbeError(
                    f"{stack} layer {layer}: the input of {site.name} is not [batch, positions, heads*d_head]"
                )
            obs = Observed(t.cache[pk], z.reshape(*z.shape[:2], site.heads, site.d_head))
            for c in chunk:
                if c.key == k:
                    c.found = classify(c, obs)


__all__ = ["Cand", "Perturbation", "layout_of", "classify", "run_checks", "MAX_COPIES", "MAX_BYTES"]
