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

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from probe.analysis.residual.configs import as_model
from probe.analysis.residual.exports import TableExports
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


# -- the module tree -------------------------------------------------------------------------------
def _proj_shape(m: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` of a projection-like module: Linear, HF Conv1D (``nf``), Conv1d with kernel 1."""
    w = getattr(m, "weight", None)
    if w is None or not hasattr(w, "shape"):
        return None
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    if isinstance(m, nn.Conv1d) and w.dim() == 3 and w.shape[-1] == 1:
        return w.shape[1], w.shape[0]
    nf = getattr(m, "nf", None)
    if isinstance(nf, int) and w.dim() == 2 and w.shape[1] == nf:  # transformers' Conv1D: x @ W
        return w.shape[0], nf
    return None


def _stacks(model: nn.Module) -> dict[str, int]:
    """Module path -> layer index, for every child of a list of layers."""
    layers: dict[str, int] = {}
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            kids = list(m.named_children())
            # a list of layers: numbered children of one type (not a Sequential pipeline of parts)
            if kids and all(k.isdigit() for k, _ in kids) and len({type(c) for _, c in kids}) == 1:
                # a list of layers holds projections in each child; skip lists of heads inside a layer
                if any(_proj_shape(x) for _, c in kids for x in c.modules()) and not any(
                    name.startswith(p + ".") for p in layers
                ):
                    for k, _ in kids:
                        layers[f"{name}.{k}" if name else k] = int(k)
    return layers


def _tokens(name: str) -> set[str]:
    return set(re.split(r"[._]", name.lower()))


_Q, _K, _V = {"q", "query", "wq", "queries"}, {"k", "key", "wk", "keys"}, {"v", "value", "wv", "values"}


def _attn_role(leaf: str) -> str | None:
    t = _tokens(leaf)
    for role, names in (("W_Q", _Q), ("W_K", _K), ("W_V", _V)):
        if t & names:
            return role
    return None


def _dims(model: nn.Module, layer_of: dict[str, int]) -> tuple[int, int | None]:
    embs = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    cfg = getattr(model, "config", None)
    d = getattr(cfg, "hidden_size", None) if cfg is not None else None
    if not isinstance(d, int):
        d = getattr(cfg, "n_embd", None) if cfg is not None else None
    if not isinstance(d, int):
        widths = Counter(m.embedding_dim for m in embs)
        if not widths:
            widths = Counter(s[0] for m in model.modules() if (s := _proj_shape(m)))
        if not widths:
            raise ProbeError("the model has no embedding and no projection; probe cannot read its anatomy")
        d = widths.most_common(1)[0][0]
    vocab = getattr(cfg, "vocab_size", None) if cfg is not None else None
    return d, vocab if isinstance(vocab, int) else None


def budget(model_or_config: Any) -> Budget:
    """The parameter :class:`Budget` of a model, a Hugging Face config, or ``"gpt3"``.

    A config (a ``transformers.PretrainedConfig``, a dict with ``model_type``, or a path to a
    ``config.json``) is built on the ``meta`` device, so even a GPT-3-sized model costs no memory.
    """
    model = as_model(model_or_config)
    preset = isinstance(model_or_config, str) and model_or_config.lower() == "gpt3"
    layer_of = _stacks(model)
    d, cfg_vocab = _dims(model, layer_of)

    def where(path: str) -> tuple[str, int | None, str]:
        best = ""
        for p in layer_of:
            if (path == p or path.startswith(p + ".")) and len(p) > len(best):
                best = p
        if not best:
            return "", None, path
        stack = best.rsplit(".", 1)[0] if "." in best else ""
        return stack, layer_of[best], path[len(best) + 1 :]

    # every parameter once; later names of the same tensor are "tied" to the first
    first: dict[int, str] = {}
    tied: dict[str, list[str]] = defaultdict(list)
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[first[id(p)]].append(n)
        else:
            first[id(p)] = n
    owner: dict[str, tuple[str, nn.Module, str]] = {}
    for mname, m in model.named_modules():
        for pname, _ in m.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            owner[full] = (mname, m, pname)

    embeddings = {mn: m for mn, m in model.named_modules() if isinstance(m, nn.Embedding)}
    vocabs = {m.num_embeddings for mn, m in embeddings.items() if not where(mn)[0]}
    if cfg_vocab:
        vocabs.add(cfg_vocab)
    unembed = None
    for mn, m in model.named_modules():
        s = _proj_shape(m)
        if s and not where(mn)[0] and s[0] == d and s[1] in vocabs:
            unembed = mn
    role_of: dict[str, str] = {}
    # projections inside each layer, grouped by layer, in registration order
    per_layer: dict[tuple[str, int], list[tuple[str, nn.Module, tuple[int, int]]]] = defaultdict(list)
    for mn, m in model.named_modules():
        s = _proj_shape(m)
        stack, layer, _ = where(mn)
        if s and (stack or not layer_of) and mn != unembed:
            # a model without a list of layers (one block at the top) is read as one layer
            per_layer[(stack, layer)].append((mn, m, s))
    split_qkv: dict[str, list[tuple[str, int]]] = {}
    for projs in per_layer.values():
        downs = [(mn, s) for mn, _, s in projs if s[1] == d and s[0] != d]
        d_ffs = {s[0] for _, s in downs}
        attn: list[tuple[str, tuple[int, int]]] = []
        for mn, _m, s in projs:
            if s[1] == d and s[0] in d_ffs:
                role_of[mn + ".weight"] = "MLP down"
            elif s[0] == d and s[1] in d_ffs and s[1] != 3 * d:
                role_of[mn + ".weight"] = "MLP up"
            else:
                attn.append((mn, s))
        order = iter(("W_Q", "W_K", "W_V", "W_O"))
        # with a fused [q | k | v] or named q/k/v projections, the remaining one is the output
        named = any(_attn_role(x.rsplit(".", 1)[-1]) or (s[0] == d and s[1] == 3 * d) for x, s in attn)
        for mn, s in attn:
            leaf = mn.rsplit(".", 1)[-1]
            if s[0] == d and s[1] == 3 * d:  # fused [q | k | v]
                split_qkv[mn + ".weight"] = [("W_Q", d * d), ("W_K", d * d), ("W_V", d * d)]
                continue
            r = _attn_role(leaf)
            if r is None:
                r = "W_O" if named else next(order, "other")
            role_of[mn + ".weight"] = r
    # nn.MultiheadAttention keeps its input projection as raw parameters
    for mn, m in model.named_modules():
        if isinstance(m, nn.MultiheadAttention):
            if m.in_proj_weight is not None:
                e = m.embed_dim
                split_qkv[f"{mn}.in_proj_weight"] = [("W_Q", e * e), ("W_K", e * m.kdim), ("W_V", e * m.vdim)]
            for r, pn in (("W_Q", "q_proj_weight"), ("W_K", "k_proj_weight"), ("W_V", "v_proj_weight")):
                if getattr(m, pn, None) is not None:
                    role_of[f"{mn}.{pn}"] = r
            role_of[f"{mn}.out_proj.weight"] = "W_O"

    rows = []
    for n, p in model.named_parameters():
        mname, m, pname = owner[n]
        stack, layer, _ = where(n)
        count = p.numel()
        parts: list[tuple[str, int]]
        if n in split_qkv:
            parts = split_qkv[n]
        elif n in role_of:
            parts = [(role_of[n], count)]
        elif isinstance(m, nn.Embedding):
            pos = bool(_tokens(mname) & {"pos", "position", "positions", "wpe", "positional"}) or (
                not p.requires_grad and not any(_tokens(mname) & {"tok", "token", "word", "wte"})
            )
            kind = "position embedding" if pos else "token embedding"
            if stack or _tokens(mname) & {"type", "types", "segment"}:
                kind = "other"
            parts = [(kind, count)]
        elif mname == unembed and pname == "weight":
            parts = [("unembedding", count)]
        elif pname.endswith("bias") and (_proj_shape(m) or isinstance(m, nn.MultiheadAttention)):
            parts = [("biases", count)]
        elif p.dim() == 1 and not _proj_shape(m) and p.shape[0] == d:
            parts = [("norms", count)]
        elif pname.endswith("bias") and p.dim() == 1:
            parts = [("biases", count)]
        else:
            parts = [("other", count)]
        for role, c in parts:
            rows.append(
                {
                    "name": n,
                    "role": role,
                    "stack": stack,
                    "layer": "" if layer is None else layer,
                    "shape": "×".join(str(x) for x in p.shape),
                    "parameters": c,
                    "tied": ", ".join(tied.get(n, [])),
                }
            )
    total = sum(r["parameters"] for r in rows)
    by_role = Counter()
    for r in rows:
        by_role[r["role"]] += r["parameters"]
    role_rows = [
        {"role": r, "parameters": by_role.get(r, 0), "share": by_role.get(r, 0) / total if total else 0.0}
        for r in ROLES
    ]
    layer_acc: dict[tuple[str, Any], Counter] = defaultdict(Counter)
    for r in rows:
        layer_acc[(r["stack"], r["layer"])][r["role"]] += r["parameters"]
    layer_rows = []
    for (stack, layer), c in sorted(
        layer_acc.items(), key=lambda kv: (kv[0][0], kv[0][1] if kv[0][1] != "" else -1)
    ):
        row = {"stack": stack, "layer": layer, "total": sum(c.values())}
        row.update({r: c.get(r, 0) for r in ROLES})
        layer_rows.append(row)
    notes = []
    tied_to: dict[str, str] = {}
    first_role = {r["name"]: r["role"] for r in rows}
    for n, others in tied.items():
        notes.append(f"{n} is shared with {', '.join(others)}: counted once, as {first_role[n]}")
        if unembed is not None and f"{unembed}.weight" in others and first_role[n] != "unembedding":
            tied_to["unembedding"] = first_role[n]
    d_ff = _d_ff(per_layer, d)
    vocab_out = next((_proj_shape(m)[1] for mn, m in model.named_modules() if mn == unembed), None)
    has_tok = by_role.get("token embedding", 0) > 0
    journey = [("token id", 1), ("embedding", d)] if has_tok else [("input", d)]
    journey.append(("attention", d))
    if d_ff:
        journey += [("MLP up", d_ff), ("MLP down", d)]
    if vocab_out:
        journey.append(("unembedding", vocab_out))
    dims = {"d_model": d, "d_ff": d_ff or 0, "vocab": vocab_out or 0, "layers": len(layer_of)}
    name = getattr(getattr(model, "config", None), "model_type", None) or getattr(model, "name", "")
    if preset:
        name = "GPT-3 (175B shape)"
    return Budget(
        Table(rows, ["name", "role", "stack", "layer", "shape", "parameters", "tied"], "parameters"),
        Table(role_rows, ["role", "parameters", "share"], "parameters by role"),
        Table(layer_rows, ["stack", "layer", "total", *ROLES], "parameters by layer"),
        total,
        sum(by_role.get(r, 0) for r in MATRIX_ROLES),
        journey,
        dims,
        str(name or type(model).__name__),
        notes,
        tied_to,
    )


def _d_ff(per_layer, d: int) -> int | None:
    c = Counter(s[0] for projs in per_layer.values() for _, _, s in projs if s[1] == d and s[0] != d)
    return c.most_common(1)[0][0] if c else None


__all__ = ["Budget", "budget", "ROLES", "MATRIX_ROLES"]
