"""Planned captures: a model captured again on the same kind of input, with a learnt plan.

The tracer (:mod:`probe.capture.engine.tracer`) watches every module call and every torch op of
a forward, because it has to find out what is a layer, a sublayer, a residual addition and an
attention. On a model of many small layers that bookkeeping, not the model, is most of a
capture's cost (SmolLM2's 30 layers: about 2,000 ops and 400 module calls a forward). What it
finds out is the same for every forward of one model on one kind of input, so
:func:`probe.capture` learns it:

1. the first full capture of a model on an input kind (:func:`~.plans.key_for`: texts or token
   ids, padded or not, with the same ``layers``/``heads``/``dtype``) proposes a
   :class:`~.plans.Plan` from what the tracer recorded (:func:`~.plans.propose`):
   each stored residual is a layer's input, a layer's output or the output of the layer's child
   that the key names; each pattern is the one ``F.scaled_dot_product_attention`` call inside
   the attention sublayer the tracer saw compute it. Any other kind of key (a softmax's own
   weights, rows, derived kinds, a delta the tracer had to separate from a sum, a looped list,
   metadata that depends on the input beyond its tokens) proposes no plan;
2. the second full capture runs the plan's hooks (:class:`PlannedRun`) beside the tracer and
   compares every key: residuals bit for bit, and each pattern's first, middle and last query
   rows, recomputed from the planned SDPA call, to float rounding. Only then is the plan kept;
3. later captures run the plan alone: hooks on the planned modules only, and a torch-function
   mode pushed only while an attention sublayer runs, which recomputes the pattern of its SDPA
   call with :func:`~probe.capture.patterns.sdpa_weights` (the tracer's own computation).

A planned capture checks the forward it watched before it returns: every planned module ran
exactly once, every attention sublayer made one SDPA call of the planned form (heads, key heads,
``is_causal``, mask), every layer's output equals its input plus its deltas added in the
learnt order bit for bit, every layer's input is the previous layer's output, and no stored
tensor of the model was changed in place afterwards. If any check fails the plan is dropped and
the capture runs again as a full one (the forward runs twice, once): a planned capture stores
exactly what a full capture stores, or is not used. ``OPTIONS.planned_capture``
(:mod:`probe.cache.perf.options`) switches plans off.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from probe.cache import Cache
from probe.cache.perf import pool
from probe.capture.calls import first_tensor, output_tensor
from probe.capture.engine.claims import claim, release
from probe.capture.engine.lean import SdpaMode, pop, push, sdpa_args
from probe.capture.engine.plans import Plan, key_for, propose, sdpa_form
from probe.capture.patterns import sdpa_rows, sdpa_weights, weights_shape

_REFUSED = "refused"
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: Plan | _REFUSED}
_LOCK = threading.Lock()


def sample_rows(length: int) -> list[int]:
    """The query rows a confirming run recomputes: the first, the middle and the last."""
    return sorted({0, length // 2, length - 1})


def _sampled(args: tuple, kwargs: dict) -> Tensor | None:
    """The :func:`sample_rows` of an SDPA call's weights, float32 ``[batch, heads, 3, S]``."""
    q = args[0] if args else kwargs.get("query")
    if not isinstance(q, Tensor) or q.dim() != 4:
        return None
    rows = torch.tensor(sample_rows(q.size(-2)), device=q.device).expand(q.size(0), -1)
    return sdpa_rows(*args, **kwargs, rows=rows)


# Below this many bytes a tensor is kept where it is (the model's residuals) or made in the heap
# (patterns, zero-filled): small blocks come and go in the C heap without page faults, and a
# mapping and a copy of their own cost more than they save (SmolLM2 at 80 tokens: 184 KiB).
POOL_MIN = 1 << 20


def _pooled(shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> tuple[Tensor, bool]:
    """An uninitialised tensor in a mapping of the pool (:mod:`~probe.cache.perf.pool`), and
    whether it is zero-filled; below :data:`POOL_MIN` bytes a zero-filled heap tensor, and the
    device's own memory off the CPU or where the system maps no memory."""
    if torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device), False
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < POOL_MIN:
        return torch.zeros(shape, dtype=dtype), True
    try:
        raw, zeroed = pool.take(nbytes)
    except OSError:
        return torch.empty(shape, dtype=dtype), False
    return raw.view(dtype).view(shape), zeroed


def _pattern(dtype: torch.dtype, args: tuple, kwargs: dict) -> Tensor:
    """The weights of an SDPA call (its arguments), in a pool mapping."""
    q, k, *_ = sdpa_args(args, kwargs)
    out, zeroed = _pooled(weights_shape(q, k), dtype, q.device)
    return sdpa_weights(*args, **kwargs, out=out, clean=zeroed, dtype=dtype)


def _store(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` detached, contiguous, in ``dtype`` (itself where it already is)."""
    t = t.detach().contiguous()
    return t.to(dtype) if t.dtype != dtype else t


class PlannedRun:
    """One forward watched by a plan's hooks (``with PlannedRun(plan): model(...)``); then
    :meth:`result` gives the tensors by key, or None if the forward did not run as planned.

    Each stored residual of at least :data:`POOL_MIN` bytes is copied as its module returns it,
    into a mapping per layer from the pool (:mod:`~probe.cache.perf.pool`), and the model's
    tensor is let go: the forward's temporaries reuse its memory as in a plain forward, instead
    of the heap growing by every kept tensor (each new page a fault) and shrinking when the
    cache is dropped. A layer's input that is the previous layer's output is that copy, kept
    once under both keys. Smaller residuals are the model's own tensors, as a full capture keeps
    them. The layer's checks run when the layer returns, while its tensors are still in the
    processor's caches: its output is its input plus its deltas, bit for bit, none of them
    changed in place since recorded. Patterns are computed into pool mappings too."""

    def __init__(self, plan: Plan, confirming: bool = False) -> None:
        self.plan = plan
        self.ran: dict[int, int] = {}  # id(module) -> calls seen
        self.found: dict[int, list[tuple[tuple, Tensor]]] = {}  # id(attention) -> (form, pattern)
        self.seen_in: list[tuple[tuple, Tensor]] | None = None
        self.layer_of = {id(lay.module): lay for lay in plan.layers}
        self.child_of = {
            id(c): (id(lay.module), j) for lay in plan.layers for j, (c, _) in enumerate(lay.deltas)
        }
        ids = [id(lay.module) for lay in plan.layers]
        self.prev = dict(zip(ids[1:], ids[:-1], strict=True))  # each layer's predecessor in the plan
        self.pre: dict[int, Tensor] = {}  # id(layer) -> copy of its input
        self.post: dict[int, Tensor] = {}  # id(layer) -> copy of its output
        self.deltas: dict[int, Tensor] = {}  # id(child) -> copy of its output
        self.held: dict[int, tuple[Tensor, int]] = {}  # the model's tensors of the running layer, version
        self.refs: list[tuple[Any, int]] = []  # weak references to the model's copied tensors, version
        self.outs: dict[int, Any] = {}  # id(layer) -> weak reference to the model's output
        self.chained: set[int] = set()  # layers whose input is (the object) the previous layer's output
        self.summed: dict[int, bool] = {}  # id(layer) -> output == input + deltas, bit for bit
        self.arenas: dict[int, tuple[Tensor, int] | None] = {}  # id(layer) -> (mapping, bytes a slot)
        self.scratch: list[Tensor] = []
        # copies go to fresh mappings only while the pool keeps memory (captures follow each
        # other): after a pause, fresh pages plus a copy cost more than keeping the model's tensor;
        # a confirming run, compared with the full capture beside it and dropped, copies nothing
        self.copying = not confirming
        self.warm = pool.kept_bytes() > 0
        if confirming:  # beside the full capture, whose patterns it is compared with: a few rows
            self.weights = _sampled
        else:  # a function of the dtype, not a bound method: no reference cycle through self
            self.weights = functools.partial(_pattern, plan.dtype or torch.float32)
        self.mode = SdpaMode(self._call, raw=True)
        self._handles: list[Any] = []
        self._thread = threading.get_ident()
        self.failed = False

    def _call(self, call: tuple[tuple, dict]) -> None:
        """An SDPA call inside an attention sublayer: its form and its weights (unseen by any mode)."""
        if self.seen_in is None:
            self.failed = True
            return
        args, kwargs = call
        with torch._C.DisableTorchFunction():
            self.seen_in.append((sdpa_form(args, kwargs), self.weights(args, kwargs)))

    # -- hooks ---------------------------------------------------------------------------------
    def __enter__(self) -> PlannedRun:
        modules: dict[int, nn.Module] = {}
        for lay in self.plan.layers:
            modules[id(lay.module)] = lay.module
            modules.update((id(c), c) for c, _ in lay.deltas)
            modules.update((id(a.module), a.module) for a in lay.attns)
        self.attn_ids = {id(a.module) for lay in self.plan.layers for a in lay.attns}
        try:
            for m in modules.values():
                self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
                self._handles.append(m.register_forward_hook(self._post, always_call=True))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        pop(self.mode)
        self._remove()
        self.mode = None  # it calls back into self: no reference cycle keeps a dropped cache's tensors

    def _remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if threading.get_ident() != self._thread:
            return
        mid = id(module)
        self.ran[mid] = self.ran.get(mid, 0) + 1
        if mid in self.layer_of:
            t = first_tensor(args, kwargs)
            if isinstance(t, Tensor):
                self.held[mid] = (t, t._version)
                prev = self.prev.get(mid, -1)
                before = self.outs.get(prev)
                if before is not None and before() is t and prev in self.post:
                    # the previous layer's output is this layer's input: one tensor under both keys
                    self.pre[mid] = self.post[prev]
                    self.chained.add(mid)
                else:
                    self.pre[mid] = self._copy(mid, -1, t)
        if mid in self.attn_ids:
            if self.seen_in is not None:
                self.failed = True  # an attention sublayer inside another
            self.seen_in = self.found.setdefault(mid, [])
            push(self.mode)

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        mid = id(module)
        if mid in self.attn_ids:
            if not pop(self.mode):
                self.failed = True
            self.seen_in = None
        t = output_tensor(output)
        if not isinstance(t, Tensor):
            return
        if mid in self.child_of:
            layer, j = self.child_of[mid]
            self.deltas[mid] = self._copy(layer, 1 + j, t)
            self.held[mid] = (t, t._version)
        if mid in self.layer_of:
            self.outs[mid] = weakref.ref(t)
            self._output(mid, t)

    def _output(self, mid: int, post: Tensor) -> None:
        """The layer returned ``post``: check that it is its input plus its deltas, added in the
        plan's order, bit for bit (the model's tensors, none changed since copied), and keep a
        copy of it; then let go of the model's tensors. Where the cache keeps the model's dtype,
        the sum is made in the output's slot: equal to the output, it is the copy."""
        self.refs.append((weakref.ref(post), post._version))
        lay = self.layer_of[mid]
        got = [self.held.pop(mid, None), *(self.held.pop(id(c), None) for c, _ in lay.deltas)]
        if any(g is None or g[0]._version != g[1] for g in got):
            self.summed[mid] = False
            self.post[mid] = self._copy(mid, 0, post, note=False)
            return
        pre, deltas = got[0][0], [g[0] for g in got[1:]]  # type: ignore[index]
        same = all(d.shape == pre.shape and d.dtype == pre.dtype for d in (*deltas, post))
        slot = self._slot(mid, 0, post) if same and deltas and self._dtype(post) == post.dtype else None
        if slot is None:
            self.post[mid] = self._copy(mid, 0, post, note=False)
            self.summed[mid] = _adds_up(pre, deltas, post, self.scratch)
            return
        acc = torch.add(pre, deltas[0], out=slot)
        for d in deltas[1:]:
            acc.add_(d)
        self.summed[mid] = torch.equal(acc, post)
        self.post[mid] = acc

    def _dtype(self, t: Tensor) -> torch.dtype:
        """The dtype the cache keeps ``t`` in."""
        return self.plan.dtype if self.plan.dtype is not None and t.is_floating_point() else t.dtype

    def _slot(self, layer: int, slot: int, t: Tensor) -> Tensor | None:
        """Uninitialised memory for ``t`` as the cache keeps it, in slot ``slot`` of ``layer``'s
        mapping (0: output, 1...: deltas, -1: input, where it is not the previous layer's
        output), or None where it does not fit there (then the heap is used)."""
        dtype = self._dtype(t)
        nbytes = t.numel() * dtype.itemsize
        if not self.copying or t.device.type != "cpu" or nbytes < POOL_MIN:
            return None
        arena = self.arenas.get(layer, False)
        if arena is False:
            lay = self.layer_of[layer]
            step = -(-nbytes // pool.ALIGN) * pool.ALIGN
            n = 1 + len(lay.deltas) + (0 if layer in self.chained else 1)
            try:
                got = pool.take(step * n, kept_only=not self.warm)
            except OSError:
                got = None
            self.arenas[layer] = arena = (got[0], step) if got is not None else None
        if arena is None:
            return None
        raw, step = arena
        at = slot * step if slot >= 0 else raw.numel() - step
        if nbytes > step or at < 0 or at + nbytes > raw.numel():
            return None
        return raw[at : at + nbytes].view(dtype).view(t.shape)

    def _copy(self, layer: int, slot: int, t: Tensor, note: bool = True) -> Tensor:
        """The model's ``t`` as the cache keeps it (contiguous, in the plan's dtype): a copy in
        :meth:`_slot`, or where it has none (small, or not on the CPU) the model's tensor itself,
        as a full capture keeps it. ``note``: remember ``t``'s version, checked after the forward
        (a tensor kept and changed in place since is refused there)."""
        if note:
            self.refs.append((weakref.ref(t), t._version))
        dst = self._slot(layer, slot, t)
        if dst is None:
            return _store(t, self._dtype(t))
        return dst.copy_(t.detach())

    # -- after the forward ---------------------------------------------------------------------
    def result(self) -> dict[str, Tensor] | None:
        """The planned keys' tensors, or None if the forward did not run as the plan says."""
        plan, ran = self.plan, self.ran
        if self.failed:
            return None
        tensors: dict[str, Tensor] = {}
        prev: Tensor | None = None
        for lay in plan.layers:
            mods = [lay.module, *(c for c, _ in lay.deltas), *(a.module for a in lay.attns)]
            if any(ran.get(id(m)) != 1 for m in mods):
                return None
            mid = id(lay.module)
            pre, post = self.pre.get(mid), self.post.get(mid)
            deltas = [self.deltas.get(id(c)) for c, _ in lay.deltas]
            if pre is None or post is None or any(d is None for d in deltas) or not self.summed.get(mid):
                return None
            if plan.chain and prev is not None and mid not in self.chained and not _same(pre, prev):
                return None
            prev = post
            tensors[lay.pre] = pre
            tensors[lay.post] = post
            tensors.update((k, d) for (_, k), d in zip(lay.deltas, deltas, strict=True))
            for a in lay.attns:
                got = self.found.get(id(a.module), [])
                if len(got) != 1 or (a.form is not None and got[0][0] != a.form):
                    return None
                pattern = got[0][1]
                if pattern is None:
                    return None
                tensors[a.key] = pattern if plan.heads is None else pattern[:, plan.heads]
        for ref, version in self.refs:
            t = ref()
            if t is not None and t._version != version:
                return None  # overwritten in place after it was copied: the full capture says so
        return tensors

    def forms(self) -> dict[int, tuple]:
        """Each attention sublayer's SDPA call form (after a forward that ran as planned)."""
        return {mid: got[0][0] for mid, got in self.found.items() if len(got) == 1}


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _adds_up(pre: Tensor, deltas: list[Tensor], post: Tensor, scratch: list[Tensor]) -> bool:
    """Whether ``post`` is ``pre`` plus ``deltas`` added in order, bit for bit (summed in
    ``scratch[0]``, reused between layers: the same additions, no fresh memory each layer)."""
    if any(d.shape != pre.shape or d.dtype != pre.dtype for d in deltas) or post.shape != pre.shape:
        return False
    if not deltas:
        return torch.equal(pre, post)
    if not scratch or scratch[0].shape != pre.shape or scratch[0].dtype != pre.dtype:
        scratch[:] = [torch.empty_like(pre)]
    acc = torch.add(pre, deltas[0], out=scratch[0])
    for d in deltas[1:]:
        acc.add_(d)
    return torch.equal(acc, post)


# -- the registry ------------------------------------------------------------------------------
def planned(model: nn.Module, key: tuple | None) -> Plan | None:
    """The confirmed plan for ``key`` captures of ``model`` (None: capture in full)."""
    if key is None:
        return None
    with _LOCK:
        got = _PLANS.get(model, {}).get(key)
    return got if isinstance(got, Plan) and got.confirmed else None


def candidate(model: nn.Module, key: tuple | None) -> PlannedRun | None:
    """A run of the proposed (not yet confirmed) plan to watch a full capture beside the tracer."""
    if key is None:
        return None
    with _LOCK:
        got = _PLANS.get(model, {}).get(key)
    if isinstance(got, Plan) and not got.confirmed and got.intact():
        return PlannedRun(got, confirming=True)
    return None


def learnt(
    model: nn.Module,
    key: tuple | None,
    trace: Any,
    given: set[str],
    watched: PlannedRun | None,
    selection: Any,
    dtype: Any,
) -> None:
    """After a full capture of ``key`` kind: propose a plan from it (first), or confirm the
    proposed plan ``watched`` ran beside it (second), or refuse plans for this kind."""
    if key is None:
        return
    cache = trace.cache
    if watched is None:
        with _LOCK:
            if key in _PLANS.get(model, {}):
                return
        plan = propose(trace.tracer, trace.names, cache.metadata, model, given, selection, dtype)
        _set(model, key, plan if plan is not None else _REFUSED)
        return
    got = watched.result()
    patterns = {a.key for lay in watched.plan.layers for a in lay.attns}
    ok = got is not None and set(got) == set(cache.keys())
    ok = ok and all(_agrees(got[k], cache[k], k in patterns) for k in got)
    if ok:
        forms = watched.forms()
        for lay in watched.plan.layers:
            for a in lay.attns:
                a.form = forms.get(id(a.module))
        ok = all(a.form is not None for lay in watched.plan.layers for a in lay.attns)
    watched.plan.confirmed = ok
    _set(model, key, watched.plan if ok else _REFUSED)


def _agrees(got: Tensor, want: Tensor, sampled: bool) -> bool:
    """A confirming run's tensor against the full capture's: residuals bit for bit, a pattern's
    sampled rows (float32) to float rounding."""
    if sampled:
        want = want[:, :, sample_rows(want.size(-2))]
        if got.shape != want.shape:
            return False
        tol = 1e-6 if want.dtype == torch.float32 else float(torch.finfo(want.dtype).eps)
        return bool(torch.allclose(got.to(want.dtype).float(), want.float(), rtol=0, atol=tol))
    return got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)


def _set(model: nn.Module, key: tuple, value: Any) -> None:
    with _LOCK:
        _PLANS.setdefault(model, {})[key] = value


def forget(model: nn.Module, key: tuple | None = None) -> None:
    """Drop ``model``'s plans (``key``: that kind's only; it is refused from now on)."""
    with _LOCK:
        if key is None:
            _PLANS.pop(model, None)
        elif model in _PLANS:
            _PLANS[model][key] = _REFUSED


def state(model: nn.Module, key: tuple | None) -> str:
    """``"none"``, ``"proposed"``, ``"planned"`` or ``"refused"``: where captures of ``key`` kind stand."""
    with _LOCK:
        got = _PLANS.get(model, {}).get(key, None) if key is not None else None
    if got is None:
        return "none"
    if isinstance(got, Plan):
        return "planned" if got.confirmed else "proposed"
    return "refused"


def capture_planned(model: nn.Module, key: tuple | None, run: Any, given: dict[str, Any]) -> Cache | None:
    """Run ``run()`` (the forward) under the confirmed plan for ``key`` captures of ``model``;
    the Cache, or None when there is no such plan or the forward did not run as planned (the
    plan is then forgotten; the caller captures in full). ``given``: the input's metadata."""
    plan = planned(model, key)
    if plan is None:
        return None
    if not plan.intact():
        forget(model, key)
        return None
    watched = PlannedRun(plan)
    claim(model)
    try:
        with torch.no_grad(), watched:
            run()
    finally:
        release(model)
    tensors = watched.result()
    if tensors is None:
        forget(model, key)
        return None
    return Cache(tensors, plan.metadata(model, given, tensors))


__all__ = [
    "Plan",
    "PlannedRun",
    "candidate",
    "capture_planned",
    "forget",
    "key_for",
    "learnt",
    "planned",
    "propose",
    "state",
]
