"""Q-, K- and V-composition between heads, from the weights (Elhage et al. 2021, "A Mathematical
Framework for Transformer Circuits").

Head A (layer l1) writes ``x W_OV^A`` with ``W_OV^A = W_V^A W_O^A`` ``[d, d]`` (row vectors, ``x @ W``).
A head B of a later layer reads the stream three ways: through its queries and keys, ``W_QK^B =
W_Q^B W_K^B^T`` (the score between a query ``x`` and a key ``y`` is ``x W_QK^B y^T``), and through
its values, ``W_OV^B``. How much of what A writes B can read::

    Q-composition  ||W_OV^A W_QK^B  ||_F / (||W_OV^A||_F ||W_QK^B||_F)    A's write in B's queries
    K-composition  ||W_OV^A W_QK^B^T||_F / (||W_OV^A||_F ||W_QK^B||_F)    ... in B's keys
    V-composition  ||W_OV^A W_OV^B  ||_F / (||W_OV^A||_F ||W_OV^B||_F)    ... in B's values

Each score lies in [0, 1]. Under grouped-query attention a head's ``W_K``/``W_V`` are those of its
key/value head. What the score holds and leaves out:

* **norms folded in**: each head's ``W_Q``, ``W_K``, ``W_V`` are read through the norm before
  them, its weight folded in (``diag(w) W``; RMSNorm with ``1 + w`` as such), and for a
  LayerNorm also its centring (``(I - 11^T/d) diag(w) W``): the division by the norm's scale is a
  number per position and leaves the ratio unchanged. Norm biases and projection biases are left
  out (they do not depend on what A writes). In a post-norm model the norms between A and B are
  not folded (the score is that of the weights alone);
* **position-free**: rotary embeddings rotate queries and keys by their positions, so the real
  ``W_QK`` depends on the distance between query and key; the score uses ``W_Q W_K^T`` without
  rotation (distance 0). Additive position biases (ALiBi, T5) are left out as well;
* heads in the same stack, self-attention only (cross-attention heads read another stream).

The products are computed in factored form (``W_OV^A = W_V^A W_O^A`` has rank ``d_head``): QR
factors of each ``W`` make every norm one of ``d_head x d_head`` matrices, so all pairs of a 30-layer
model cost a few matrix products of the stream's width, not one ``d x d`` product per pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from probe.analysis.residual.exports import TableExports
from probe.analysis.table import Table
from probe.errors import ProbeError
from probe.intervene.anatomy import Anatomy, anatomy

KINDS = ("q", "k", "v")
COLUMNS = ["stack", "src_layer", "src_head", "dst_layer", "dst_head", "q", "k", "v"]


@dataclass
class _Heads:
    """One attention's heads, folded: ``Q`` ``[H, d, dh]``, ``K``/``V`` ``[Hkv, d, dh]`` (one per
    key/value head; ``kv`` maps a head to its own) and ``O`` ``[H, dh, d]``, with the R factors
    that give their norms (expanded to one per head)."""

    layer: int
    Q: Tensor
    K: Tensor
    V: Tensor
    O: Tensor  # noqa: E741
    kv: Tensor

    def __post_init__(self) -> None:
        self.rQ, self.rK, self.rV = _r(self.Q), _r(self.K)[self.kv], _r(self.V)[self.kv]
        self.rO = _r(self.O.transpose(1, 2))  # W_O = R_O^T Q^T: ||X W_O|| = ||X R_O^T||
        self.ov = (self.rV @ self.O).flatten(1).norm(dim=1)  # ||W_OV||_F per head
        self.qk = (self.rQ @ self.rK.transpose(1, 2)).flatten(1).norm(dim=1)  # ||W_QK||_F


def _r(W: Tensor) -> Tensor:
    """The R of ``W = Q R`` for each ``W [H, d, dh]``: ``||W X|| = ||R X||`` for any ``X``."""
    return torch.linalg.qr(W.double(), mode="reduced").R


def _fold(an: Anatomy, norm: nn.Module | None, W: Tensor, where: str) -> Tensor:
    """``W [H, d, dh]`` read through ``norm``: its weight (and a LayerNorm's centring) folded in."""
    form = an.norm_form(norm)
    if form is None:
        raise ProbeError(
            f"{where}: its norm {type(norm).__name__} is not LayerNorm/RMSNorm-like; cannot fold it"
        )
    W = W.double()
    if form.weight is not None:
        W = W * form.weight.double()[None, :, None]
    if form.center:
        W = W - W.mean(dim=1, keepdim=True)  # (I - 11^T/d) W
    return W


def _heads(an: Anatomy, key: tuple) -> _Heads:
    a = an.attention[key]
    where = f"{key[0]} layer {key[1]}"
    for part in ("norm", "kv_norm"):
        an.need(*key, part)
    hw = an.head_weights(*key)
    Q = _fold(an, a.norm, hw.W_Q, where)
    K = _fold(an, a.kv_norm, hw.W_K, where)
    V = _fold(an, a.kv_norm, hw.W_V, where)
    return _Heads(key[1], Q, K, V, hw.W_O.double(), torch.tensor(a.kv_of))


def _pair_scores(A: _Heads, B: _Heads) -> dict[str, Tensor]:
    """``{kind: [H_A, H_B]}`` composition scores of every head of A with every head of B:
    ``||R_V^A (W_O^A W_X^B) R^T||`` over the norms, with ``W_X``/``R`` B's ``W_Q``/``R_K`` (Q),
    ``W_K``/``R_Q`` (K) or ``W_V``/``R_O`` (V). The products over the stream's width are taken
    once per key/value head for K and V (grouped-query attention shares them)."""
    P = (A.rV @ A.O).float()  # [Ha, dh, d]: R_V^A W_O^A
    every = torch.arange(B.Q.shape[0])
    out = {}
    for kind, (mid, which, right, denom) in {
        "q": (B.Q, every, B.rK, B.qk),
        "k": (B.K, B.kv, B.rQ, B.qk),
        "v": (B.V, B.kv, B.rO, B.ov),
    }.items():
        C = torch.einsum("aid,gdf->agif", P, mid.float()).double()[:, which]  # [Ha, Hb, dh, dh']
        num = torch.einsum("abif,bjf->abij", C, right).flatten(2).norm(dim=2)
        out[kind] = (num / (A.ov[:, None] * denom[None, :])).float()
    return out


@dataclass
class Composition(TableExports):
    """Composition scores of every pair of heads in different layers (see the module docstring).

    ``table``: one row per pair (``stack``, ``src_layer``, ``src_head``, ``dst_layer``,
    ``dst_head``, ``q``, ``k``, ``v``); ``scores[(stack, src_layer, dst_layer)][kind]``
    ``[src heads, dst heads]``; ``notes``: what the scores leave out and what was refused."""

    table: Table
    scores: dict[tuple[str, int, int], dict[str, Tensor]]
    notes: list[str] = field(default_factory=list)

    def main_table(self) -> Table:
        return self.table

    def top(self, n: int = 10, by: str = "k") -> Table:
        """The ``n`` pairs with the highest ``by`` score (``"q"``, ``"k"`` or ``"v"``)."""
        if by not in KINDS:
            raise ProbeError(f"by= is one of {', '.join(KINDS)}, not {by!r}")
        if n < 1:
            raise ProbeError(f"n must be at least 1, got {n}")
        t = self.table.sorted(by)
        return Table(t.rows[:n], t.columns, f"top {n} by {by}-composition")

    def score(
        self, src: tuple[int, int], dst: tuple[int, int], kind: str = "k", *, stack: str | None = None
    ) -> float:
        """The ``kind`` score of head ``src = (layer, head)`` into head ``dst = (layer, head)``."""
        stacks = sorted({k[0] for k in self.scores})
        st = stack if stack is not None else (stacks[0] if len(stacks) == 1 else None)
        got = self.scores.get((st, src[0], dst[0]))
        if got is None or kind not in KINDS:
            raise ProbeError(
                f"no {kind}-composition score from layer {src[0]} to layer {dst[0]} (stack {st})"
            )
        return float(got[kind][src[1], dst[1]])

    def to_dict(self) -> dict[str, Any]:
        return {"pairs": self.table.to_dict(), "notes": list(self.notes)}

    def __repr__(self) -> str:
        return f"Composition({len(self.table)} head pairs; .top(10, by='k'))"


def _all_pairs(heads: dict) -> dict[tuple[str, int, int], dict[str, Tensor]]:
    """Every pair's scores, written into one tensor per stack made first (views of it returned):
    small results kept between the products' large temporaries would pin the heap (glibc)."""
    out = {}
    for stack in dict.fromkeys(k[0] for k in heads):
        mine = [(k[1], h) for k, h in heads.items() if k[0] == stack]
        at, n = {}, 0
        for layer, h in mine:
            at[layer] = slice(n, n + h.Q.shape[0])
            n += h.Q.shape[0]
        full = torch.full((len(KINDS), n, n), float("nan"))
        for la, A in mine:
            for lb, B in mine:
                if lb > la:
                    s = _pair_scores(A, B)
                    for i, kind in enumerate(KINDS):
                        full[i, at[la], at[lb]] = s[kind]
                    out[(stack, la, lb)] = {kind: full[i, at[la], at[lb]] for i, kind in enumerate(KINDS)}
    return out


def _default_inputs(model: nn.Module) -> Tensor:
    """Eight token ids (1..8) for a model whose vocabulary probe can see, else a ProbeError."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    vocab = vocab or getattr(getattr(model, "tokenizer", None), "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 9:
        raise ProbeError(
            "pass inputs= one example the model takes (a text, ids, pictures): probe runs it once to "
            "find each head's weights; the scores themselves do not depend on it"
        )
    return torch.arange(1, 9)[None]


def composition(model: nn.Module | Anatomy, inputs: Any = None, **kwargs: Any) -> Composition:
    """Q/K/V composition of every pair of heads in different layers of ``model``.

    ``model``: a model, or an :class:`~probe.intervene.anatomy.Anatomy` already found. ``inputs``:
    one example the model takes (only used to find the heads' weights; default eight token ids
    where the vocabulary is known); other keyword arguments go to
    :func:`~probe.intervene.anatomy.anatomy` (``tokenizer``, ``processor``, ...)."""
    an = (
        model
        if isinstance(model, Anatomy)
        else anatomy(model, inputs if inputs is not None else _default_inputs(model), **kwargs)
    )
    notes, heads = [], {}
    for key in an.attention:
        if key[2] != "self":
            continue
        try:
            heads[key] = _heads(an, key)
        except ProbeError as err:
            notes.append(f"{key[0]} layer {key[1]} left out: {err}")
    notes += [
        f"{k[0]} layer {k[1]} left out: {why}"
        for k, why in an.refused.items()
        if len(k) == 3 and k[2] == "self"
    ]
    scores, rows = _all_pairs(heads), []
    for (sa, la, lb), s in scores.items():
        q, k, v = (s[x].tolist() for x in KINDS)
        for i in range(len(q)):
            for j in range(len(q[i])):
                rows.append(dict(zip(COLUMNS, (sa, la, i, lb, j, q[i][j], k[i][j], v[i][j]), strict=True)))
    if not rows:
        raise ProbeError(
            "no two attention layers of this model have heads probe can read: "
            + "; ".join(notes or ["one layer only"])
        )
    if any(a.delta == "stream difference" for a in an.attention.values()):
        notes.append("post-norm: the norms between two layers are not folded into the scores")
    return Composition(Table(rows, COLUMNS, "composition scores"), scores, notes)


__all__ = ["composition", "Composition"]
