"""Residual-stream statistics: how much each sublayer writes into the stream, ``E' = E + ΔE``.

For every captured layer, sublayer (self-attention, cross-attention, MLP, in the order they
write) and token, :func:`residual` measures the stream ``E`` the sublayer reads-and-writes (the
layer input plus the deltas written before it), the delta ``ΔE``, their L2 norms, the ratio
``|ΔE| / |E|`` and ``cos(ΔE, E)``, and which sublayer of the layer writes most for that token.

A layer captured with ``resid_pre``/``resid_post`` but without per-sublayer deltas (the capture
engine could not split it, see ``layers[i]["residual_note"]`` in the cache metadata) gets one row
for the whole layer (``sublayer="layer"``, ``ΔE = resid_post - resid_pre``) and a note: probe
does not guess how the change divides among the sublayers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from probe.analysis.residual.exports import TableExports
from probe.analysis.table import Table
from probe.cache.format import key, parse_key, token_side
from probe.errors import ProbeError

SUBLAYERS = ("self_attn", "cross_attn", "mlp")
TOKEN_COLUMNS = [
    "stack",
    "layer",
    "sublayer",
    "batch",
    "pos",
    "token",
    "norm_E",
    "norm_dE",
    "ratio",
    "cos",
    "writes_most",
]
LAYER_COLUMNS = [
    "stack",
    "layer",
    "sublayer",
    "tokens",
    "mean_norm_E",
    "mean_norm_dE",
    "mean_ratio",
    "mean_cos",
    "writes_most_share",
    "mean_norm_post",
]


@dataclass
class ResidualStats(TableExports):
    """Per-token (``tokens``) and per-layer (``layers``) residual-stream statistics.

    ``tokens`` rows: one per (stack, layer, sublayer, batch, pos) of a real (unpadded) token, with
    ``norm_E`` = |E| (the stream the sublayer adds to), ``norm_dE`` = |ΔE|, ``ratio`` = |ΔE|/|E|,
    ``cos`` = cos(ΔE, E) and ``writes_most`` (this sublayer has the largest |ΔE| in its layer for
    this token). ``layers`` rows: the means over tokens per (stack, layer, sublayer), the share of
    tokens for which the sublayer writes most, and the mean |resid_post|. ``notes`` say what could
    not be split.
    """

    tokens: Table
    layers: Table
    notes: list[str] = field(default_factory=list)

    def main_table(self) -> Table:
        """The table ``to_json``/``to_csv``/``to_pandas`` export."""
        return self.layers

    def to_dict(self) -> dict[str, Any]:
        """``{"layers": ..., "tokens": ..., "notes": [...]}`` as plain Python."""
        return {"layers": self.layers.to_dict(), "tokens": self.tokens.to_dict(), "notes": list(self.notes)}

    def __str__(self) -> str:
        notes = "".join(f"\nnote: {n}" for n in self.notes)
        return str(self.layers) + notes


def _tokens_of(cache, stack: str) -> tuple[list[list[str]], list[list[int]]]:
    """The display tokens and attention mask of ``stack``'s positions; none for a stack whose
    positions are not tokens (a vision-language model's vision tower: its pictures' patches)."""
    meta = cache.metadata
    side = token_side(meta, stack)
    if side is None:
        return [], []
    prefix = "target_" if side == "target" and meta.get("target_tokens") else ""
    return meta.get(f"{prefix}tokens") or [], meta.get(f"{prefix}attention_mask") or []


def layer_components(
    cache, stack: str, layer: int
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]], str]:
    """``(resid_pre, [(sublayer, ΔE), ...], note)`` for one layer, in float32 ``[batch, pos, d]``.

    Without per-sublayer deltas the list holds one ``("layer", resid_post - resid_pre)`` and
    ``note`` says why; otherwise ``note`` is empty.
    """
    pre_k, post_k = key(stack, layer, "resid_pre"), key(stack, layer, "resid_post")
    if pre_k not in cache or post_k not in cache:
        raise ProbeError(
            f"the cache has no residual stream for {stack} layer {layer}; capture it again with probe.capture"
        )
    pre = cache[pre_k].float()
    deltas = [
        (s, cache[key(stack, layer, f"{s}.delta")].float())
        for s in SUBLAYERS
        if key(stack, layer, f"{s}.delta") in cache
    ]
    if deltas:
        return pre, deltas, ""
    why = ""
    for e in cache.metadata.get("layers", []):
        if e.get("stack") == stack and e.get("layer") == layer:
            why = e.get("residual_note", "")
    note = (
        f"{stack} layer {layer}: no per-sublayer deltas in the cache"
        + (f" ({why})" if why else "")
        + "; shown as one change for the whole layer (resid_post - resid_pre)"
    )
    return pre, [("layer", cache[post_k].float() - pre)], note


def captured_layers(cache, stack: str) -> list[int]:
    """Layer indices of ``stack`` with a residual stream in the cache, ascending."""
    return sorted(
        {
            layer
            for k in cache.keys()
            if k.endswith("resid_pre")
            for s, layer, _name in [parse_key(k)]
            if s == stack
        }
    )


def _no_stream(cache) -> None:
    """Raise the error for a cache without residual tensors, saying why it has none."""
    if getattr(cache, "kept", None) == "stats":
        raise ProbeError(
            "this cache kept statistics only (keep='stats'): each residual tensor's per-position norm "
            "(<name>.norm), not the tensors this reads; capture again without keep= for them"
        )
    raise ProbeError(
        "the cache holds no residual stream (no resid_pre/resid_post); capture it with probe.capture"
    )


def residual(cache, model: Any = None) -> ResidualStats:
    """Residual-stream statistics of ``cache`` (a :class:`probe.Cache`) per layer, sublayer, token.

    ``model`` is accepted for symmetry with the other analyses and not needed: everything comes
    from the cache. Returns a :class:`ResidualStats`. Padding positions are left out.
    """
    del model
    rows: list[dict[str, Any]] = []
    agg: list[dict[str, Any]] = []
    notes: list[str] = []
    for stack in cache.stacks:
        layers = captured_layers(cache, stack)
        tokens, mask = _tokens_of(cache, stack)
        for layer in layers:
            pre, deltas, note = layer_components(cache, stack, layer)
            if note:
                notes.append(note)
            B, T, _ = pre.shape
            real = torch.ones(B, T, dtype=torch.bool)
            if mask:
                real = torch.tensor(mask, dtype=torch.bool)[:, :T]
            real_l = real.tolist()
            stream = pre
            norms_dE = torch.stack([d.norm(dim=-1) for _, d in deltas])  # (n_sub, B, T)
            most = norms_dE.argmax(dim=0)  # (B, T)
            post_norm = (pre + sum(d for _, d in deltas)).norm(dim=-1)
            for j, (sub, d) in enumerate(deltas):
                nE, nD = stream.norm(dim=-1), d.norm(dim=-1)
                ratio = nD / nE
                cos = torch.nn.functional.cosine_similarity(d, stream, dim=-1, eps=1e-30)
                sel = real
                agg.append(
                    {
                        "stack": stack,
                        "layer": layer,
                        "sublayer": sub,
                        "tokens": int(sel.sum()),
                        "mean_norm_E": nE[sel].mean().item(),
                        "mean_norm_dE": nD[sel].mean().item(),
                        "mean_ratio": ratio[sel].mean().item(),
                        "mean_cos": cos[sel].mean().item(),
                        "writes_most_share": (most[sel] == j).float().mean().item(),
                        "mean_norm_post": post_norm[sel].mean().item(),
                    }
                )
                cols = [x.tolist() for x in (nE, nD, ratio, cos, most == j)]
                for b in range(B):
                    for t in range(T):
                        if not real_l[b][t]:
                            continue
                        tok = tokens[b][t] if b < len(tokens) and t < len(tokens[b]) else str(t)
                        e, dn, rt, cs, mst = (c[b][t] for c in cols)
                        rows.append(
                            {
                                "stack": stack,
                                "layer": layer,
                                "sublayer": sub,
                                "batch": b,
                                "pos": t,
                                "token": tok,
                                "norm_E": e,
                                "norm_dE": dn,
                                "ratio": rt,
                                "cos": cs,
                                "writes_most": mst,
                            }
                        )
                stream = stream + d
    if not agg:
        _no_stream(cache)
    return ResidualStats(
        Table(rows, TOKEN_COLUMNS, "residual stream per token"),
        Table(agg, LAYER_COLUMNS, "residual stream per layer"),
        notes,
    )


__all__ = ["ResidualStats", "residual", "layer_components", "captured_layers", "SUBLAYERS"]
