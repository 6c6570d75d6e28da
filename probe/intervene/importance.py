"""Head importance: ``probe.head_importance(model, inputs, metric="loss", how="zero")``.

For every attention head, the metric's change when that head alone is removed (as
:func:`probe.ablate` removes it), next to the gradient estimate of Michel,
Levy & Neubig (2019, "Are Sixteen Heads Really Better than One?"): put a gate ``ξ_h`` (1) on head
``h``'s output and take ``∂metric/∂ξ_h``, which is ``Σ_positions x_h · ∂metric/∂x_h`` with ``x_h``
the head's slice of the output projection's input (one forward and one backward for all heads).
Removing a head moves ``ξ_h`` from 1 to 0, so ``-gradient`` is the first-order estimate of the
zero-ablation ``change``; Michel et al. rank heads by ``|gradient|`` summed over a dataset.

The ablations run batched: one forward per layer (or per ``max_batch`` rows), the inputs
repeated once per head along the batch and row block ``h`` getting head ``h`` removed at the
same place (the output projection's input), the metric taken per block from its per-example
form. Where that is not possible (a metric function of the whole outputs, a model that does not
run on repeated inputs or does not return one row per input row) it runs one forward per head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from probe.analysis.interventions import HeadImportance
from probe.analysis.table import Table
from probe.errors import ProbeError
from probe.forward import has_outputs, outputs_of
from probe.intervene.ablate import build_edits
from probe.intervene.core import choose_stack, media_kw, prepare_sites
from probe.intervene.edits import Edit, applied
from probe.intervene.metrics import metric_tensor
from probe.intervene.patch import padded_ids

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
    processor: Any = None,
    text: Any = None,
    sampling_rate: Any = None,
    batched: bool = True,
    max_batch: int = 64,
) -> HeadImportance:
    """The :class:`HeadImportance` of every ``role`` attention head of ``stack`` on ``inputs``.

    ``metric``: ``"loss"`` (default), ``"logit_diff"`` (with ``answer``/``wrong``), ``"prob"``
    (``answer``) or a function of the outputs returning a 0-d tensor; ``how``: ``"zero"`` or
    ``"mean"`` (over ``reference``, default the inputs). ``batched``: run the heads of a layer as
    rows of one forward, the inputs repeated once per head (at most ``max_batch`` rows a forward);
    done for the built-in metrics where the model's outputs come back one row per input row, else
    (or with ``batched=False``) one forward per head, said in ``notes``. ``inputs``: texts, ids,
    a dict of model arguments, or pictures/sound with ``processor``/``text``/``sampling_rate``,
    as for :func:`probe.capture`.
    """
    if how not in ("zero", "mean"):
        raise ProbeError(f"how= is 'zero' or 'mean' for head importance, not {how!r}")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ProbeError(f"max_batch= is a whole number of rows >= 1, not {max_batch!r}")
    m = media_kw(processor, text, sampling_rate)
    prep = prepare_sites(model, inputs, tokenizer=tokenizer, target=target, **m)
    st = choose_stack(prep, stack)
    layers = sorted({i for s, i, r in prep.sites.heads if s == st and r == role})
    if not layers:
        raise ProbeError(f"{st} has no {role} attention")
    sites = [prep.site(st, i, role) for i in layers]
    ids = padded_ids(prep.meta)
    mask = prep.mask(ids.unsqueeze(-1), st) if ids is not None else None
    fn = metric_tensor(model, metric, answer=answer, wrong=wrong, ids=ids, mask=mask, tokenizer=tokenizer)
    with torch.no_grad():
        base = float(fn(prep.outputs))
    grads = _gradients(prep, sites, fn)
    heads = [(s, h) for s in sites for h in range(s.heads)]
    edits = build_edits(prep, heads, [], how, reference, tokenizer, target)
    notes: list[str] = []
    ablated = _ablated(prep, fn, heads, edits, batched, max_batch, notes)
    H = max(s.heads for s in sites)
    grid = torch.full((len(sites), H), float("nan"))
    gg = torch.full((len(sites), H), float("nan"))
    rows = []
    for (s, h), m in zip(heads, ablated, strict=True):
        li = sites.index(s)
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
    table = Table(rows, COLUMNS, "head importance")
    rownames = [f"L{s.layer}" for s in sites]
    return HeadImportance(fn.name, how, table, grid, gg, rownames, notes=notes, texts=texts)


class _Unbatchable(Exception):
    """Raised inside a batched forward whose rows do not line up with the repeated inputs."""


def _ablated(prep, fn, heads: list, edits: list[Edit], batched: bool, max_batch: int, notes: list) -> list:
    """The metric with each head removed alone: batched per layer where possible (see
    :func:`head_importance`), else one forward per head."""
    out = prep.outputs
    B = outputs_of(out).shape[0] if fn.rows is not None and has_outputs(out) else 0
    why = (
        "batched=False"
        if not batched
        else "the metric is a function of the whole outputs (no per-example form)"
        if fn.rows is None
        else "the model's outputs have no batch of logits"
        if not B
        else ""
    )
    got: list[float] = []
    i = 0
    while i < len(heads):
        site = heads[i][0]
        n = sum(1 for s, _ in heads[i:] if s is site)
        if not why:
            k = max(1, max_batch // B)
            try:
                for j in range(i, i + n, k):
                    got += _batched(prep, fn, site, edits[j : min(j + k, i + n)], B)
            except _Unbatchable as e:
                why, got = str(e), got[:i]
        if why:
            got = got[:i] + [_one(prep, fn, edits[j]) for j in range(i, i + n)]
        i += n
    if batched and why:
        notes.append(f"one forward per head: {why}")
    return got


def _one(prep, fn, edit: Edit) -> float:
    with torch.no_grad(), applied(prep.model, [edit]):
        return float(fn(prep.run()))


def _batched(prep, fn, site, edits: list[Edit], B: int) -> list[float]:
    """Row block ``j`` (``B`` rows: the inputs) gets ``edits[j]``; one forward, one metric per block."""
    k = len(edits)

    def value(x: Tensor) -> Tensor:
        if x.dim() < 2 or x.shape[0] != k * B:
            raise _Unbatchable(
                f"{site.name}'s input is {list(x.shape)}, not {k * B} rows of the repeated inputs"
            )
        y = x.clone()
        for j, e in enumerate(edits):
            rows = slice(j * B, (j + 1) * B)
            y[rows, ..., e.cols] = e.value(x[rows, ..., e.cols]).to(y.dtype)
        return y

    def repeat(v: Any) -> Any:
        if isinstance(v, Tensor) and v.dim() >= 2 and v.shape[0] == B:  # batch-first inputs
            return v.repeat(k, *([1] * (v.dim() - 1)))
        return v

    def pre(mod, args, kwargs):
        return tuple(repeat(a) for a in args), {n: repeat(v) for n, v in kwargs.items()}

    h = prep.model.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad(), applied(prep.model, [Edit(site, "input", None, value)]):
            out = prep.run()
    except _Unbatchable:
        raise
    except Exception as e:  # the model could not run on the repeated inputs
        why = f"the model did not run on its inputs repeated ({type(e).__name__}: {e})"
        raise _Unbatchable(why) from None
    finally:
        h.remove()
    logits = outputs_of(out) if has_outputs(out) else None
    if logits is None or logits.shape[0] != k * B:
        raise _Unbatchable("the model's outputs do not have one row per repeated input row")
    return [float(fn.of_logits(logits[j * B : (j + 1) * B])) for j in range(k)]


def _all_str(inputs: Any) -> bool:
    return isinstance(inputs, (list, tuple)) and bool(inputs) and all(isinstance(t, str) for t in inputs)


__all__ = ["HeadImportance", "head_importance"]
