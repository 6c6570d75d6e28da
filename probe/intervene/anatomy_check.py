"""Which block of a projection's output is which head's query, key or value: checked, not assumed.

A projection that feeds an attention (found by :mod:`probe.intervene.anatomy_flow`) is cut into
blocks of ``d_head`` output channels. Each block gets its own copy of the input in one batched
run of its layer; in that copy a vector is added to the block at one position ``p`` (the middle
of its sequence), and each head's output (the output projection's input ``z``) is compared with
an unperturbed copy, change by change (a second unperturbed copy gives the noise floor, zero on
a CPU):

* a value block of the heads ``S``: their outputs change by ``pattern[h, i, p] * delta`` at every
  query ``i``, a multiple of ``delta`` (checked to 1e-3 on the changes of at least 1e-2 of the
  largest): the block reaches the heads' outputs as it is, so ``W_V`` can be read off it;
* a query block of head ``h``: only head ``h``'s output at row ``p`` changes;
* a key block: the output of every head that reads it changes (GQA groups), at several rows.

Blocks that change nothing in their attention are not its q/k/v (e.g. another attention's part
of a fused projection). The layer runs alone, on copies of the arguments it got in the scan
(``N`` copies: ``N`` times one layer); where that does not reproduce the scan's output (a layer
that reads state its arguments do not carry) the whole model runs on ``N`` copies of the input
instead, stopped once the layers checked have run, at most :data:`MAX_COPIES` copies a forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from probe.errors import ProbeError
from probe.intervene.anatomy_flow import LayerFlow, LeafCall

MAX_COPIES = 256
SCALE = 16.0  # the added vector's norm, in units of the block's own norm at p (values are linear in it)


@dataclass
class Cand:
    """One candidate block: ``cols`` of ``leaf``'s output, perturbed in batch row ``copy``."""

    key: tuple  # (stack, layer, role)
    leaf: LeafCall
    cols: slice
    layout: str  # "batch" ([B, T, F]), "flat" ([B*T, F]), "seq" ([T, B, F])
    length: int  # the positions of the leaf's sequence
    local: int = 0  # which call of the leaf's module within its layer call
    copy: int = 0
    delta: Tensor | None = None
    found: tuple = ()  # ("q", h) | ("k", heads) | ("v", heads, exact) | ("none",) | ("unclear",)
    at: int | None = None  # the perturbed position: the middle unless a faint change moved it

    @property
    def pos(self) -> int:
        return self.length // 2 if self.at is None else self.at


@dataclass
class Job:
    """One layer call's checks: its flow, candidate blocks and the output projections watched
    (``outs[key] = (module, global call, call within the layer)``)."""

    flow: LayerFlow
    cands: list[Cand]
    outs: dict[tuple, tuple[nn.Module, int, int]]
    clean: dict[tuple, Tensor]  # each watched projection's input in the scan
    heads: dict[tuple, int]  # each attention's head count
    z: dict[tuple, Tensor] = field(default_factory=dict)


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


def _delta(c: Cand, seed: int) -> Tensor:
    o, p = c.leaf.out, c.pos
    b = o[0, p, c.cols] if c.layout == "batch" else o[p, 0, c.cols] if c.layout == "seq" else o[p, c.cols]
    b = b.detach().float()
    d = torch.randn(b.shape[-1], generator=torch.Generator().manual_seed(seed))
    return (d / d.norm() * SCALE * max(b.norm().item(), 1e-2)).to(b.device)


def _repeat(x: Any, n: int) -> Any:
    """``x`` with every tensor of batch 1 repeated ``n`` times along its first dim."""
    if isinstance(x, Tensor):
        return x.repeat(n, *([1] * (x.dim() - 1))) if x.dim() and x.shape[0] == 1 else x
    if isinstance(x, (tuple, list)):
        return type(x)(_repeat(a, n) for a in x)
    if isinstance(x, dict):
        return {k: _repeat(v, n) for k, v in x.items()}
    if hasattr(x, "get_seq_length"):  # a KV cache the scan's forward filled: the copies start without
        return None
    return x


class _Done(Exception):
    """Raised by a hook to stop a forward once every watched projection has run."""


def _hooks(jobs: list[Job], local: bool, stop: bool) -> list:
    """Hooks adding each candidate's delta to its leaf's output and recording each watched
    projection's input; calls counted within a layer call (``local``) or the whole forward."""
    cands = [c for j in jobs for c in j.cands]
    by_mod: dict[int, list[Cand]] = {}
    mods: dict[int, nn.Module] = {}
    for c in cands:
        by_mod.setdefault(id(c.leaf.module), []).append(c)
        mods[id(c.leaf.module)] = c.leaf.module
    seen: dict[int, int] = {}

    def add(mod, args, out):
        n = seen.get(id(mod), 0)
        seen[id(mod)] = n + 1
        mine = [c for c in by_mod[id(mod)] if (c.local if local else c.leaf.call) == n]
        if not mine:
            return None
        out = out.clone()
        for c in mine:
            out[_index(c)] += c.delta.to(out.dtype)
        return out

    watched = [(j, k, m, lc if local else gc) for j in jobs for k, (m, gc, lc) in j.outs.items()]
    counts: dict[int, int] = {}

    def record(mod, args):
        n = counts.get(id(mod), 0)
        counts[id(mod)] = n + 1
        for j, k, m, call in watched:
            if m is mod and call == n and args and isinstance(args[0], Tensor):
                j.z[k] = args[0].detach()
        if stop and all(k in j.z for j, k, _, _ in watched):
            raise _Done

    handles = [m.register_forward_hook(add) for m in mods.values()]
    handles += [m.register_forward_pre_hook(record) for m in {id(w[2]): w[2] for w in watched}.values()]
    return handles


def _run(jobs: list[Job], call: Callable[[], Any], local: bool, stop: bool) -> None:
    for j in jobs:
        j.z.clear()
    handles = _hooks(jobs, local, stop)
    try:
        with torch.no_grad():
            call()
    except _Done:
        pass
    finally:
        for h in handles:
            h.remove()


def _reproduces(job: Job) -> bool:
    """Whether copy 0 of the run gave the scan's projection inputs (a layer run alone may not)."""
    for k, clean in job.clean.items():
        z = job.z.get(k)
        if z is None or z.shape[1:] != clean.shape[1:] or z.dim() < 2:
            return False
        a, b = z[:1].float(), clean.float()
        if (a - b).abs().max().item() > 1e-5 * (1 + b.abs().max().item()):
            return False
    return True


def _alone(job: Job) -> bool:
    """Run the job's layer alone on copies of its scan arguments; whether that reproduced the scan."""
    n = len(job.cands) + 2
    f = job.flow
    args, kwargs = _repeat(f.args, n), _repeat(f.kwargs, n)
    try:
        _run([job], lambda: f.module(*args, **kwargs), local=True, stop=False)
    except Exception:  # a layer that cannot run alone on copies: the whole model runs instead
        return False
    return _reproduces(job)


def _chunks(jobs: list[Job]) -> list[list[Job]]:
    out, cur = [], []
    for j in jobs:
        if cur and sum(len(x.cands) for x in cur) + len(j.cands) + 2 > MAX_COPIES:
            out.append(cur)
            cur = []
        cur.append(j)
    return out + ([cur] if cur else [])


def run_checks(jobs: list[Job], make: Callable[[int], Callable[[], Any]]) -> None:
    """Set ``found`` on every candidate; ``make(n)`` runs the whole model on ``n`` copies."""
    whole = []
    for job in jobs:
        for i, c in enumerate(job.cands):
            c.copy = i + 1
            c.delta = _delta(c, 1000 + i)
        if not _alone(job):
            whole.append(job)
    for chunk in _chunks(whole):
        base = 0
        for job in chunk:  # copies numbered across the chunk; one clean copy 0, one control last
            for c in job.cands:
                base += 1
                c.copy = base
        try:
            _run(chunk, make(base + 2), local=False, stop=True)
            why = ""
        except Exception as err:  # noqa: BLE001 - the model refused copies of its input: said per attention
            why = f"the model did not run on copies of the input ({type(err).__name__}: {err})".split("\n")[0]
        for job in chunk:
            if why or not _reproduces(job):
                for c in job.cands:
                    c.found = ("failed", why or "copies of the input did not reproduce its attention output")
                job.z.clear()
    for job in jobs:
        for k, z in job.z.items():
            _classify_all(job, k, z)
    _retry_faint(jobs, make)


RETRIES = ((None, 16.0), (0, 1.0))  # (position, scale factor): louder at the middle, then the first


def _retry_faint(jobs: list[Job], make: Callable[[int], Callable[[], Any]]) -> None:
    """Blocks that changed nothing, or too little to tell a value from a key, are perturbed again:
    heads that put all their weight on one token (a sink, the first token) hide their other
    positions. First 16 times louder at the middle (a query or key then moves the softmax), then
    at the first position, which every query of a causal attention reads (a value or key there
    shows). Still unsure, a faint block is read as before (a change at several rows: a key), a
    silent one as not part of this attention and an unclear one is refused."""
    for at, louder in RETRIES:
        again = [j for j in jobs if any(_unsure(c.found) for c in j.cands)]
        for job in again:
            for i, c in enumerate(job.cands):
                c.copy = i + 1  # this job alone: its own copies, a clean copy 0 and a control last
                if _unsure(c.found):
                    c.at = c.length // 2 if at is None else at
                    c.delta = _delta(c, 5000 + i) * louder
            job.z.clear()
            if not _alone(job):
                try:
                    _run([job], make(len(job.cands) + 2), local=False, stop=True)
                except Exception:  # noqa: BLE001 - the first pass ran; its verdicts stand
                    job.z.clear()
            previous = {id(c): c.found for c in job.cands}
            for k, z in job.z.items():
                _classify_all(job, k, z)
            for c in job.cands:  # a sure verdict of an earlier run stands; a retry only adds
                if not _unsure(previous[id(c)]):
                    c.found = previous[id(c)]
    for job in jobs:
        for c in job.cands:
            if c.found and c.found[0] == "faint":
                c.found = c.found[1]


def _unsure(found: tuple) -> bool:
    return not found or found[0] in ("none", "faint", "unclear")


def _classify_all(job: Job, key: tuple, z: Tensor) -> None:
    """Classify the job's candidates for attention ``key`` from its ``z [N, Tq, H * dv]``; the
    last copy is unperturbed: its difference from copy 0 is the noise floor."""
    mine = [c for c in job.cands if c.key == key]
    if not mine:
        return
    if z.dim() != 3:
        raise ProbeError(
            f"{key[0]} layer {key[1]}: its output projection's input is not [batch, positions, features]"
        )
    eps = torch.finfo(z.dtype).eps if z.is_floating_point() else 0.0
    zz = z.reshape(z.shape[0], z.shape[1], job.heads[key], -1).double()
    thr = 4 * (zz[-1] - zz[0]).abs().max().item()
    for c in mine:
        c.found = classify(c, zz[c.copy] - zz[0], thr, zz[0], eps)


def classify(c: Cand, dz: Tensor, thr: float, base: Tensor, eps: float) -> tuple:
    """What perturbing ``c`` did to its attention's head outputs ``dz [Tq, H, dv]`` (see the
    module docstring); ``thr``: the noise floor between two unperturbed copies; ``base``: the
    unperturbed outputs, ``eps`` their dtype's epsilon (the rounding ``dz`` carries)."""
    ch = dz.abs() > thr
    heads = ch.any(dim=2).any(dim=0).nonzero().flatten().tolist()
    rows = ch.any(dim=2).any(dim=1).nonzero().flatten().tolist()
    if not heads:
        return ("none",)
    value = _is_value(dz[:, heads], c.delta.double(), base[:, heads], eps)
    if value:
        return ("v", frozenset(heads), True)
    if len(heads) == 1 and rows == [c.pos] and dz.shape[0] == c.length:
        verdict: tuple = ("q", heads[0])
    elif len(rows) >= 2 or len(heads) >= 2:
        verdict = ("k", frozenset(heads))
    else:
        verdict = ("unclear",)
    if value is None:
        return ("faint", verdict)  # perturbed again (_retry_faint)
    return verdict


def _is_value(x: Tensor, delta: Tensor, base: Tensor, eps: float) -> bool | None:
    """Every clearly changed head output ``x [Tq, h, dv]`` (>= 1e-2 of the largest change) is
    ``a * delta`` with ``0 <= a <= 1`` (an attention weight), to 1e-3 relative plus the rounding of
    the two outputs it is the difference of (``8 eps`` of their norms); the largest change must be
    ten times that rounding (else None: too faint to tell). A key block's changes mix the values,
    in no such line."""
    if x.shape[-1] != delta.numel():
        return False
    size = x.abs().amax(dim=-1)  # [Tq, h]
    clear = size >= 1e-2 * size.max()
    a = (x @ delta) / (delta @ delta)
    off = (x - a[..., None] * delta).norm(dim=-1)
    xn = x.norm(dim=-1)
    rounding = 8 * eps * (base.norm(dim=-1) + xn)
    top = size.argmax()
    if xn.flatten()[top] < 10 * rounding.flatten()[top]:
        return None  # too small a change to tell a line from rounding (a key's is off the line by ~|x|)
    ok = (off <= 1e-3 * xn + rounding) & (a >= -1e-3) & (a <= 1 + 1e-3)
    return bool(ok[clear].all())


__all__ = ["Cand", "Job", "layout_of", "classify", "run_checks", "MAX_COPIES"]
