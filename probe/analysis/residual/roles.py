"""Which parameter plays which role: the module-tree reading behind :func:`~.budget.budget`.

Only shapes and names are read (works on ``meta`` models). The steps, in the order
:func:`parameter_rows` runs them: the lists of layers (:func:`stacks`), the model width and vocabulary
(:func:`dims`), the unembedding (:func:`unembedding`), the projections inside each layer
(:func:`layer_projections`), their roles (:func:`projection_roles`, :func:`mha_roles`), and one row
per (parameter, role) (:func:`parameter_rows`). The rules are listed in :mod:`.budget`.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from probe.errors import ProbeError

Proj = tuple[str, nn.Module, tuple[int, int]]  # module path, module, (in, out)


def proj_shape(m: nn.Module) -> tuple[int, int] | None:
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


def stacks(model: nn.Module) -> dict[str, int]:
    """Module path -> layer index, for every child of a list of layers."""
    layers: dict[str, int] = {}
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            kids = list(m.named_children())
            # a list of layers: numbered children of one type (not a Sequential pipeline of parts)
            if kids and all(k.isdigit() for k, _ in kids) and len({type(c) for _, c in kids}) == 1:
                # a list of layers holds projections in each child; skip lists of heads inside a layer
                if any(proj_shape(x) for _, c in kids for x in c.modules()) and not any(
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


def dims(model: nn.Module, layer_of: dict[str, int]) -> tuple[int, int | None]:
    embs = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    cfg = getattr(model, "config", None)
    d = getattr(cfg, "hidden_size", None) if cfg is not None else None
    if not isinstance(d, int):
        d = getattr(cfg, "n_embd", None) if cfg is not None else None
    if not isinstance(d, int):
        widths = Counter(m.embedding_dim for m in embs)
        if not widths:
            widths = Counter(s[0] for m in model.modules() if (s := proj_shape(m)))
        if not widths:
            raise ProbeError("the model has no embedding and no projection; probe cannot read its anatomy")
        d = widths.most_common(1)[0][0]
    vocab = getattr(cfg, "vocab_size", None) if cfg is not None else None
    return d, vocab if isinstance(vocab, int) else None


@dataclass
class Tree:
    """A model's layers and shared tensors, read once.

    ``layer_of``: module path of each layer -> its index. ``tied``: first name of a shared tensor ->
    its other names. ``owner``: parameter name -> (module path, module, parameter's own name).
    """

    model: nn.Module
    layer_of: dict[str, int]
    tied: dict[str, list[str]] = field(default_factory=dict)
    owner: dict[str, tuple[str, nn.Module, str]] = field(default_factory=dict)

    @classmethod
    def read(cls, model: nn.Module) -> Tree:
        tree = cls(model, stacks(model))
        first: dict[int, str] = {}  # every parameter once; later names of a tensor are "tied" to the first
        tied: dict[str, list[str]] = defaultdict(list)
        for n, p in model.named_parameters(remove_duplicate=False):
            if id(p) in first:
                tied[first[id(p)]].append(n)
            else:
                first[id(p)] = n
        tree.tied = dict(tied)
        for mname, m in model.named_modules():
            for pname, _ in m.named_parameters(recurse=False):
                tree.owner[f"{mname}.{pname}" if mname else pname] = (mname, m, pname)
        return tree

    def where(self, path: str) -> tuple[str, int | None, str]:
        """``(stack, layer, rest)`` of a module or parameter path; ``("", None, path)`` outside layers."""
        best = ""
        for p in self.layer_of:
            if (path == p or path.startswith(p + ".")) and len(p) > len(best):
                best = p
        if not best:
            return "", None, path
        stack = best.rsplit(".", 1)[0] if "." in best else ""
        return stack, self.layer_of[best], path[len(best) + 1 :]


def unembedding(tree: Tree, d: int, cfg_vocab: int | None) -> str | None:
    """The module path of the last projection ``d -> vocabulary`` outside the layers, or None."""
    model = tree.model
    vocabs = {
        m.num_embeddings
        for mn, m in model.named_modules()
        if isinstance(m, nn.Embedding) and not tree.where(mn)[0]
    }
    if cfg_vocab:
        vocabs.add(cfg_vocab)
    unembed = None
    for mn, m in model.named_modules():
        s = proj_shape(m)
        if s and not tree.where(mn)[0] and s[0] == d and s[1] in vocabs:
            unembed = mn
    return unembed


def layer_projections(tree: Tree, unembed: str | None) -> dict[tuple[str, int | None], list[Proj]]:
    """The projections inside each layer, by (stack, layer), in registration order.

    A model without a list of layers (one block at the top) is read as one layer.
    """
    per_layer: dict[tuple[str, int | None], list[Proj]] = defaultdict(list)
    for mn, m in tree.model.named_modules():
        s = proj_shape(m)
        stack, layer, _ = tree.where(mn)
        if s and (stack or not tree.layer_of) and mn != unembed:
            per_layer[(stack, layer)].append((mn, m, s))
    return per_layer


def projection_roles(per_layer, d: int) -> tuple[dict[str, str], dict[str, list[tuple[str, int]]]]:
    """``(role_of, split_qkv)``: weight name -> role, and fused weight name -> [(role, count)]."""
    role_of: dict[str, str] = {}
    split_qkv: dict[str, list[tuple[str, int]]] = {}
    for projs in per_layer.values():
        d_ffs = {s[0] for _, _, s in projs if s[1] == d and s[0] != d}
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
            if s[0] == d and s[1] == 3 * d:  # fused [q | k | v]
                split_qkv[mn + ".weight"] = [("W_Q", d * d), ("W_K", d * d), ("W_V", d * d)]
                continue
            r = _attn_role(mn.rsplit(".", 1)[-1])
            if r is None:
                r = "W_O" if named else next(order, "other")
            role_of[mn + ".weight"] = r
    return role_of, split_qkv


def mha_roles(model: nn.Module, role_of: dict[str, str], split_qkv: dict[str, list[tuple[str, int]]]) -> None:
    """Add the roles of ``nn.MultiheadAttention``'s raw input-projection parameters (in place)."""
    for mn, m in model.named_modules():
        if isinstance(m, nn.MultiheadAttention):
            if m.in_proj_weight is not None:
                e = m.embed_dim
                split_qkv[f"{mn}.in_proj_weight"] = [("W_Q", e * e), ("W_K", e * m.kdim), ("W_V", e * m.vdim)]
            for r, pn in (("W_Q", "q_proj_weight"), ("W_K", "k_proj_weight"), ("W_V", "v_proj_weight")):
                if getattr(m, pn, None) is not None:
                    role_of[f"{mn}.{pn}"] = r
            role_of[f"{mn}.out_proj.weight"] = "W_O"


def _embedding_role(mname: str, p: Any, stack: str) -> str:
    pos = bool(_tokens(mname) & {"pos", "position", "positions", "wpe", "positional"}) or (
        not p.requires_grad and not any(_tokens(mname) & {"tok", "token", "word", "wte"})
    )
    if stack or _tokens(mname) & {"type", "types", "segment"}:
        return "other"
    return "position embedding" if pos else "token embedding"


def _other_role(m: nn.Module, pname: str, p: Any, d: int) -> str:
    if pname.endswith("bias") and (proj_shape(m) or isinstance(m, nn.MultiheadAttention)):
        return "biases"
    if p.dim() == 1 and not proj_shape(m) and p.shape[0] == d:
        return "norms"
    if pname.endswith("bias") and p.dim() == 1:
        return "biases"
    return "other"


def parameter_rows(tree: Tree, d: int, unembed: str | None, per_layer) -> list[dict[str, Any]]:
    """One row per (parameter, role): name, role, stack, layer, shape, parameters, tied.

    A fused Q/K/V weight gives three rows; a shared tensor appears once, under its first name.
    """
    role_of, split_qkv = projection_roles(per_layer, d)
    mha_roles(tree.model, role_of, split_qkv)
    rows = []
    for n, p in tree.model.named_parameters():
        mname, m, pname = tree.owner[n]
        stack, layer, _ = tree.where(n)
        count = p.numel()
        if n in split_qkv:
            parts = split_qkv[n]
        elif n in role_of:
            parts = [(role_of[n], count)]
        elif isinstance(m, nn.Embedding):
            parts = [(_embedding_role(mname, p, stack), count)]
        elif mname == unembed and pname == "weight":
            parts = [("unembedding", count)]
        else:
            parts = [(_other_role(m, pname, p, d), count)]
        for role, c in parts:
            rows.append(
                {
                    "name": n,
                    "role": role,
                    "stack": stack,
                    "layer": "" if layer is None else layer,
                    "shape": "×".join(str(x) for x in p.shape),
                    "parameters": c,
                    "tied": ", ".join(tree.tied.get(n, [])),
                }
            )
    return rows


def d_ff(per_layer, d: int) -> int | None:
    """The most common MLP width (input of a ``d_ff -> d`` projection), or None without an MLP."""
    c = Counter(s[0] for projs in per_layer.values() for _, _, s in projs if s[1] == d and s[0] != d)
    return c.most_common(1)[0][0] if c else None
