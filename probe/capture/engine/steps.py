"""``probe.trace(model, steps=True)``: several forwards recorded as steps of one growing sequence.

A generation runs the model once per new token, each forward reading the new positions through
the KV cache (a prefill of the prompt, then one row per token); a loop without a cache re-runs
the whole sequence each time. Inside ``probe.trace(model, steps=True)`` every forward the model
(or a submodule called on its own, such as the encoder ``generate`` runs first) makes is
captured as one step, exactly as :func:`probe.trace` captures a lone forward: hooks stay
installed, and each call that starts with no module call running opens a fresh
:class:`~probe.capture.engine.tracer.Tracer` state into memory, named when the call returns
(:mod:`probe.capture.engine.naming`). :mod:`probe.capture.engine.assemble` then places each step's new rows
in one cache over the whole sequence (its docstring says how keys map to positions for dynamic,
static and sliding-window caches). With ``keep="rows"`` each step keeps its last query row (the
one that chose the next token) of the generating stack, and whole patterns of the encoder; with
``{"topk": k}`` the top-k of every row; nothing ``T x T`` is held in either.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from probe.cache import Cache
from probe.cache.format import FORMAT_VERSION
from probe.cache.perf import heap
from probe.cache.selection import Selection
from probe.cache.writer import MemorySink, check_output
from probe.capture.calls import Attention, Forward
from probe.capture.consumers.keep import KeepPatterns
from probe.capture.consumers.kept import Keep, parse_keep
from probe.capture.consumers.rows import KeepRows, RowPicker
from probe.capture.engine.assemble import Assembler, Step
from probe.capture.engine.claims import claim, release
from probe.capture.engine.deferred import Deferred
from probe.capture.engine.lean import LeanStep, Learner, decode_step, learn
from probe.capture.engine.lean import pop as lean_pop
from probe.capture.engine.lean import push as lean_push
from probe.capture.engine.naming import check_forward, check_unseen, model_info, name
from probe.capture.engine.tracer import Tracer
from probe.capture.hooks.store import parse_dtype
from probe.capture.hooks.watch import Watcher
from probe.capture.inputs.prepared import model_name
from probe.errors import ProbeError
from probe.version import __version__

# Whole patterns are kept as each step's rows, one tensor a step and a key, a little larger than
# the last (one key more): glibc serves them from its heap among the KV cache's growing blocks,
# which it then cannot reuse, so the heap grows with the holes left behind. Handing the free pages
# back every few steps (malloc_trim) keeps it at the result's size plus one step. Rows, top-k and
# residuals go into buffers that grow by doubling (assemble.py), which leave no such holes: at
# 2,048 + 2,048 tokens of a 4-layer model `keep="rows"` peaks at its result without any trim
# (4.4 GiB resident before, when each step's residuals were kept apart), so they are not trimmed.
TRIM_EVERY = 16


class _StepWatcher(Watcher):
    """The watcher of a stepped trace: installed once, its parts rebound to a fresh tracer state at
    the start of every outermost call (``begin``), which is named when that call returns (``end``,
    told whether it returned). A lean decode step (:mod:`probe.capture.engine.lean`) runs with the
    mode off and only its plan's hooks; a learner watches a full step beside the tracer."""

    def __init__(self, model: nn.Module, begin: Callable, end: Callable) -> None:
        super().__init__(model, [], None, None, Forward())  # parts bound per step
        self._begin, self._end = begin, end
        self.root: nn.Module | None = None
        self.lean: LeanStep | None = None
        self.learner: Learner | None = None
        self._only: set[int] | None = None  # the modules hooked (None: every one)
        # the mode is on only while a step captured in full runs: between steps (the generation
        # loop's own ops) and during lean steps no op passes through it; install() pushes it
        self._on = True

    def bind(self, tr: Tracer) -> None:
        self.stack = self._mode.stack = tr.watcher.stack
        self.layers = self._mode.layers = tr.layers
        self.recorder = self._mode.recorder = tr.recorder
        self.forward = tr.forward

    def hook_only(self, modules: set[int] | None) -> None:
        """Hooks on every module (None), or on the model and ``modules`` only (a lean plan's: the
        others run on torch's fast path, no hook called). Swapped between calls or inside the
        model's own hooks (torch reads a call's hooks before running them)."""
        if self._fast_layers or modules is self._only or modules == self._only:
            return
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for m in self.model.modules():
            if modules is None or m is self.model or id(m) in modules:
                self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
                self._handles.append(m.register_forward_hook(self._post, with_kwargs=True, always_call=True))
        self._only = modules

    def go_lean(self, step: LeanStep) -> bool:
        """Run the next step lean, the mode off (False where it is on under another mode)."""
        if self._on and not self.mode_off():
            return False
        self.lean = step
        return True

    def mode_on(self) -> None:
        if not self._on:
            lean_push(self._mode)
            self._on = True

    def mode_off(self) -> bool:
        """Take the mode off the stack (False where another mode sits above it: left on)."""
        if self._on and lean_pop(self._mode):
            self._on = False
        return not self._on

    def _pre(self, module: nn.Module, args: tuple, *rest: Any) -> None:
        if self._replaying or threading.get_ident() != self._thread:
            return
        kwargs = rest[0] if rest else {}
        if self.lean is None and self.root is None and not self.stack:
            self.root = module
            self._begin(module, args, kwargs)
        if self.lean is not None:
            self.lean.pre(module, args, kwargs)
            return
        super()._pre(module, args, *rest)
        if self.learner is not None:
            self.learner.pre(module, args, kwargs)

    def _post(self, module: nn.Module, args: tuple, *rest: Any) -> None:
        if self._replaying or threading.get_ident() != self._thread:
            return
        ok = bool(rest) and rest[-1] is not None  # None: the forward raised (its error goes on)
        if self.lean is not None:
            if module is not self.root:
                if ok:
                    self.lean.post(module, rest[-1])
                else:  # the forward raised: its error goes on, the row's mode comes off
                    self.lean.abort()
                return
            self.root = None
            self._end(module, ok)
            return
        if self.learner is not None:
            self.learner.post(module, rest[-1] if rest else None)
        super()._post(module, args, *rest)
        if module is self.root and not self.stack:
            self.root = None
            self._end(module, ok)

    def end_lean(self) -> LeanStep | None:
        """The lean step that ran (its row mode off)."""
        step, self.lean = self.lean, None
        if step is not None:
            step.abort()
        return step

    def remove(self, *exc: Any) -> None:
        self.end_lean()
        if self.learner is not None:
            lean_pop(self.learner.mode)
            self.learner = None
        self.mode_on()  # the watcher's removal takes it off the stack
        super().remove(*exc)


class _ByStack:
    """Keep rows: the last query row of the generating stack's attentions, whole patterns of the
    encoder's (its source is read once, not generated)."""

    def __init__(self, tr: Tracer, selection: Selection, encoder: str | None) -> None:
        self.rows = KeepRows(tr.store, selection, RowPicker((-1,), {}))
        self.whole = KeepPatterns(tr.store, selection)
        self.encoder = encoder

    def _of(self, attn: Attention) -> Any:
        enc = self.encoder
        inside = enc is not None and (attn.module or "").startswith(enc + ".")
        return self.whole if inside or enc == "" else self.rows

    def weights(self, attn: Attention, pattern: Any, impl: str) -> None:
        self._of(attn).weights(attn, pattern, impl)

    def sdpa(self, attn: Attention, args: tuple, kwargs: dict) -> None:
        self._of(attn).sdpa(attn, args, kwargs)

    def close(self, attn: Attention) -> None:
        self._of(attn).close(attn)


def encoder_path(model: nn.Module) -> str | None:
    """The module path of an encoder-decoder's encoder (None for other models)."""
    enc = None
    get = getattr(model, "get_encoder", None)
    if callable(get) and getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        enc = get()
    elif getattr(model, "is_encoder_decoder", False):
        enc = getattr(model, "encoder", None)
    if not isinstance(enc, nn.Module):
        return None
    return next((n for n, m in model.named_modules() if m is enc), None)


class StepTrace:
    """``with probe.trace(model, steps=True) as t:`` any loop of forwards; then ``t.cache``.

    Each outermost call is one step of one growing sequence (see the module docstring).
    ``keep``: whole patterns (default), ``"rows"`` (each step's last row of the generating stack,
    stored as ``rows``/``row_index``) or ``{"topk": k}``. ``hint`` ``(rows, keys)``: the most a
    generation will keep (rows buffers allocated once). ``on_step(i)`` is called after each step.
    After the block, :attr:`cache` and :attr:`steps` (forwards recorded).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        out: Any = None,
        layers: list[int] | None = None,
        heads: list[int] | None = None,
        dtype: Any = None,
        metadata: dict[str, Any] | None = None,
        keep: Any = None,
        hint: tuple[int, int] = (1, 0),
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ProbeError(f"probe captures torch.nn.Module models, not {type(model).__name__}")
        self.selection = Selection.parse(layers, heads)
        if out is not None:
            check_output(out)
        self.model, self.out, self.dtype = model, out, parse_dtype(dtype)
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.keep = _step_keep(keep)
        self.assembler = Assembler(self.keep, hint)
        self.on_step = on_step
        self.encoder = encoder_path(model)
        self.cache: Cache | None = None
        self.steps = 0
        self._tr: Tracer | None = None
        self._sink: MemorySink | None = None
        self._watcher: _StepWatcher | None = None
        self._plan: Any = None  # the lean plan of decode steps (False: none fits)
        self._pieces = 0  # steps that kept whole-pattern rows of their own (see TRIM_EVERY)
        self._info: dict[str, Any] | None = None  # model_info, once
        self.lean_steps = 0
        # lean steps' rows over an append-only KV cache, computed many steps at a time
        self.deferred: Deferred | None = None
        if self.keep.kind in ("rows", "topk", "patterns"):
            h = self.selection.heads
            self.deferred = Deferred(self.keep.kind, self.keep.k, h, self.dtype, self._block)

    def _tracer(self) -> Tracer:
        self._sink = MemorySink()
        kept = self.keep if self.keep.kind == "topk" else None
        tr = Tracer(self.model, self._sink, selection=self.selection, dtype=self.dtype, keep=kept)
        if self.keep.kind == "rows":
            tr.recorder.consumer = _ByStack(tr, self.selection, self.encoder)
        return tr

    def __enter__(self) -> StepTrace:
        if self.model.training:
            warnings.warn(
                f"{model_name(self.model)} is in train mode: captured patterns are the attention "
                "weights before dropout; call model.eval() to capture what the model computes at inference",
                stacklevel=2,
            )
        claim(self.model)
        try:
            self._watcher = _StepWatcher(self.model, self._begin, self._end)
            self._watcher.bind(self._tracer())
            self._watcher.install()
            self._watcher.mode_off()  # on only while a step captured in full runs
        except BaseException:
            release(self.model)
            raise
        return self

    def _begin(self, root: nn.Module, args: tuple, kwargs: dict) -> None:
        w = self._watcher
        fit = decode_step(kwargs, args) if root is self.model and self.encoder is None else None
        plan = self._plan
        past = kwargs.get("past_key_values", kwargs.get("cache"))
        lean = LeanStep(plan, fit[1], self.deferred, past) if fit is not None and plan else None
        if lean is not None and fit[0] == plan.batch and w.go_lean(lean):
            w.hook_only(plan.modules())
            return
        w.hook_only(None)
        w.mode_on()
        self._tr = self._tracer()
        w.bind(self._tr)
        if fit is not None and plan is None:  # the first decode step: learn its plan beside it
            w.learner = Learner()
            lean_push(w.learner.mode)

    def _end(self, root: nn.Module, ok: bool = True) -> None:
        w = self._watcher
        lean = w.end_lean()
        learner, w.learner = w.learner, None
        if learner is not None:
            lean_pop(learner.mode)
        w.mode_off()
        if not ok:
            self._tr = None
            return
        if lean is not None:
            step = Step(lean.finish(), self._plan.meta, True, lean.cached, lean.keys, lean=True)
            self.lean_steps += 1
            self._added(step, root)
            return
        tr, self._tr = self._tr, None
        if root is not self.model and not tr.kept and not tr.forward.blind:
            # a submodule called on its own without attention (an embedding): no step
            tr.layers.upstream.forget()
            return
        try:
            check_forward(tr, self.model, self.selection)
            names, meta = name(tr, self.model, {"model": self._model_info()}, self.selection)
            check_unseen(tr, self.model)
            tensors = self._sink.finish(names, {})
        finally:
            tr.layers.upstream.forget()
        keys = {}
        for r in tr.records:
            for _role, fields, shape, _impl, _causal in r.patterns:
                keys.update({names[h]: int(shape[3]) for h in fields.values() if h in names})
        source = None if root is self.model else self._source(root, meta)
        if learner is not None:
            batch = next(iter(tensors.values())).size(0) if tensors else 0
            got = learn(
                learner,
                tr,
                names,
                tensors,
                self.model,
                self.keep,
                self.selection.heads,
                self.dtype,
                batch,
                meta,
            )
            self._plan = got if got is not None else False
        self._added(Step(tensors, meta, root is self.model, tr.forward.cached, keys, source), root)

    def _model_info(self) -> dict[str, Any]:
        """The model's name, class and config for the metadata, worked out once per trace."""
        if self._info is None:
            self._info = model_info(self.model)
        return self._info

    def _block(self, prefix: str, positions: list[int], fields: dict[str, Any]) -> None:
        with torch._C.DisableTorchFunction():  # probe's own copies: unseen by the tracer's mode
            self.assembler.add_block(prefix, positions, fields)

    def _flush(self) -> None:
        """Compute every waiting row (before a step captured in full adds rows of its own, and at
        the end)."""
        if self.deferred is not None:
            with torch._C.DisableTorchFunction():
                self.deferred.flush()

    def _added(self, step: Step, root: nn.Module) -> None:
        if not step.lean:
            self._flush()
        with torch._C.DisableTorchFunction():  # probe's own copies: unseen by the tracer's mode
            self.assembler.add(step)
        if self.deferred is not None and self.deferred.due():
            self._flush()
        self.steps += 1
        if self.keep.default and any(k.endswith(".pattern") for k in step.tensors):
            self._pieces += 1  # a step whose rows of the whole pattern are kept apart
            if self._pieces % TRIM_EVERY == 0:
                heap.trim()
        if self.on_step is not None and root is self.model:  # one per token (not the encoder's)
            self.on_step(self.steps)

    def _source(self, root: nn.Module, meta: dict[str, Any]) -> str:
        """The stack name of a submodule's step: ``encoder`` for the encoder of an encoder-decoder,
        else its layer list's module path (a vision tower), as a capture of the model names it."""
        path = next((n for n, m in self.model.named_modules() if m is root), None)
        if path is not None and path == self.encoder:
            return "encoder"
        module = (meta.get("layers") or [{}])[0].get("module") or path or "encoder"
        head, _, tail = module.rpartition(".")
        return head if tail.isdigit() and head else module

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self._watcher.remove(exc_type, exc, tb)
        finally:
            release(self.model)
        if exc_type is not None:
            return False
        if self.steps == 0:
            raise ProbeError(
                "the model did not run inside probe.trace(steps=True); call it inside the with block"
            )
        self._flush()
        self.cache = Cache(self.assembler.finish(), self._meta())
        if self.out is not None:
            self.cache.save(self.out)
        return False

    def _meta(self) -> dict[str, Any]:
        a = self.assembler
        meta = dict(self.metadata)
        meta.setdefault("model", self._model_info())
        stacks, layers = {}, []
        for stack, m in a.metas.items():  # in the order the stacks first ran
            stacks.update({s: v for s, v in m.get("stacks", {}).items() if s == stack})
            if stack in a.sources and stack != "encoder" and stack in stacks:
                # a submodule run on its own (a vision tower over pixels): its positions are not tokens
                stacks[stack] = dict(stacks[stack], tokens=None)
            for e in m.get("layers", []):
                if e.get("stack") == stack:
                    layers.append(_renamed(e) if stack in a.renamed else e)
        dtypes = {str(t.dtype).replace("torch.", "") for t in a.finished.values() if t.is_floating_point()}
        meta.update(
            {
                "probe_version": __version__,
                "format_version": FORMAT_VERSION,
                "attention_implementations": sorted(a.impls),
                "dtype": ", ".join(sorted(dtypes)),
                "stacks": stacks,
                "layers_captured": self.selection.layers,
                "training": bool(self.model.training),
                "heads_captured": self.selection.heads,
                "layers": layers,
                # lean: the decode steps captured by the plan learnt from the first (engine/lean.py);
                # deferred: the rows of theirs computed many steps at a time (engine/deferred.py)
                "steps": {
                    "forwards": self.steps,
                    "lengths": dict(a.seen),
                    "lean": self.lean_steps,
                    "deferred": self.deferred.deferred if self.deferred is not None else 0,
                },
            }
        )
        if not self.keep.default:
            meta["keep"] = a.keep_json()
        return meta


def _renamed(entry: dict[str, Any]) -> dict[str, Any]:
    """A layer's metadata with the attention a step judged cross named self (see assemble)."""
    return {("self_attn" if k == "cross_attn" else k): v for k, v in entry.items()}


def _step_keep(keep: Any) -> Keep:
    """``keep`` of a stepped trace: patterns, ``"rows"`` or top-k."""
    if keep == "rows":
        return Keep("rows", rows=(-1,))
    kept = parse_keep(keep)
    if kept.kind == "stats":
        raise ProbeError(
            "probe.trace(steps=True) keeps patterns, 'rows' or {'topk': k}; for statistics of a "
            "generation call probe.generate(model, prompt, keep='stats')"
        )
    if kept.kind == "rows":
        raise ProbeError(
            f"keep={keep!r}: over steps, keep='rows' keeps each step's last query row (the one that "
            "wrote the next token); selected rows of one forward are probe.capture's"
        )
    return kept


__all__ = ["StepTrace", "encoder_path"]
