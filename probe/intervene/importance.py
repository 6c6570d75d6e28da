"""Head importance: ``probe.head_importance(model, inputs, metric="loss", how="zero")``.

For every attention head, the metric's change when that head alone is removed (as
:func:`probe.ablate` removes it: one forward per head), next to the gradient estimate of Michel,
Levy & Neubig (2019, "Are Sixteen Heads Really Better than One?"): put a gate ``ξ_h`` (1) on head
``h``'s output and take ``∂metric/∂ξ_h``, which is ``Σ_positions x_h · ∂metric/∂x_h`` with ``x_h``
the head's slice of the output projection's input (one forward and one backward for all heads).
Removing a head moves ``ξ_h`` from 1 to 0, so ``-gradient`` is the first-order estimate of the
zero-ablation ``change``; Michel et al. rank heads by ``|gradient|`` summed over a dataset.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from probe.analysis.interventions import HeadImportance
from probe.analysis.table import Table
from probe.errors import ProbeError
from probe.intervene.ablate import build_edits
from probe.intervene.core import _stack, prepare_sites
from probe.intervene.edits import Edit, applied
from probe.intervene.metrics import metric_tensor
from probe.intervene.patch import _ids

COLUMNS = ["stack", "layer", "role", "head", "component", "metric", "ablated", "change", "gradient"]


def _gradients(prep, sites: list, fn) -> list[Tensor]:
    """``∂metric/∂ξ_h`` for every head of every site: ``[heads]`` per site."""
    kept: dict[int, Tensor] = {}
    edits = []
    for i, s in enumerate(sites):

        def keep(x: Tensor, _i=i) -> Tensor:
            x = x.detach().requires_grad_(True)
            kept[_i] = x
            return x

        edits.append(Edit(s, "input", None, keep))
    # the edit copies x into a new tensor: gradients flow to the kept leaf through that copy
    with torch.enable_grad(), applied(prep.model, edits):
        m = fn(prep.run())
        if not m.requires_grad:
            raise ProbeError("the metric does not depend on the model's outputs differentiably; no gradients")
        grads = torch.autograd.grad(m, [kept[i] for i in range(len(sites))], allow_unused=True)
    out = []
    for s, x, g in zip(sites, [kept[i] for i in range(len(sites))], grads, strict=True):
        if g is None:
            out.append(torch.zeros(s.heads))
            continue
        prod = (x.detach() * g).float().reshape(-1, s.heads, s.d_head)
        out.append(prod.sum((0, 2)))
    return out


def head_importance(
    model: nn.Module,
    inputs: Any,
    *,
    metric: Any = "loss",
    how: str = "zero",
    answer: Any = None,
    wrong: Any = None,
    stack: str | None = None,
    role: str = "self",
    reference: Any = None,
    tokenizer: Any = None,
    target: Any = None,
) -> HeadImportance:
    """The :class:`HeadImportance` of every ``role`` attention head of ``stack`` on ``inputs``.

    ``metric``: ``"loss"`` (default), ``"logit_diff"`` (with ``answer``/``wrong``), ``"prob"``
    (``answer``) or a function of the outputs returning a 0-d tensor; ``how``: ``"zero"`` or
    ``"mean"`` (over ``reference``, default the inputs).
    """
    if how not in ("zero", "mean"):
        raise ProbeError(f"how= is 'zero' or 'mean' for head importance, not {how!r}")
    prep = prepare_sites(model, inputs, tokenizer=tokenizer, target=target)
    st = _stack(prep, stack)
    layers = sorted({i for s, i, r in prep.sites.heads if s == st and r == role})
    if not layers:
        raise ProbeError(f"{st} has no {role} attention")
    sites = [prep.site(st, i, role) for i in layers]
    ids = _ids(prep.meta)
    mask = prep.mask(ids.unsqueeze(-1), st) if ids is not None else None
    name, fn = metric_tensor(
        model, metric, answer=answer, wrong=wrong, ids=ids, mask=mask, tokenizer=tokenizer
    )
    with torch.no_grad():
        base = float(fn(prep.outputs))
    grads = _gradients(prep, sites, fn)
    H = max(s.heads for s in sites)
    grid = torch.full((len(sites), H), float("nan"))
    gg = torch.full((len(sites), H), float("nan"))
    rows = []
    for li, s in enumerate(sites):
        for h in range(s.heads):
            edits = build_edits(prep, [(s, h)], [], how, reference, tokenizer, target)
            with torch.no_grad(), applied(model, edits):
                m = float(fn(prep.run()))
            grid[li, h], gg[li, h] = m - base, float(grads[li][h])
            rows.append(
                {
                    "stack": st,
                    "layer": s.layer,
                    "role": role,
                    "head": h,
                    "component": f"L{s.layer}.H{h}",
                    "metric": base,
                    "ablated": m,
                    "change": m - base,
                    "gradient": float(grads[li][h]),
                }
            )
    texts = [inputs] if isinstance(inputs, str) else list(inputs) if _all_str(inputs) else []
    return HeadImportance(
        name,
        how,
        Table(rows, COLUMNS, "head importance"),
        grid,
        gg,
        [f"L{s.layer}" for s in sites],
        texts=texts,
    )


def _all_str(inputs: Any) -> bool:
    return isinstance(inputs, (list, tuple)) and bool(inputs) and all(isinstance(t, str) for t in inputs)


__all__ = ["HeadImportance", "head_importance"]
