"""Lean decode steps: the steps of a generation after the first, captured without the tracer.

Every decode step of a KV-cached generation runs the same modules in the same order over one new
query. :class:`~probe.capture.engine.steps.StepTrace` captures the first such step with the full
tracer (hooks on every module, the torch-function mode, naming) and, beside it, a
:class:`Learner` notes each module's input and output and each SDPA call's row. :func:`learn`
then maps every key the capture stored to where it came from: ``resid_pre`` is the layer's input,
``resid_post`` its output, a delta the one child of the layer whose output it equals bit for bit,
an attention's fields the row of the one SDPA call inside its sublayer (checked against the
capture's, and against :func:`~probe.capture.patterns.sdpa_rows` there). A plan is made only when
every key maps and every value agrees; otherwise every step stays a full capture.

The following decode steps (one query, a KV cache) run as a :class:`LeanStep`: the tracer's
mode is off, the hooks of the mapped modules copy their tensor, and a torch-function mode pushed
only while an attention sublayer runs computes its row from the call's own ``q`` and cached ``K``
(:func:`decode_row`: one ``[heads, S]`` product, no key repeated for grouped-query heads). A
step that does not fire every mapped hook exactly once is refused with an error.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from probe.capture.calls import first_tensor, output_tensor, past_length
from probe.capture.hooks.record import SDPA
from probe.errors import ProbeError

_FIELDS = {
    "rows": {"rows", "row_index"},
    "topk": {"topk_values", "topk_indices", "topk_mass"},
    "patterns": {"pattern"},
}


def sdpa_args(args: tuple, kwargs: dict) -> tuple[Tensor, Tensor, Any, bool, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    got = dict(zip(names, args, strict=False)) | kwargs
    return got["query"], got["key"], got.get("attn_mask"), bool(got.get("is_causal", False)), got.get("scale")


@torch.no_grad()
def decode_row(
    query: Tensor, key: Tensor, attn_mask: Any, is_causal: bool, scale: Any, fold: bool = False
) -> Tensor | None:
    """The weights of an SDPA call over one new position, float32 ``[batch, heads, 1, S]``, with
    :func:`~probe.capture.patterns.sdpa_weights`' semantics (grouped key heads serve contiguous
    query heads; a boolean mask marks keys that may be read, a float one is added; ``is_causal``
    masks top-left as SDPA does; a row with every key masked is zeros). ``fold``: the call's query
    rows may be the query heads of each key head folded into the query axis (``[batch, key heads,
    group, E]``, as transformers lays out grouped-query attention): its rows become heads. None for
    a call of another layout (not 4-d, several queries without ``fold``)."""
    if query.dim() != 4 or key.dim() != 4 or (query.size(-2) != 1 and not fold):
        return None
    B, H, L, E = query.shape
    Hk, S = key.size(1), key.size(2)
    if H % Hk or key.size(0) not in (1, B) or key.size(-1) != E:
        return None
    s = 1.0 / math.sqrt(E) if scale is None else scale
    q = (query.float() * s).reshape(B, Hk, H // Hk * L, E)  # the scale on the E values of q, not S scores
    scores = torch.matmul(q, key.float().transpose(-1, -2)).view(B, H, L, S)
    mask = attn_mask
    if is_causal:
        mask = torch.arange(S, device=query.device) <= torch.arange(L, device=query.device)[:, None]
    if mask is not None:
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask.float())
    row = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
    if mask is not None:  # every key masked: NaN from the softmax, zeros in a pattern
        row.nan_to_num_(nan=0.0)
    return row.view(B, H * L, 1, S)


class SdpaMode(TorchFunctionMode):
    """Passes every torch call on; after an SDPA call, its row goes to ``sink`` (``raw``: the
    call's arguments instead, ``(args, kwargs)``; a sink that computes with them runs its torch
    calls under ``torch._C.DisableTorchFunction()``, unseen by any mode below)."""

    def __init__(self, sink: Any, raw: bool = False) -> None:
        super().__init__()
        self.sink, self.raw = sink, raw

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is SDPA:
            if self.raw:
                self.sink((args, kwargs))
            else:
                with torch._C.DisableTorchFunction():  # unseen by any mode below (the tracer's)
                    self.sink(decode_row(*sdpa_args(args, kwargs), fold=True))
        return out


def push(mode: TorchFunctionMode) -> None:
    torch._C._push_on_torch_function_stack(mode)


def pop(mode: TorchFunctionMode) -> bool:
    """Take ``mode`` off the torch-function stack if it is on top (False: it was not)."""
    n = torch._C._len_torch_function_stack()
    if n and torch._C._get_function_stack_at(n - 1) is mode:
        torch._C._pop_torch_function_stack()
        return True
    return False


def decode_step(kwargs: dict, args: tuple) -> tuple[int, int] | None:
    """``(batch, cached positions)`` of a model call over one new token through a KV cache, else None."""
    ids = kwargs.get("input_ids")
    if not isinstance(ids, Tensor):
        ids = kwargs.get("inputs_embeds")
    if not isinstance(ids, Tensor):
        ids = args[0] if args and isinstance(args[0], Tensor) else None
    past = kwargs.get("past_key_values")
    past = kwargs.get("cache") if past is None else past  # the newer name
    if ids is None or ids.dim() < 2 or ids.size(1) != 1 or past is None or isinstance(past, Tensor):
        return None
    try:
        cached = past_length(past)
    except Exception:
        return None
    return (int(ids.size(0)), cached) if cached > 0 else None


class Learner:
    """Beside one full decode step: each module's inputs and outputs (copies) and each SDPA call's
    row, by the innermost module running it."""

    def __init__(self) -> None:
        self.ins: dict[int, list[Tensor | None]] = {}
        self.outs: dict[int, list[Tensor | None]] = {}
        self.rows: dict[int | None, list[Tensor | None]] = {}
        self.before: dict[int | None, int | None] = {}  # attention id -> the module that returned last before
        self.stack: list[int] = []
        self.last: int | None = None  # the module that returned last
        self.mode = SdpaMode(self._row)

    def _row(self, row: Tensor | None) -> None:
        owner = self.stack[-1] if self.stack else None
        self.rows.setdefault(owner, []).append(row)
        self.before[owner] = self.last

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.stack.append(id(module))
        self.last = None
        t = first_tensor(args, kwargs)
        self.ins.setdefault(id(module), []).append(t.detach().clone() if isinstance(t, Tensor) else None)

    def post(self, module: nn.Module, output: Any) -> None:
        if self.stack and self.stack[-1] == id(module):
            self.stack.pop()
        self.last = id(module)
        t = output_tensor(output)
        self.outs.setdefault(id(module), []).append(t.detach().clone() if isinstance(t, Tensor) else None)


def _convert(t: Tensor, dtype: torch.dtype | None, owned: bool = False) -> Tensor:
    """``t`` as the store keeps it (``dtype``), a copy unless ``owned`` (probe's own tensor)."""
    t = t.detach()
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        return t.to(dtype)
    return t if owned else t.clone()


class Plan:
    """Where each key of a decode step comes from (see :func:`learn`)."""

    def __init__(self, kind: str, k: int, heads: list[int] | None, dtype: torch.dtype | None) -> None:
        self.kind, self.k, self.heads, self.dtype = kind, k, heads, dtype
        self.ins: dict[int, list[str]] = {}  # module id -> keys of its input
        self.outs: dict[int, list[str]] = {}  # module id -> keys of its output
        self.attn: dict[int, str] = {}  # attention sublayer id -> its key prefix
        self.heads_of: dict[int, int] = {}  # attention sublayer id -> the heads of its row
        # where the row's mode goes on: after the child that returns last before the SDPA call
        # (the value projection), else at the sublayer's start: fewer of its ops pass through it
        self.arm_after: dict[int, int] = {}
        self.arm_at: set[int] = set()
        self.meta: dict[str, Any] = {}
        self.batch = 0
        self.count = 0  # keys per step
        self._index: Tensor | None = None
        self._modules: set[int] | None = None

    def modules(self) -> set[int]:
        """The ids of the modules whose hooks a lean step needs (the same set every step)."""
        if self._modules is None:
            self._modules = {*self.ins, *self.outs, *self.attn, *self.arm_after, *self.arm_at}
        return self._modules

    def fields(self, prefix: str, row: Tensor) -> dict[str, Tensor]:
        """An attention's stored fields from its row ``[batch, heads, 1, S]`` (float32)."""
        if self.heads is not None:
            row = row[:, self.heads]
        if self.kind == "topk":
            values, indices = row.topk(min(self.k, row.size(-1)), dim=-1)
            return {
                prefix + ".topk_values": _convert(values, self.dtype, owned=True),
                prefix + ".topk_indices": indices.int(),
                prefix + ".topk_mass": _convert(values.sum(-1), self.dtype, owned=True),
            }
        if self.kind == "rows":
            if self._index is None or self._index.size(0) != row.size(0):
                self._index = torch.zeros(row.size(0), 1, dtype=torch.long)
            return {
                prefix + ".rows": _convert(row, self.dtype, owned=True),
                prefix + ".row_index": self._index,
            }
        return {prefix + ".pattern": _convert(row, self.dtype, owned=True)}


def _close(got: Tensor, want: Tensor) -> bool:
    """A learnt attention field against the capture's: the same layout, values within rounding
    (the mapping is what is checked; the rows' exactness is the tests' oracles')."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if not got.is_floating_point():
        return torch.equal(got, want)
    tol = 1e-6 if got.dtype in (torch.float32, torch.float64) else 2 * torch.finfo(got.dtype).eps
    return bool(torch.allclose(got.float(), want.float(), rtol=0, atol=tol))


def _only(found: list[Tensor | None] | None) -> Tensor | None:
    return found[0] if found is not None and len(found) == 1 else None


def _attention(plan: Plan, lr: Learner, record: Any, tensors: dict, names: dict, modules: dict) -> bool:
    """Map each attention of a layer record to the one SDPA row of its sublayer; False if any fails."""
    if len(record.modules) != len(record.patterns):
        return False
    for (_role, fields, _shape, _impl, _causal), path in zip(record.patterns, record.modules, strict=True):
        sub = modules.get(path) if path is not None else None
        row = _only(lr.rows.get(id(sub))) if sub is not None else None
        # (a role of "cross" in a decoder-only step: keys over a sliding window, named as it was)
        if row is None or set(fields) != _FIELDS[plan.kind] or id(sub) in plan.attn:
            return False
        keys = {f: names.get(h) for f, h in fields.items()}
        if None in keys.values():
            return False
        prefix = keys[next(iter(keys))].rsplit(".", 1)[0]
        got = plan.fields(prefix, row)
        for f, key in keys.items():
            want = tensors.get(key)
            if key != f"{prefix}.{f}" or want is None:
                return False
            if f == "topk_indices":  # near-ties may order differently: the weights they pick agree
                cut = row if plan.heads is None else row[:, plan.heads]
                ok = got[key].shape == want.shape and _close(
                    cut.gather(-1, want.long()), got[prefix + ".topk_values"].float()
                )
            else:
                ok = _close(got[key], want)
            if not ok:
                return False
        plan.attn[id(sub)] = prefix
        plan.heads_of[id(sub)] = row.size(1)
        child = lr.before.get(id(sub))
        once = child is not None and len(lr.outs.get(child, ())) == 1 and child not in plan.arm_after
        if once and child in {id(c) for c in sub.modules()}:
            plan.arm_after[child] = id(sub)
        else:
            plan.arm_at.add(id(sub))
    return True


def _residuals(plan: Plan, lr: Learner, record: Any, layer: nn.Module, tensors: dict, names: dict) -> bool:
    """Map each residual key of a layer record to the one module input or output it equals."""
    for rname, h in record.residuals:
        key = names.get(h)
        want = tensors.get(key) if key is not None else None
        if want is None:
            return False
        if rname == "resid_pre":
            found = [(plan.ins, layer, _only(lr.ins.get(id(layer))))]
        elif rname == "resid_post":
            found = [(plan.outs, layer, _only(lr.outs.get(id(layer))))]
        elif rname.endswith(".delta"):  # the sublayer output added to the stream, bit for bit
            found = [(plan.outs, c, _only(lr.outs.get(id(c)))) for c in layer.children()]
        else:
            return False
        hits = [(table, m) for table, m, t in found if t is not None and _equal(t, want, plan.dtype)]
        if len(hits) != 1:
            return False
        table, m = hits[0]
        table.setdefault(id(m), []).append(key)
    return True


def _equal(t: Tensor, want: Tensor, dtype: torch.dtype | None) -> bool:
    got = _convert(t, dtype)
    return got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)


def learn(
    lr: Learner,
    tr: Any,
    names: dict,
    tensors: dict,
    model: nn.Module,
    keep: Any,
    heads: Any,
    dtype: Any,
    batch: int,
    meta: dict,
) -> Plan | None:
    """A :class:`Plan` from the full capture of one decode step (its tracer ``tr``, handle ``names``
    and stored ``tensors``) and what the learner saw beside it; None unless every key maps."""
    if keep.kind not in _FIELDS or not tr.records or tr.forward.blind or tr.forward.unseen:
        return None
    modules = dict(model.named_modules(remove_duplicate=False))
    plan = Plan(keep.kind, keep.k, heads, dtype)
    for r in tr.records:
        layer = modules.get(r.module)
        if layer is None or r.call or any(k is not None for k in r.kinds):
            return None
        if not _residuals(plan, lr, r, layer, tensors, names) or not _attention(
            plan, lr, r, tensors, names, modules
        ):
            return None
    mapped = sum(map(len, plan.ins.values())) + sum(map(len, plan.outs.values()))
    if mapped + len(plan.attn) * len(_FIELDS[keep.kind]) != len(tensors):
        return None
    plan.meta, plan.batch, plan.count = meta, batch, len(tensors)
    return plan


class LeanStep:
    """One decode step captured by the plan's hooks (see the module docstring)."""

    def __init__(self, plan: Plan, cached: int, deferred: Any = None, past: Any = None) -> None:
        self.plan, self.cached = plan, cached
        # rows that may wait (engine/deferred.py) wait there; ``past``: the step's KV cache
        self.deferred, self.past = deferred, past
        self.tensors: dict[str, Tensor] = {}
        self.keys: dict[str, int] = {}  # attention field key -> the step's key count
        self.rows: list[tuple[tuple, dict]] = []  # each SDPA call's arguments
        self.mode = SdpaMode(self.rows.append, raw=True)
        self.waiting = 0  # fields whose rows wait in ``deferred``
        self.versions: list[tuple[Tensor, int]] = []  # the model's tensors kept, and their versions
        self.written = 0

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        mid, plan = id(module), self.plan
        keys = plan.ins.get(mid)
        if keys is not None:
            t = self._held(first_tensor(args, kwargs))
            self.tensors.update(dict.fromkeys(keys, t))
            self.written += len(keys)
        if mid in plan.arm_at:
            self.rows.clear()
            push(self.mode)

    def post(self, module: nn.Module, output: Any) -> None:
        mid, plan = id(module), self.plan
        prefix = plan.attn.get(mid)
        if prefix is not None:
            pop(self.mode)
            self._attention(module, prefix)
        keys = plan.outs.get(mid)
        if keys is not None:
            t = self._held(output_tensor(output))
            self.tensors.update(dict.fromkeys(keys, t))
            self.written += len(keys)
        if mid in plan.arm_after:
            self.rows.clear()
            push(self.mode)

    def _attention(self, module: nn.Module, prefix: str) -> None:
        """The row of attention sublayer ``module``'s one SDPA call: kept, or left waiting."""
        plan, mid = self.plan, id(module)
        if len(self.rows) != 1:
            raise self._differs(f"{prefix} made {len(self.rows)} attention calls, not one like the first's")
        q, key, mask, causal, scale = sdpa_args(*self.rows[0])
        d = self.deferred
        if d is not None and q.dim() == 4 and q.size(1) == plan.heads_of[mid]:
            if d.fits(module, q, key, mask, causal, self.past):
                d.wait(prefix, q, key, scale, self.cached)
                self.waiting += len(_FIELDS[plan.kind])
                self.written += len(_FIELDS[plan.kind])
                return
            d.flush(prefix)  # its earlier rows first: the assembler keeps them in order
        with torch._C.DisableTorchFunction():
            row = decode_row(q, key, mask, causal, scale, fold=True)
        if row is None or row.size(1) != plan.heads_of[mid]:
            raise self._differs(f"{prefix} made an attention call unlike the first's")
        fields = plan.fields(prefix, row)
        self.tensors.update(fields)
        self.keys.update(dict.fromkeys(fields, row.size(-1)))
        self.written += len(fields)

    def _held(self, t: Tensor) -> Tensor:
        """A module's input or output as the step keeps it: the model's own tensor (the assembler
        copies it when the step ends; :meth:`finish` checks it was not overwritten in place by
        then), or its conversion to the plan's dtype."""
        dtype = self.plan.dtype
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            return t.detach().to(dtype)
        kept = t.detach()  # shares the version counter of the model's tensor
        self.versions.append((kept, kept._version))
        return kept

    def finish(self) -> dict[str, Tensor]:
        """The step's tensors by cache key (an error if a mapped module ran other than once, or
        the model overwrote a kept tensor in place before the step ended)."""
        if self.written != self.plan.count or len(self.tensors) + self.waiting != self.plan.count:
            raise self._differs(f"{self.written} tensors for {self.plan.count} keys")
        if any(t._version != v for t, v in self.versions):
            raise ProbeError(
                f"a decode step (after {self.cached} positions) overwrote a layer's input or output in "
                "place after probe recorded it; probe cannot capture it step by step: report it with "
                "the model's name"
            )
        return self.tensors

    def abort(self) -> None:
        pop(self.mode)

    def _differs(self, what: str) -> ProbeError:
        self.abort()
        return ProbeError(
            f"a decode step (after {self.cached} positions) ran differently from the first one ({what}); "
            "probe cannot capture it step by step: report it with the model's name"
        )
