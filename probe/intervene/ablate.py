"""Head and sublayer ablation, what :func:`probe.ablate` and :func:`probe.intervene` install.

A head is removed where its output enters the attention's output projection: its slice of the
projection's input (``[..., heads * d_head]``) is replaced by zeros (``"zero"``), by its mean over
the real tokens of a reference run (``"mean"``; the reference defaults to the inputs), or by its
value in the reference run at the same position, text ``b`` taking reference text
``b % len(reference)`` (``"resample"``). A sublayer (``"attn"``, ``"cross_attn"``, ``"mlp"``) is
removed from the residual stream: the output of its output projection (the tensor added to the
stream) is replaced the same way. The model runs on its own attention path (SDPA stays SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from probe.analysis.residual.exports import TableExports
from probe.analysis.table import Table
from probe.errors import ProbeError
from probe.forward import outputs_of
from probe.intervene.core import Prepared, prepare_call, site_label
from probe.intervene.edits import Edit, recording
from probe.intervene.locate import Site

HOWS = ("zero", "mean", "resample")
COLUMNS = ["component", "stack", "layer", "role", "head", "how", "module"]


@dataclass
class Ablation(TableExports):
    """What :func:`ablate` did and what the model returned.

    ``outputs``: the model's return value with the ablation (logits for a language model);
    ``clean``: its return value without. ``table``: one row per removed component (``component``,
    ``stack``, ``layer``, ``role``, ``head`` (None for a sublayer), ``how``, ``module`` (where the
    edit was placed)). ``summary``: ``max_abs_change`` of the output tensor, and for outputs with a
    vocabulary ``mean_kl`` (KL(clean || ablated) of the last-dim softmax, mean over real
    positions) and ``top1_agreement`` (share of real positions whose argmax is unchanged).
    """

    outputs: Any
    clean: Any
    table: Table
    summary: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def main_table(self) -> Table:
        return self.table

    def to_dict(self) -> dict[str, Any]:
        """``{"table": ..., "summary": {...}, "notes": [...]}`` as plain Python."""
        return {"table": self.table.to_dict(), "summary": dict(self.summary), "notes": list(self.notes)}

    def __str__(self) -> str:
        s = ", ".join(f"{k} {v:.4g}" for k, v in self.summary.items())
        return f"{self.table}\n{s}" + "".join(f"\nnote: {n}" for n in self.notes)


def _reference_values(
    prep: Prepared, targets: list[tuple[Site, str]], reference: Any, tokenizer: Any, target: Any
) -> list[Tensor]:
    """The full tensors at ``targets`` in one run of the reference inputs (or the inputs)."""
    model = prep.model
    if reference is None:
        run, meta = prep.run, prep.meta
    else:
        p = prepare_call(model, reference, tokenizer, target, **prep.media)  # pictures: the same processor
        run, meta = p.run, p.meta
    with torch.no_grad(), recording(model, targets) as got:
        run()
    missing = [site_label(s) for i, (s, w) in enumerate(targets) if (i, w) not in got]
    if missing:
        raise ProbeError(
            f"the reference run did not reach {', '.join(missing)}; give a reference like the inputs"
        )
    ref = Prepared(model, run, meta, None, prep.sites, prep.media)
    return [got[(i, w)] for i, (_, w) in enumerate(targets)], ref


def _value(how: str, full: Tensor | None, cols: slice | None, mask: Tensor | None, stack: str):
    """The replacement function for one edit."""
    if how == "zero":
        return torch.zeros_like
    part = full[..., cols] if cols is not None else full
    if how == "mean":
        flat = part[mask] if mask is not None and part.dim() >= 3 else part.reshape(-1, part.shape[-1])
        mean = flat.float().mean(0)
        return lambda x: mean.to(x.dtype).expand_as(x)

    def resample(x: Tensor) -> Tensor:
        if part.shape[1:] != x.shape[1:]:
            raise ProbeError(
                f"resample needs reference texts of the same length as the inputs ({stack}: "
                f"{part.shape[1]} vs {x.shape[1]} positions)"
            )
        rows = torch.arange(x.shape[0], device=part.device) % part.shape[0]
        return part[rows]

    return resample


def build_edits(
    prep: Prepared,
    heads: list[tuple[Site, int]],
    subs: list[Site],
    how: str,
    reference: Any = None,
    tokenizer: Any = None,
    target: Any = None,
) -> list[Edit]:
    """The :class:`Edit` list that removes ``heads`` and sublayers ``subs`` as ``how`` says."""
    if how not in HOWS:
        raise ProbeError(f"how= is one of {', '.join(HOWS)}, not {how!r}")
    if reference is not None and how == "zero":
        raise ProbeError("reference= is for how='mean' or 'resample'; zero ablation needs none")
    places = [(s, "input", slice(h * s.d_head, (h + 1) * s.d_head)) for s, h in heads]
    places += [(s, "output", None) for s in subs]
    fulls: list[Tensor | None] = [None] * len(places)
    ref = prep
    if how != "zero" and places:
        fulls, ref = _reference_values(prep, [(s, w) for s, w, _ in places], reference, tokenizer, target)
    edits = []
    for (s, where, cols), full in zip(places, fulls, strict=True):
        mask = ref.mask(full, s.stack) if full is not None else None
        edits.append(Edit(s, where, cols, _value(how, full, cols, mask, s.stack)))
    return edits


def effect(clean: Any, outputs: Any, mask: Tensor | None, d_model: int | None = None) -> dict[str, float]:
    """``max_abs_change``, and ``mean_kl``/``top1_agreement`` over real positions (see :class:`Ablation`)
    when the output is logits (its last dimension is not the stream's width ``d_model``)."""
    try:
        a, b = outputs_of(clean).float(), outputs_of(outputs).float()
    except TypeError:
        return {}
    out = {"max_abs_change": (a - b).abs().max().item() if a.numel() else 0.0}
    if a.dim() >= 2 and a.shape[-1] > 1 and a.shape == b.shape and a.shape[-1] != d_model:
        la, lb = a.log_softmax(-1), b.log_softmax(-1)
        kl = (la.exp() * (la - lb)).sum(-1)
        same = (a.argmax(-1) == b.argmax(-1)).float()
        if mask is not None and mask.shape == kl.shape:
            kl, same = kl[mask], same[mask]
        out["mean_kl"] = kl.mean().item()
        out["top1_agreement"] = same.mean().item()
    return out


def ablation_rows(heads: list[tuple[Site, int]], subs: list[Site], how: str) -> Table:
    """The :class:`Ablation` table: one row per removed head, then per removed sublayer."""
    items = [(s, h) for s, h in heads] + [(s, None) for s in subs]
    rows = [
        {
            "component": site_label(s, h),
            "stack": s.stack,
            "layer": s.layer,
            "role": s.role,
            "head": h,
            "how": how,
            "module": s.name,
        }
        for s, h in items
    ]
    return Table(rows, COLUMNS, "ablation")


__all__ = ["Ablation", "ablation_rows", "build_edits", "effect", "HOWS"]
