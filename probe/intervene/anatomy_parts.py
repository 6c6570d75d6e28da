"""The anatomy's data: blocks, attentions, MLPs, per-head weights (see :mod:`probe.intervene.anatomy`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from probe.analysis.residual.head import FrozenNorm
from probe.errors import ProbeError
from probe.intervene.locate import Site


@dataclass
class Block:
    """One head's channels in one projection's output (last dim): ``module(x)[..., cols]``."""

    module: nn.Module  # a weighted leaf: nn.Linear, transformers' Conv1D, ...
    name: str  # its module path
    cols: slice


@dataclass
class AttentionAnatomy:
    """One attention of one layer: its heads' q/k/v blocks, output projection and norm.

    ``norm``: the module applied to the stream before the query projection (None: the query
    reads the stream itself); ``kv_norm`` the same for the key/value side (the same module for
    self-attention; for cross-attention the module between the other stack's last stream and
    the keys). ``d_qk``: the query/key width per head (``d_head`` is the value's, the width of a
    head's slice of the output projection's input). ``delta``: how the capture records the
    attention's delta (``"sublayer output"``: the projection's output is what the stream gets;
    ``"stream difference"``: a norm follows, post-norm). ``out``: locate's output projection;
    head ``h`` reads its input columns ``h*d_head:(h+1)*d_head``.
    """

    stack: str
    layer: int
    role: str  # "self" | "cross"
    heads: int
    kv_heads: int
    d_head: int
    kv_of: list[int]  # head -> its key/value head (GQA); identity for MHA
    norm: nn.Module | None
    q: list[Block]  # one per head
    k: list[Block]  # one per kv head
    v: list[Block]  # one per kv head
    out: Site
    d_qk: int = 0
    kv_norm: nn.Module | None = None
    delta: str = ""
    v_exact: bool = True  # each value block reaches its heads' outputs unchanged (W_V readable)


@dataclass
class MLPAnatomy:
    """One layer's MLP: the norm before it, the weighted leaves that read the normed stream, its
    output leaf (whose output is the MLP's delta) and whether it reads ``resid_pre`` (parallel)."""

    stack: str
    layer: int
    norm: nn.Module | None
    readers: list[nn.Module]
    out: Site
    parallel: bool  # True: reads resid_pre (GPT-J/Falcon), False: resid_pre + attention delta
    reader_names: list[str] = field(default_factory=list)


@dataclass
class HeadWeights:
    """Per-head weights of one attention, row-vector convention (``x @ W``).

    ``W_Q`` ``[H, d, d_qk]``, ``W_K`` ``[Hkv, d_kv, d_qk]``, ``W_V`` ``[Hkv, d_kv, d_head]``,
    ``W_O`` ``[H, d_head, d]``; biases ``b_Q [H, d_qk]``, ``b_K``/``b_V`` ``[Hkv, ...]``, ``b_O
    [d]`` (zeros where the module has none); ``kv_of`` maps a head to its key/value head.
    Iterating yields ``W_Q, W_K, W_V, W_O``.
    """

    W_Q: Tensor
    W_K: Tensor
    W_V: Tensor
    W_O: Tensor
    b_Q: Tensor
    b_K: Tensor
    b_V: Tensor
    b_O: Tensor
    kv_of: list[int]

    def __iter__(self):
        return iter((self.W_Q, self.W_K, self.W_V, self.W_O))


@dataclass
class Anatomy:
    """Every attention, MLP and the read-out of a model (see the module docstring)."""

    model: nn.Module
    stacks: list[str]
    layers: list[tuple[str, int]]  # in run order
    attention: dict[tuple[str, int, str], AttentionAnatomy]
    mlp: dict[tuple[str, int], MLPAnatomy]
    final_norm: nn.Module | None
    unembed: nn.Module | None
    refused: dict[tuple, str]
    d_model: int | None = None
    samples: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict, repr=False)
    forms: dict[int, FrozenNorm | None] = field(default_factory=dict, repr=False)
    _matrices: dict[int, tuple[Tensor, Tensor | None]] = field(default_factory=dict, repr=False)

    def need(self, *key: Any) -> None:
        """Raise the one-line :class:`ProbeError` if ``key`` was refused."""
        if key in self.refused:
            raise ProbeError(f"{_label(key)}: {self.refused[key]}")

    def attn(self, stack: str, layer: int, role: str = "self") -> AttentionAnatomy:
        """The :class:`AttentionAnatomy` of ``(stack, layer, role)``, else a one-line ProbeError."""
        key = (stack, layer, role)
        self.need(*key)
        if key not in self.attention:
            have = ", ".join(_label(k) for k in self.attention) or "none"
            raise ProbeError(f"{_label(key)} is not an attention of this model; it has: {have}")
        return self.attention[key]

    def norm_form(self, module: nn.Module | None) -> FrozenNorm | None:
        """The affine form of a norm found here (LayerNorm, RMSNorm, RMSNorm with ``1 + w``), as
        reproduced from its recorded call; the identity for None; None when no form reproduced it."""
        if module is None:
            return FrozenNorm("identity", None, None, 0.0, False)
        return self.forms.get(id(module))

    def matrix(self, module: nn.Module) -> tuple[Tensor, Tensor | None]:
        """``(W [in, out], bias [out] | None)`` (float32) with ``module(x) == x @ W + b``, checked
        against the module's call in the scan; a ProbeError for a module that is not such a map."""
        got = self._matrices.get(id(module))
        if got is None:
            got = as_matrix(module, self.samples.get(id(module)))
            self._matrices[id(module)] = got
        return got

    def head_weights(self, stack: str, layer: int, role: str = "self") -> HeadWeights:
        """The :class:`HeadWeights` of one attention (from :meth:`matrix` of each block's module)."""
        a = self.attn(stack, layer, role)
        self.need(stack, layer, role, "weights")

        def cut(blocks: list[Block]) -> tuple[Tensor, Tensor]:
            Ws, bs = [], []
            for b in blocks:
                W, bias = self.matrix(b.module)
                Ws.append(W[:, b.cols])
                bs.append(bias[b.cols] if bias is not None else torch.zeros(W[:, b.cols].shape[1]))
            return torch.stack(Ws), torch.stack(bs)

        WQ, bQ = cut(a.q)
        WK, bK = cut(a.k)
        WV, bV = cut(a.v)
        WO, bO = self.matrix(a.out.module)
        WO = WO.reshape(a.heads, a.d_head, WO.shape[-1])
        bO = bO if bO is not None else torch.zeros(WO.shape[-1])
        return HeadWeights(WQ, WK, WV, WO, bQ, bK, bV, bO, list(a.kv_of))

    def summary(self) -> str:
        """One line per attention and MLP found, then one per refusal."""
        lines = []
        for (s, i, r), a in self.attention.items():
            norm = type(a.norm).__name__ if a.norm is not None else "none"
            qs = sorted({b.name for b in a.q + a.k + a.v})
            src = ", ".join(qs) if len(qs) <= 3 else f"{len(qs)} modules ({qs[0]}, ...)"
            lines.append(
                f"{s} L{i} {r}: {a.heads} heads ({a.kv_heads} kv) x {a.d_head}, norm {norm}, "
                f"q/k/v from {src}, out {a.out.name}"
            )
        for (s, i), m in self.mlp.items():
            kind = "parallel" if m.parallel else "sequential"
            lines.append(f"{s} L{i} mlp ({kind}): reads {', '.join(m.reader_names)}, out {m.out.name}")
        lines += [f"refused {_label(k)}: {why}" for k, why in self.refused.items()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"Anatomy({len(self.attention)} attentions, {len(self.mlp)} MLPs, "
            f"{len(self.refused)} refused; .summary() lists them)"
        )


def _label(key: tuple) -> str:
    if key == ("readout",):
        return "the read-out (final norm and unembedding)"
    stack, layer, *rest = key
    what = " ".join(str(r) for r in rest)
    return f"{stack} layer {layer} {what}".strip()


def as_matrix(module: nn.Module, sample: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor | None]:
    """``(W [in, out], b | None)`` of a linear leaf: its ``weight`` (or its transpose) and ``bias``,
    the one that reproduces the recorded ``sample`` ``(x, module(x))``; ``nn.Linear`` needs none."""
    w = getattr(module, "weight", None)
    b = getattr(module, "bias", None)
    name = type(module).__name__
    if not isinstance(w, Tensor) or w.dim() != 2:
        raise ProbeError(f"{name} has no 2-D weight; probe reads only linear modules as matrices")
    w = w.detach().float()
    b = b.detach().float() if isinstance(b, Tensor) else None
    if isinstance(module, nn.Linear):
        return w.T, b
    if sample is None:
        raise ProbeError(f"{name} did not run in the scan; probe cannot check how it applies its weight")
    x, y = sample
    x, y = x.float().reshape(-1, x.shape[-1]), y.float().reshape(-1, y.shape[-1])
    for W in (w.T, w):
        if W.shape != (x.shape[-1], y.shape[-1]):
            continue
        pred = x @ W + (b if b is not None else 0)
        if (pred - y).abs().max().item() <= 1e-4 * (1 + y.abs().max().item()):
            return W, b
    raise ProbeError(f"{name} is not x @ W + b with its own weight; probe cannot split it per head")


__all__ = ["Anatomy", "AttentionAnatomy", "MLPAnatomy", "Block", "HeadWeights", "as_matrix"]
