"""Where an intervention goes: each attention's output projection, and each MLP's output.

Two forwards of the unmodified model on the same inputs:

1. :func:`probe.capture` names the stacks, layers (with their module paths), attention roles and
   head counts, and records the residual deltas;
2. a scan follows the data flow inside every layer call: the output of ``softmax`` (the
   pattern), of SDPA / ``flex_attention`` and of ``pattern @ v`` (the attention output) are
   tracked through shape-only ops (view, transpose, cat, dropout, ...); the first weighted leaf
   module (a 2-D ``weight``) whose input is an attention output, and whose output has the
   stream's width, is that attention's output projection. Its input is the heads side by side,
   ``[..., heads * d_head]``: head ``h`` is the slice ``h*d_head:(h+1)*d_head``.

The head layout is checked where the attention output is seen whole (SDPA's ``[batch, heads,
q, d_head]``, one ``[batch, q, d_head]`` per head module): the projection's input must equal it
bit for bit, else :class:`ProbeError`. A layer whose attention reaches no projection module (a
fused kernel such as ``nn.MultiheadAttention``, or ``einsum`` with ``W_O``) raises a
:class:`ProbeError` naming the layer when an intervention is asked for there.

The MLP's output is the weighted leaf whose output equals the captured MLP delta exactly
(pre-norm and parallel blocks). In a post-norm layer (``norm(x + mlp(x))``, BERT, BART) it is
the last weighted leaf of the stream's width after the attention projections, checked in the
data flow: the layer's own code adds its output, bit for bit, to the tensor the MLP's first
weighted leaf read (the stream entering the MLP). In other layouts MLP ablation is refused with a
ProbeError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from probe.capture.hooks.record import FLEX, SDPA, SOFTMAX
from probe.errors import ProbeError

PATTERN, OUTPUT = 1, 2
# ops that move values around without computing: an attention output stays one through them
_SHAPE = frozenset(
    "reshape view transpose permute contiguous flatten unflatten cat concat concatenate stack clone "
    "to float half bfloat16 double type type_as dropout __getitem__ split chunk unbind squeeze "
    "unsqueeze expand movedim moveaxis swapaxes swapdims narrow detach masked_fill masked_fill_".split()
)
_MATMUL = frozenset("matmul __matmul__ bmm einsum".split())
_ADD = frozenset("add __add__ __radd__ add_ __iadd__".split())


@dataclass
class Site:
    """One attention's output projection: ``module``'s ``call``-th call in a forward.

    ``heads`` and ``d_head``: its input is ``[..., heads * d_head]``. ``layout`` says how the head
    order was checked: ``"heads whole"`` (against a ``[batch, heads, q, d_head]`` attention
    output), ``"per-head modules"`` (against one output per head), ``""`` (not checkable).
    """

    stack: str
    layer: int
    role: str  # "self" | "cross" | "mlp"
    module: nn.Module
    name: str
    call: int
    heads: int = 0
    d_head: int = 0
    layout: str = ""


@dataclass
class Sites:
    """Every placeable site of a model on some inputs, and why the others are not placeable."""

    attention: dict[tuple[str, int, str], Site] = field(default_factory=dict)
    mlp: dict[tuple[str, int], Site] = field(default_factory=dict)
    layers: dict[tuple[str, int], Site] = field(default_factory=dict)  # input = resid_pre
    # (stack, layer) -> (layer module, which call, [(role, heads), ...])
    layer_calls: dict[tuple[str, int], tuple[nn.Module, int, list]] = field(default_factory=dict)
    refused: dict[tuple[str, int, str], str] = field(default_factory=dict)
    stacks: list[str] = field(default_factory=list)
    heads: dict[tuple[str, int, str], int] = field(default_factory=dict)
    d_model: int | None = None  # the residual stream's width


def _tensors(x: Any) -> list[Tensor]:
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for t in x if isinstance(t, Tensor)]
    return []


class _Scan(TorchFunctionMode):
    """Tracks attention patterns and outputs through shape ops (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.level: dict[int, tuple[int, Tensor, list]] = {}  # id -> (level, tensor, sources)
        self.events: list[tuple] = []

    def mark(self, t: Tensor, level: int, sources: list) -> None:
        self.level[id(t)] = (level, t, sources)

    def of(self, t: Any) -> tuple[int, list]:
        got = self.level.get(id(t)) if isinstance(t, Tensor) else None
        if got is None or got[1] is not t:
            return 0, []
        return got[0], got[2]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if func in SOFTMAX:
            self.events.append(("attn",))
            for t in _tensors(out):
                self.mark(t, PATTERN, [])
        elif func is SDPA or (FLEX is not None and func is FLEX):
            self.events.append(("attn",))
            for t in _tensors(out)[:1]:
                self.mark(t, OUTPUT, [("sdpa", t)])
        elif name in _ADD:
            ts = [a for a in list(args) + list(kwargs.values()) if isinstance(a, Tensor)]
            if len(ts) == 2 and ts[0].shape == ts[1].shape:
                self.events.append(("add", ts[0], ts[1]))
        elif name in _MATMUL or name in _SHAPE:
            ins = [
                a
                for a in list(args) + list(kwargs.values())
                for a in ([a] if isinstance(a, Tensor) else _tensors(a))
            ]
            levels = [self.of(a) for a in ins]
            top = max((lv for lv, _ in levels), default=0)
            if top:
                srcs = [s for _, ss in levels for s in ss]
                if name in _MATMUL:
                    if top == PATTERN:
                        for t in _tensors(out):
                            self.mark(t, OUTPUT, [("matmul", t)])
                else:
                    for t in _tensors(out):
                        self.mark(t, top, srcs)
        return out


def _weighted_leaf(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return isinstance(w, Tensor) and w.dim() == 2 and not list(m.children())


def scan(model: nn.Module, run, layer_paths: set[str]) -> list[tuple]:
    """Run ``run()`` once, returning the ordered events: ``("enter", path, module, args)`` and
    ``("exit", path)`` of layer modules, ``("attn",)`` for each attention op, and ``("leaf",
    name, module, call, x, out, level, sources)`` for each weighted leaf call."""
    mode = _Scan()
    counts: dict[int, int] = {}
    handles = []
    for name, m in model.named_modules(remove_duplicate=False):
        if name in layer_paths:
            handles.append(
                m.register_forward_pre_hook(lambda mod, a, _n=name: mode.events.append(("enter", _n, mod, a)))
            )
            handles.append(
                m.register_forward_hook(lambda mod, a, o, _n=name: mode.events.append(("exit", _n)))
            )
        if _weighted_leaf(m):

            def hook(mod, args, out, _n=name):
                x = args[0] if args else None
                n = counts.get(id(mod), 0)
                counts[id(mod)] = n + 1
                lv, srcs = mode.of(x)
                mode.events.append(("leaf", _n, mod, n, x, out, lv, srcs))

            handles.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad(), mode:
            run()
    finally:
        for h in handles:
            h.remove()
    return mode.events


def _layout(x: Tensor, heads: int, d_head: int, sources: list) -> str:
    """Check that ``x [..., heads*d_head]`` is the attention output with head h at slice h."""
    whole = [t for kind, t in sources if t.dim() == 4 and t.shape[1] == heads and t.shape[-1] == d_head]
    if len(whole) == 1 and x.dim() == 3:
        o = whole[0]
        if o.shape[0] == x.shape[0] and o.shape[2] == x.shape[1]:
            if not torch.equal(o.transpose(1, 2).reshape(x.shape).to(x.dtype), x):
                raise ProbeError("layout")
            return "heads whole"
    per = [t for kind, t in sources if t.dim() == x.dim() and t.shape[-1] == d_head]
    if len(per) == heads and all(t.shape[:-1] == x.shape[:-1] for t in per):
        if not torch.equal(torch.cat(per, -1).to(x.dtype), x):
            raise ProbeError("layout")
        return "per-head modules"
    return ""


def _roles(entry: dict) -> list[tuple[str, int]]:
    return [(r, entry[f"{r}_attn"]["heads"]) for r in ("self", "cross") if f"{r}_attn" in entry]


def _layer_calls(events: list[tuple], path: str) -> list[list[tuple]]:
    """The events inside each call of the layer module ``path`` (nested calls of it included once)."""
    calls, depth, cur = [], 0, None
    starts = []
    for e in events:
        if e[0] == "enter" and e[1] == path:
            depth += 1
            if depth == 1:
                cur = []
                starts.append(e)
            continue
        if e[0] == "exit" and e[1] == path:
            depth -= 1
            if depth == 0:
                calls.append(cur)
            continue
        if depth:
            cur.append(e)
    return list(zip(starts, calls, strict=False))


def _attention_sites(inner: list[tuple], d_model: int) -> tuple[list[tuple], list[tuple]]:
    """``(projections, leaves)`` of one layer call: each attention's projection leaf event in order,
    and all weighted leaf events."""
    projs, pending, leaves = [], False, []
    for e in inner:
        if e[0] == "attn":
            pending = True
        elif e[0] == "leaf":
            leaves.append(e)
            out = e[5]
            if pending and e[6] == OUTPUT and isinstance(out, Tensor) and out.shape[-1] == d_model:
                projs.append(e)
                pending = False
    return projs, leaves


def locate(model: nn.Module, prepared: Any, cache: Any) -> Sites:
    """The :class:`Sites` of ``model`` on ``prepared`` inputs, ``cache`` a capture of that call."""
    entries = [e for e in cache.metadata.get("layers", []) if _roles(e)]
    sites = Sites()
    for e in entries:
        if e["stack"] not in sites.stacks:
            sites.stacks.append(e["stack"])
    by_path: dict[str, list[dict]] = {}
    for e in entries:
        by_path.setdefault(e["module"], []).append(e)
    events = scan(model, prepared.run, set(by_path))
    for path, group in by_path.items():
        calls = _layer_calls(events, path)
        for k, e in enumerate(group):
            stack, layer = e["stack"], e["layer"]
            for role, heads in _roles(e):
                sites.heads[(stack, layer, role)] = heads
            if k >= len(calls):
                for role, _ in _roles(e):
                    sites.refused[(stack, layer, role)] = "its layer module was not seen running"
                continue
            pre = (
                cache[f"{stack}.blocks.{layer}.resid_pre"]
                if f"{stack}.blocks.{layer}.resid_pre" in cache
                else None
            )
            d_model = pre.shape[-1] if pre is not None else None
            sites.d_model = sites.d_model or d_model
            start, inner = calls[k]
            sites.layer_calls[(stack, layer)] = (start[2], k, _roles(e))
            _place_layer(sites, e, start, k, pre)
            projs, leaves = _attention_sites(inner, d_model or -1)
            _place_attention(sites, e, projs)
            _place_mlp(sites, e, leaves, cache, (inner, projs, d_model))
    return sites


def _place_attention(sites: Sites, e: dict, projs: list[tuple]) -> None:
    stack, layer, roles = e["stack"], e["layer"], _roles(e)
    if len(projs) != len(roles):
        why = (
            "its attention output reaches no output-projection module (a fused kernel, or W_O "
            "applied with einsum/matmul)"
            if len(projs) < len(roles)
            else "more attention output projections were found than attentions"
        )
        for role, _ in roles:
            sites.refused[(stack, layer, role)] = why
        return
    for (role, heads), p in zip(roles, projs, strict=True):
        _, name, mod, call, x, _out, _lv, srcs = p
        width = x.shape[-1]
        if width % heads:
            sites.refused[(stack, layer, role)] = (
                f"its output projection {name} reads {width} features, not a multiple of {heads} heads"
            )
            continue
        try:
            layout = _layout(x, heads, width // heads, srcs)
        except ProbeError:
            sites.refused[(stack, layer, role)] = (
                f"the input of {name} is not the heads side by side in order (head layout check failed)"
            )
            continue
        sites.attention[(stack, layer, role)] = Site(
            stack, layer, role, mod, name, call, heads, width // heads, layout
        )


def _place_mlp(sites: Sites, e: dict, leaves: list[tuple], cache: Any, call: tuple) -> None:
    stack, layer = e["stack"], e["layer"]
    k = f"{stack}.blocks.{layer}.mlp.delta"
    kind = (e.get("deltas") or {}).get("mlp")
    if k in cache and kind == "stream difference":
        _place_post_norm_mlp(sites, e, *call)
        return
    if k not in cache or kind != "sublayer output":
        sites.refused[(stack, layer, "mlp")] = "the cache has no MLP delta that is a sublayer's output"
        return
    delta = cache[k]
    for _, name, mod, call, _x, out, _lv, _srcs in reversed(leaves):
        if isinstance(out, Tensor) and out.shape == delta.shape and torch.equal(out.to(delta.dtype), delta):
            sites.mlp[(stack, layer)] = Site(stack, layer, "mlp", mod, name, call)
            return
    sites.refused[(stack, layer, "mlp")] = "no weighted module's output is exactly the MLP's delta"


def _place_post_norm_mlp(sites: Sites, e: dict, inner: list[tuple], projs: list[tuple], d_model) -> None:
    """A post-norm layer (``norm(x + mlp(x))``): the MLP's output is the last weighted leaf of
    the stream's width after the attention projections, placed only if the layer's own code adds
    it (bit for bit) to the very tensor the MLP's first weighted leaf read."""
    stack, layer = e["stack"], e["layer"]
    start = inner.index(projs[-1]) + 1 if projs else 0
    after = [ev for ev in inner[start:] if ev[0] == "leaf"]
    outs = [ev for ev in after if isinstance(ev[5], Tensor) and ev[5].shape[-1] == d_model]
    if after and outs and isinstance(after[0][4], Tensor):
        o, x = outs[-1], after[0][4]
        for ev in inner[inner.index(o) + 1 :]:
            if ev[0] != "add":
                continue
            a, b = ev[1], ev[2]
            if a.shape == o[5].shape == x.shape and (
                (torch.equal(a, o[5]) and torch.equal(b, x)) or (torch.equal(b, o[5]) and torch.equal(a, x))
            ):
                sites.mlp[(stack, layer)] = Site(stack, layer, "mlp", o[2], o[1], o[3])
                return
    sites.refused[(stack, layer, "mlp")] = (
        "a post-norm layer whose MLP output probe could not see added to the MLP's input"
    )


def _place_layer(sites: Sites, e: dict, start: tuple, call: int, pre: Tensor | None) -> None:
    """The layer module as a site whose first argument is ``resid_pre`` (checked bit for bit)."""
    _, path, mod, args = start
    x = args[0] if args else None
    if (
        pre is None
        or not isinstance(x, Tensor)
        or x.shape != pre.shape
        or not torch.equal(x.to(pre.dtype), pre)
    ):
        sites.refused[(e["stack"], e["layer"], "resid")] = (
            "its layer module's first argument is not the residual stream"
        )
        return
    sites.layers[(e["stack"], e["layer"])] = Site(e["stack"], e["layer"], "resid", mod, path, call)
