"""Attention knockout: ``probe.knockout(model, inputs, edges=[(query, keys)], layers=..., heads=...)``.

Blocked query → key edges get ``-inf`` added to the scores the head itself computes, inside the
model's own attention call, so the softmax renormalises over the keys left:

* ``F.scaled_dot_product_attention``: the call's mask is rebuilt as an additive float mask (its
  ``is_causal`` and boolean or float ``attn_mask`` folded in) plus ``-inf`` on the blocked edges
  of the chosen heads; the call then runs as it would (same kernel family, same scale);
* a ``softmax`` over scores (eager attention, per-head modules): ``-inf`` is added to its input.

Which head an attention op computes: a ``[batch, heads, q, k]`` op covers all heads of its
attention; a ``[batch, q, k]`` op (one module per head) covers the next head in order. Edges:
``(q, k)`` with each side an int (negative from the end), a ``range``/``slice``/list of ints, or
None (all). A query left with no key raises a :class:`ProbeError` (its weights would be NaN).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from probe.analysis.residual.exports import TableExports
from probe.analysis.table import Table
from probe.capture.hooks.record import SDPA, SOFTMAX
from probe.errors import ProbeError
from probe.intervene.core import Prepared, choose_stack

COLUMNS = ["stack", "layer", "role", "head", "ops"]


def _index(side: Any, n: int) -> list[int]:
    if side is None:
        return list(range(n))
    if isinstance(side, slice):
        return list(range(n))[side]
    if isinstance(side, int):
        side = [side]
    out = []
    for i in side:
        if not -n <= int(i) < n:
            raise ProbeError(f"position {i} is outside the {n} positions of this attention")
        out.append(int(i) % n)
    return out


def blocked(edges: Any, tq: int, tk: int) -> Tensor:
    """The ``[tq, tk]`` bool matrix of the blocked edges."""
    m = torch.zeros(tq, tk, dtype=torch.bool)
    if isinstance(edges, Tensor):
        if edges.shape != (tq, tk):
            raise ProbeError(f"an edges mask must be [{tq}, {tk}] here, not {list(edges.shape)}")
        return edges.bool().cpu()
    for item in edges:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ProbeError(
                f"an edge is (query, key), each an int, range, slice, list or None; not {item!r}"
            )
        q, k = _index(item[0], tq), _index(item[1], tk)
        m[torch.tensor(q, dtype=torch.long)[:, None], torch.tensor(k, dtype=torch.long)[None, :]] = True
    return m


class _Knock(TorchFunctionMode):
    """Adds -inf to the blocked edges of the chosen heads of the attention ops of chosen layers."""

    def __init__(self, plan: dict[int, dict], edges: Any) -> None:
        super().__init__()
        self.plan = plan  # id(layer module) -> {"call", "roles": [(role, heads, chosen)], "seen": n}
        self.edges = edges
        self.current: dict | None = None
        self.counts: dict[tuple[str, int, str, int], int] = {}

    def _heads(self, n: int) -> list[tuple]:
        """``[(role, head, chosen?), ...]`` for the next ``n`` heads of the current layer's attention."""
        cur = self.current
        out = []
        for _ in range(n):
            ri, h = cur["cursor"]
            if ri >= len(cur["roles"]):
                return []
            role, H, chosen = cur["roles"][ri]
            out.append((role, h, h in chosen))
            cur["cursor"] = (ri, h + 1) if h + 1 < H else (ri + 1, 0)
        return out

    def _add(self, scores_shape, heads_dim: bool, dtype, device) -> Tensor | None:
        tq, tk = scores_shape[-2], scores_shape[-1]
        n = scores_shape[1] if heads_dim else 1
        hs = self._heads(n)
        if not hs or not any(c for _, _, c in hs):
            return None
        b = blocked(self.edges, tq, tk).to(device)
        per = torch.stack([b if c else torch.zeros_like(b) for _, _, c in hs])  # [n, tq, tk]
        for role, h, c in hs:
            if c:
                key = (self.current["stack"], self.current["layer"], role, h)
                self.counts[key] = self.counts.get(key, 0) + 1
        add = torch.zeros(per.shape, dtype=dtype, device=device).masked_fill(per, float("-inf"))
        return add if heads_dim else add[0]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.current is None:
            return func(*args, **kwargs)
        if func is SDPA:
            return self._sdpa(func, args, kwargs)
        if func in SOFTMAX:
            x = args[0]
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(x, Tensor) and x.dim() in (3, 4) and dim in (-1, x.dim() - 1):
                add = self._add(x.shape, x.dim() == 4, x.dtype, x.device)
                if add is not None:
                    x = x + add
                    _check_rows(x)
                    return func(x, *args[1:], **kwargs)
        return func(*args, **kwargs)

    def _sdpa(self, func, args, kwargs):
        names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"]
        a = dict(zip(names, args, strict=False))
        a.update(kwargs)
        q, k = a["query"], a["key"]
        add = self._add((q.shape[0], q.shape[1], q.shape[-2], k.shape[-2]), q.dim() == 4, q.dtype, q.device)
        if add is None:
            return func(*args, **kwargs)
        tq, tk = q.shape[-2], k.shape[-2]
        base = torch.zeros(tq, tk, dtype=q.dtype, device=q.device)
        if a.get("is_causal"):
            base = base.masked_fill(
                ~torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(), float("-inf")
            )
        m = a.get("attn_mask")
        if m is not None:
            base = base.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else base + m
        mask = base + add
        _check_rows(mask.expand(*q.shape[:-2], tq, tk) if mask.dim() <= q.dim() else mask)
        a["attn_mask"], a["is_causal"] = mask, False
        return func(**a)


def _check_rows(scores: Tensor) -> None:
    if bool(torch.isneginf(scores).all(-1).any()):
        raise ProbeError("the knockout leaves a query with no key to attend to; block fewer edges")


@dataclass
class Knockout(TableExports):
    """``outputs`` with the edges blocked, ``clean`` without; ``table``: per knocked-out head the
    number of attention ``ops`` edited (0 rows: nothing was placed); ``summary`` as :class:`Ablation`'s."""

    outputs: Any
    clean: Any
    table: Table
    summary: dict[str, float] = field(default_factory=dict)

    def main_table(self) -> Table:
        return self.table

    def to_dict(self) -> dict[str, Any]:
        return {"table": self.table.to_dict(), "summary": dict(self.summary)}

    def __str__(self) -> str:
        return f"{self.table}\n" + ", ".join(f"{k} {v:.4g}" for k, v in self.summary.items())


def knock_plan(
    prep: Prepared,
    *,
    layers: list[int] | None = None,
    heads: list[int] | None = None,
    stack: str | None = None,
    role: str = "self",
) -> dict[int, dict]:
    """Which heads of which layer calls to knock out: ``{id(layer module): {"module", "calls":
    {call: {"stack", "layer", "roles": [(role, heads, chosen heads)]}}}}``."""
    if role not in ("self", "cross"):
        raise ProbeError(f"role= is 'self' or 'cross', not {role!r}")
    st = choose_stack(prep, stack)
    have = sorted(i for (s, i, r) in prep.sites.heads if s == st and r == role)
    if not have:
        raise ProbeError(f"{st} has no {role} attention")
    chosen_layers = have if layers is None else [int(i) for i in layers]
    for i in chosen_layers:
        if i not in have:
            raise ProbeError(f"{st} layer {i} has no {role} attention; layers with one: {have}")
    plan: dict[int, dict] = {}
    for (s, i), (mod, call, roles) in prep.sites.layer_calls.items():
        if s != st:
            continue
        rs = []
        for r, H in roles:
            if r == role and i in chosen_layers:
                sel = set(range(H)) if heads is None else {int(h) for h in heads}
                bad = [h for h in sel if not 0 <= h < H]
                if bad:
                    raise ProbeError(
                        f"{st} layer {i} has {H} heads (0..{H - 1}); head {bad[0]} does not exist"
                    )
            else:
                sel = set()
            rs.append((r, H, sel))
        plan.setdefault(id(mod), {"module": mod, "calls": {}})["calls"][call] = {
            "stack": s,
            "layer": i,
            "roles": rs,
        }
    return plan


def knock_table(plan: dict[int, dict], counts: dict) -> Table:
    """Per knocked-out head the number of attention ops edited; a :class:`ProbeError` naming the
    layer if a chosen head was never edited (see :func:`_check_placed`)."""
    _check_placed(plan, counts)
    rows = [
        {"stack": s, "layer": i, "role": r, "head": h, "ops": n} for (s, i, r, h), n in sorted(counts.items())
    ]
    return Table(rows, COLUMNS, "knockout")


def _check_placed(plan: dict[int, dict], counts: dict) -> None:
    """Every chosen head must have had its scores edited; otherwise say which layer was not."""
    for entry in plan.values():
        for spec in entry["calls"].values():
            for role, _, chosen in spec["roles"]:
                for h in sorted(chosen):
                    if (spec["stack"], spec["layer"], role, h) not in counts:
                        raise ProbeError(
                            f"cannot place a knockout in {spec['stack']} layer {spec['layer']} "
                            f"({role}-attention head {h}): probe saw no SDPA or softmax of that head "
                            "it can edit (a fused kernel?)"
                        )


@contextmanager
def knocked(model: nn.Module, plan: dict[int, dict], edges: Any) -> Iterator[_Knock]:
    """The knockout of ``plan`` installed for every forward of ``model`` inside the block (hooks on
    the layer modules and a torch function mode); yields the mode (``.counts``: ops edited)."""
    mode = _Knock(plan, edges)
    counts: dict[int, int] = {}
    stack: list = []
    handles = [model.register_forward_pre_hook(lambda m, a: counts.clear())]

    def enter(mod, args):
        n = counts.get(id(mod), 0)
        counts[id(mod)] = n + 1
        spec = plan[id(mod)]["calls"].get(n)
        stack.append(mode.current)
        mode.current = None if spec is None else dict(spec, cursor=(0, 0))

    def leave(mod, args, out):
        mode.current = stack.pop()

    for entry in plan.values():
        handles.append(entry["module"].register_forward_pre_hook(enter))
        handles.append(entry["module"].register_forward_hook(leave))
    try:
        with mode:
            yield mode
    finally:
        for h in handles:
            h.remove()


__all__ = ["Knockout", "knock_plan", "knock_table", "knocked", "blocked"]
