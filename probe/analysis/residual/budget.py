"""The parameter budget: where a model's parameters live, by role and by layer.

Roles: token embedding, position embedding, W_Q, W_K, W_V, W_O, MLP up, MLP down, norms, biases,
unembedding, other. They are read from the module tree, not from class names:

* the *layers* are the numbered children of a ``ModuleList``/``Sequential`` (one stack per list);
* ``d_model`` is the embedding width; the *unembedding* is the last projection outside the layers
  whose output size is a token embedding's vocabulary (or the model's ``vocab_size``);
* inside a layer, a projection ``d_ff -> d_model`` (``d_ff != d_model``) is the MLP's down
  projection and every ``d_model -> d_ff`` one an up projection (a gate counts as up); the other
  projections belong to attention: a fused one (``d_model -> 3·d_model``, ``in_proj_weight``) is
  split into equal Q, K and V thirds, separate ones are told apart by their attribute names
  (``q``/``query``, ``k``/``key``, ``v``/``value``; anything else, e.g. ``proj``/``o``/``out``/
  ``dense``/``linear``, is the output projection) or, without such names, by order Q, K, V, O;
* 1-D weights of a module without a projection are norms; projection biases are biases;
* a parameter shared by several modules (tied embedding and unembedding) is counted once, under
  its first role, and marked ``tied`` with the other names.

Works on models built on the ``meta`` device (no memory): only shapes are read; configs become
such models in :mod:`.configs`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from probe.analysis.residual.configs import as_model
from probe.analysis.residual.exports import TableExports
from probe.analysis.residual.roles import (
    Tree,
    d_ff,
    dims,
    layer_projections,
    parameter_rows,
    proj_shape,
    unembedding,
)
from probe.analysis.table import Table
from probe.errors import ProbeError

ROLES = (
    "token embedding",
    "position embedding",
    "W_Q",
    "W_K",
    "W_V",
    "W_O",
    "MLP up",
    "MLP down",
    "norms",
    "biases",
    "unembedding",
    "other",
)
MATRIX_ROLES = ("token embedding", "W_Q", "W_K", "W_V", "W_O", "MLP up", "MLP down", "unembedding")


@dataclass
class Budget(TableExports):
    """A model's parameters by role and layer.

    ``params``: one row per parameter tensor (name, role, stack, layer, shape, count, tied).
    ``by_role``: count and share per role. ``by_layer``: per (stack, layer) and role (``layer`` is
    ``""`` outside the layers). ``total`` counts each shared tensor once and equals
    ``sum(p.numel() for p in model.parameters())``; ``matrices`` is the tutorial's total (token
    embedding, W_Q, W_K, W_V, W_O, MLP up and down, unembedding); ``journey`` the token's shapes.
    ``tied_to``: a role whose weight is another role's tensor (a tied unembedding) -> the role it
    is counted under; ``notes`` name every shared tensor.
    """

    params: Table
    by_role: Table
    by_layer: Table
    total: int
    matrices: int
    journey: list[tuple[str, int]]
    dims: dict[str, int]
    name: str = ""
    notes: list[str] = field(default_factory=list)
    tied_to: dict[str, str] = field(default_factory=dict)

    def main_table(self) -> Table:
        """The table ``to_json``/``to_csv``/``to_pandas`` export."""
        return self.by_role

    def role(self, name: str) -> int:
        """The parameter count of role ``name`` (one of :data:`ROLES`)."""
        if name not in ROLES:
            raise ProbeError(f"unknown role {name!r}; choose one of: {', '.join(ROLES)}")
        return next(r["parameters"] for r in self.by_role if r["role"] == name)

    def to_dict(self) -> dict[str, Any]:
        """Totals, roles, layers, parameters and the journey as plain Python."""
        return {
            "name": self.name,
            "total": self.total,
            "matrices": self.matrices,
            "dims": dict(self.dims),
            "journey": [list(j) for j in self.journey],
            "by_role": self.by_role.to_dict(),
            "by_layer": self.by_layer.to_dict(),
            "params": self.params.to_dict(),
            "notes": list(self.notes),
            "tied_to": dict(self.tied_to),
        }

    def journey_text(self) -> str:
        """``1 → 12288 → 49152 → 12288 → 50257`` with the stage names."""
        return " → ".join(f"{n:,} ({s})" for s, n in self.journey)

    def to_text(self) -> str:
        """The by-role table with thousands separators, the totals and the journey."""
        w = max(len(r) for r in ROLES)
        lines = [f"{self.name}  parameter budget" if self.name else "parameter budget"]
        for r in self.by_role:
            tied = self.tied_to.get(r["role"])
            tie = f"  (tied: the {tied}, counted there)" if tied else ""
            lines.append(f"  {r['role']:{w}}  {r['parameters']:>20,}  {100 * r['share']:6.2f}%{tie}")
        lines.append(f"  {'weight matrices':{w}}  {self.matrices:>20,}")
        lines.append(f"  {'total':{w}}  {self.total:>20,}")
        lines.append("journey: " + self.journey_text())
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    __str__ = to_text


def budget(model_or_config: Any) -> Budget:
    """The parameter :class:`Budget` of a model, a Hugging Face config, or ``"gpt3"``.

    A config (a ``transformers.PretrainedConfig``, a dict with ``model_type``, or a path to a
    ``config.json``) is built on the ``meta`` device, so even a GPT-3-sized model costs no memory.
    """
    model = as_model(model_or_config)
    tree = Tree.read(model)
    d, cfg_vocab = dims(model, tree.layer_of)
    unembed = unembedding(tree, d, cfg_vocab)
    per_layer = layer_projections(tree, unembed)
    rows = parameter_rows(tree, d, unembed, per_layer)
    by_role = Counter()
    for r in rows:
        by_role[r["role"]] += r["parameters"]
    notes, tied_to = _shared_notes(tree, rows, unembed)
    journey, dimensions = _journey(model, tree, per_layer, d, unembed, by_role)
    name = getattr(getattr(model, "config", None), "model_type", None) or getattr(model, "name", "")
    if isinstance(model_or_config, str) and model_or_config.lower() == "gpt3":
        name = "GPT-3 (175B shape)"
    return Budget(
        Table(rows, ["name", "role", "stack", "layer", "shape", "parameters", "tied"], "parameters"),
        _role_table(by_role),
        _layer_table(rows),
        sum(r["parameters"] for r in rows),
        sum(by_role.get(r, 0) for r in MATRIX_ROLES),
        journey,
        dimensions,
        str(name or type(model).__name__),
        notes,
        tied_to,
    )


def _role_table(by_role: Counter) -> Table:
    """Count and share of every role in :data:`ROLES` (0 for roles the model lacks)."""
    total = sum(by_role.values())
    rows = [
        {"role": r, "parameters": by_role.get(r, 0), "share": by_role.get(r, 0) / total if total else 0.0}
        for r in ROLES
    ]
    return Table(rows, ["role", "parameters", "share"], "parameters by role")


def _layer_table(rows: list[dict[str, Any]]) -> Table:
    """Per (stack, layer): the total and every role; rows outside the layers (layer ``""``) first."""
    acc: dict[tuple[str, Any], Counter] = defaultdict(Counter)
    for r in rows:
        acc[(r["stack"], r["layer"])][r["role"]] += r["parameters"]
    out = []
    for (stack, layer), c in sorted(
        acc.items(), key=lambda kv: (kv[0][0], kv[0][1] if kv[0][1] != "" else -1)
    ):
        row = {"stack": stack, "layer": layer, "total": sum(c.values())}
        row.update({r: c.get(r, 0) for r in ROLES})
        out.append(row)
    return Table(out, ["stack", "layer", "total", *ROLES], "parameters by layer")


def _shared_notes(tree: Tree, rows, unembed: str | None) -> tuple[list[str], dict[str, str]]:
    """A note per shared tensor, and ``{"unembedding": role}`` when the unembedding is tied."""
    notes = []
    tied_to: dict[str, str] = {}
    first_role = {r["name"]: r["role"] for r in rows}
    for n, others in tree.tied.items():
        notes.append(f"{n} is shared with {', '.join(others)}: counted once, as {first_role[n]}")
        if unembed is not None and f"{unembed}.weight" in others and first_role[n] != "unembedding":
            tied_to["unembedding"] = first_role[n]
    return notes, tied_to


def _journey(model, tree: Tree, per_layer, d: int, unembed: str | None, by_role: Counter):
    """``(journey, dims)``: a token's widths through the model, and d_model/d_ff/vocab/layers."""
    width = d_ff(per_layer, d)
    vocab_out = next((proj_shape(m)[1] for mn, m in model.named_modules() if mn == unembed), None)
    has_tok = by_role.get("token embedding", 0) > 0
    journey = [("token id", 1), ("embedding", d)] if has_tok else [("input", d)]
    journey.append(("attention", d))
    if width:
        journey += [("MLP up", width), ("MLP down", d)]
    if vocab_out:
        journey.append(("unembedding", vocab_out))
    return journey, {"d_model": d, "d_ff": width or 0, "vocab": vocab_out or 0, "layers": len(tree.layer_of)}


__all__ = ["Budget", "budget", "ROLES", "MATRIX_ROLES"]
