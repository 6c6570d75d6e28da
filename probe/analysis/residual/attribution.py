"""Direct logit attribution: each part of the residual stream's share of the predicted token's logit.

The final stream is a sum: ``resid_post = embed + Σ ΔE`` (``embed`` = ``resid_pre`` of layer 0).
With the final norm's scale frozen at its value for the full stream (a documented linearisation:
each part is read as if the others set the scale), the read-out is affine, so the logit of the
predicted token ``t`` splits exactly::

    logit_t = Σ_parts W_U[t] · norm_lin(part) + (W_U[t] · β + b_U[t])

``norm_lin(x) = γ ⊙ (x - center·mean(x)) / scale(full stream)``. The parts plus the constant sum to
the model's logit up to floating-point rounding (``Attribution.max_error``; the test states the
bound). An attention sublayer whose delta is exactly its output projection's output is split
further by head: the projection's input is cut into the heads' slices, each slice sent through
the projection alone (its bias is its own part), and the heads plus bias must sum to the delta.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from probe.analysis.residual.exports import TableExports
from probe.analysis.residual.stream import layer_components
from probe.analysis.table import Table

COLUMNS = ["batch", "pos", "token", "predicted", "component", "layer", "sublayer", "head", "contribution"]


@dataclass
class Attribution(TableExports):
    """Direct logit attribution of the predicted token at every position.

    ``table`` rows: component ``"embed"``, ``"L<i>.<sublayer>"`` (kind ``sublayer``, these sum to the
    logit with ``constant``) and ``"L<i>.<sublayer>.h<j>"``/``".bias"`` (the head split, ``head`` set).
    ``logit``, ``constant`` and ``total`` are ``[batch, pos]``; ``max_error`` = max |total - logit|.
    """

    table: Table
    logit: Tensor
    constant: Tensor
    total: Tensor
    max_error: float
    notes: list[str] = field(default_factory=list)

    def main_table(self) -> Table:
        """The table ``to_json``/``to_csv``/``to_pandas`` export."""
        return self.table

    def bars(self, batch: int = 0, pos: int = -1, heads: bool = False) -> list[tuple[str, float]]:
        """``[(component, contribution), ...]`` at one position (sublayers, or heads when ``heads``)."""
        if pos < 0:
            pos = max(r["pos"] for r in self.table if r["batch"] == batch)
        out = []
        for r in self.table:
            if r["batch"] != batch or r["pos"] != pos:
                continue
            if (r["head"] != "") == heads:
                out.append((r["component"], r["contribution"]))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The attribution table as plain Python, with the error and notes."""
        return {"table": self.table.to_dict(), "max_error": self.max_error, "notes": list(self.notes)}


def _head_split(calls: list, delta: Tensor, heads: int) -> tuple[list[Tensor], Tensor] | None:
    """Per-head parts ``[batch, pos, d]`` and the bias of the projection whose output is ``delta``."""
    for c in calls:
        out, x = c.output, c.input
        if not (isinstance(out, Tensor) and isinstance(x, Tensor)) or out.shape != delta.shape:
            continue
        if x.shape[:-1] != delta.shape[:-1] or x.shape[-1] % heads:
            continue
        if not torch.allclose(out.float(), delta, rtol=0, atol=1e-6 * (1 + delta.abs().max().item())):
            continue
        dh = x.shape[-1] // heads
        with torch.no_grad():
            zero = c.module(torch.zeros_like(x)).float()
            parts = []
            for h in range(heads):
                xh = torch.zeros_like(x)
                xh[..., h * dh : (h + 1) * dh] = x[..., h * dh : (h + 1) * dh]
                parts.append(c.module(xh).float() - zero)
        # the projection must be linear in its input for the split to be exact
        if (sum(parts) + zero - delta).abs().max().item() > 1e-4 * (1 + delta.abs().max().item()):
            return None
        return parts, zero
    return None


def attribute(ps, lens) -> Attribution | None:
    """The :class:`Attribution` of a recorded pass (``lens`` supplies tokens and predictions)."""
    ro = ps.readout
    if ro.frozen is None:
        lens.notes.append(
            "no direct logit attribution: the final norm is neither LayerNorm- nor RMSNorm-like, "
            "so its scale cannot be frozen; pass norm= a LayerNorm/RMSNorm"
        )
        return None
    final = ps.cache[f"{ps.stack}.blocks.{ps.layers[-1]}.resid_post"].float()
    scale = ro.frozen.scale(final)
    pred = lens.predicted
    w = ro.W[pred]  # [B, T, d]: the predicted token's unembedding direction

    def score(part: Tensor) -> Tensor:
        return (ro.frozen.linear(part.float(), scale) * w).sum(-1)

    const = torch.zeros(pred.shape)
    if ro.frozen.bias is not None:
        const = const + (ro.frozen.bias * w).sum(-1)
    if ro.b is not None:
        const = const + ro.b[pred]
    comps, notes, total = _components(ps, score, pred.shape)
    total = total + const
    logit = ps.logits.gather(-1, pred.unsqueeze(-1)).squeeze(-1)
    err = (total - logit).abs()[ps.mask].max().item()
    rows = _rows(ps, lens, comps)
    return Attribution(Table(rows, COLUMNS, "direct logit attribution"), logit, const, total, err, notes)


def _components(ps, score, shape) -> tuple[list[tuple[str, int | None, str, str, Tensor]], list[str], Tensor]:
    """``(components, notes, total)``: every part's score [B, T] (embedding, each sublayer, each
    head and the projection bias where the attention delta splits by head), and the sum of the
    embedding and sublayer scores (the head rows split a sublayer's score, they are not added)."""
    cache, stack = ps.cache, ps.stack
    heads_of = {
        (e.get("stack"), e.get("layer"), r): e[f"{r}_attn"]["heads"]
        for e in cache.metadata.get("layers", [])
        for r in ("self", "cross")
        if f"{r}_attn" in e
    }
    comps: list[tuple[str, int | None, str, str, Tensor]] = []
    notes: list[str] = []
    total = torch.zeros(shape)
    if ps.layers[0] != 0:
        notes.append("layer 0 is not in the cache: the embedding part is missing from the sum")
    if (cache.metadata.get("stacks", {}).get(stack) or {}).get("chain") is False:
        notes.append(
            f"the {stack}'s layers do not chain (the model computes between them: a layer's input "
            "is not the previous layer's output), so the parts do not sum to the final stream"
        )
    for i in ps.layers:
        pre, parts, _ = layer_components(cache, stack, i)
        if i == 0:
            s = score(pre)
            total += s
            comps.append(("embed", None, "", "", s))
        for sub, d in parts:
            s = score(d)
            total += s
            comps.append((f"L{i}.{sub}", i, sub, "", s))
            role = sub.split("_")[0]
            if not sub.endswith("_attn") or (stack, i, role) not in heads_of:
                continue
            split = _head_split(ps.calls, d, heads_of[(stack, i, role)])
            if split is None:
                notes.append(
                    f"L{i}.{sub}: not split by head (its delta is not exactly one output projection's "
                    "output, e.g. a norm or a fused kernel sits between them)"
                )
                continue
            hparts, bias = split
            for h, hp in enumerate(hparts):
                comps.append((f"L{i}.{sub}.h{h}", i, sub, str(h), score(hp)))
            comps.append((f"L{i}.{sub}.bias", i, sub, "bias", score(bias)))
    return comps, notes, total


def _rows(ps, lens, comps) -> list[dict]:
    """One row per real (batch, position) and component, in :data:`COLUMNS`."""
    pred, real = lens.predicted, ps.mask
    vals = [(name, layer, sub, head, s.tolist()) for name, layer, sub, head, s in comps]
    rows = []
    B, T = pred.shape
    for b in range(B):
        for t in range(T):
            if not real[b, t]:
                continue
            for name, layer, sub, head, s in vals:
                rows.append(
                    {
                        "batch": b,
                        "pos": t,
                        "token": ps.tokens[b][t],
                        "predicted": lens.token(int(pred[b, t])),
                        "component": name,
                        "layer": layer,
                        "sublayer": sub,
                        "head": head,
                        "contribution": s[b][t],
                    }
                )
    return rows


__all__ = ["Attribution", "attribute"]
