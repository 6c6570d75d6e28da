"""Token-to-token mixing per layer, and rolled out across layers: what ALTI and value zeroing return.

:class:`TokenMixing` holds, for one stack, a ``[batch, T, T]`` matrix per layer: row ``i`` (an
output position of the layer) over columns ``j`` (its input positions), each row summing to 1
over the real tokens (padding rows are the identity), and their product across layers
(:meth:`TokenMixing.rollout`): how much of layer ``l``'s output at ``i`` comes from each input
token, ``R_l = C_l C_{l-1} ... C_first`` (Abnar & Zuidema 2020's rollout, as Ferrando et al.
2022 and Mohebbi et al. 2023 roll out theirs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from probe.analysis.residual.exports import TableExports
from probe.analysis.table import Table
from probe.errors import ProbeError
from probe.intervene.anatomy import Anatomy, anatomy


def normalise_rows(C: Tensor, mask: Tensor | None) -> Tensor:
    """``C [B, T, T]`` (>= 0) with padding columns zeroed, each real row divided by its sum, and
    padding rows (and rows with nothing) the identity."""
    B, T, _ = C.shape
    eye = torch.eye(T, device=C.device).expand(B, T, T)
    if mask is not None:
        m = mask.to(C.device, torch.bool)
        C = C * m[:, None, :]
    total = C.sum(-1, keepdim=True)
    out = torch.where(total > 0, C / total.clamp_min(torch.finfo(C.dtype).tiny), eye)
    if mask is not None:
        out = torch.where(m[:, :, None], out, eye)
    return out


def anatomy_of(model: Any, inputs: Any, **kwargs: Any) -> Any:
    """``model`` itself when it is an :class:`~probe.intervene.anatomy.Anatomy` already found
    (its ``model`` is run), else the anatomy of ``model`` found on ``inputs``."""
    return model if isinstance(model, Anatomy) else anatomy(model, inputs, **kwargs)


def one_stack(stacks: list[str], stack: str | None) -> str:
    """``stack``, checked, or the model's only stack."""
    if stack is None:
        if len(stacks) != 1:
            raise ProbeError(f"the model has stacks {', '.join(stacks)}; pass stack=")
        return stacks[0]
    if stack not in stacks:
        raise ProbeError(f"no stack {stack!r}; the model's stacks are {', '.join(stacks)}")
    return stack


def real_tokens(cache: Any, stack: str) -> tuple[Tensor, list]:
    """The real-token mask ``[B, T]`` of ``stack``'s positions and each text's real tokens, from a
    capture's metadata."""
    first = next(k for k in cache.keys() if k.startswith(f"{stack}.") and k.endswith("self_attn.pattern"))
    B, _, T, _ = cache.shape(first)
    mask = torch.zeros(B, T, dtype=torch.bool)
    tokens = []
    for b in range(B):
        q, _ = cache.axes(stack, "self", b)
        mask[b, q.positions] = True
        tokens.append(list(q.tokens))
    return mask, tokens


@dataclass
class TokenMixing(TableExports):
    """Per layer of ``stack``, ``matrices[layer]`` ``[batch, T, T]`` (float32, rows sum to 1);
    ``method`` says what they are, ``notes`` what they leave out, ``errors[layer]`` the
    decomposition's check where the method has one (ALTI: the per-token terms against the
    attention block's output, relative). ``mask`` ``[batch, T]`` marks real tokens; ``tokens``
    the captured positions' names per text."""

    method: str
    stack: str
    matrices: dict[int, Tensor]
    mask: Tensor | None = None
    tokens: list = field(default_factory=list)
    errors: dict[int, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def layers(self) -> list[int]:
        return sorted(self.matrices)

    def layer(self, layer: int, batch: int | None = None) -> Tensor:
        """``[batch, T, T]`` of one layer (``[T, T]`` for one ``batch``)."""
        if layer not in self.matrices:
            raise ProbeError(f"no {self.method} for layer {layer}; it has layers {self.layers}")
        C = self.matrices[layer]
        return C if batch is None else C[self._batch(batch)]

    def rollout(self, upto: int | None = None, batch: int | None = None) -> Tensor:
        """``C_upto ... C_first`` ``[batch, T, T]``: the share of each input token in layer ``upto``'s
        output (default: the last layer's)."""
        layers = [i for i in self.layers if upto is None or i <= upto]
        if not layers:
            raise ProbeError(f"no {self.method} up to layer {upto}; it has layers {self.layers}")
        R = self.matrices[layers[0]]
        for i in layers[1:]:
            R = self.matrices[i] @ R
        return R if batch is None else R[self._batch(batch)]

    def _batch(self, b: int) -> int:
        n = next(iter(self.matrices.values())).shape[0]
        if isinstance(b, bool) or not isinstance(b, int) or not -n <= b < n:
            raise ProbeError(f"batch {b!r} is out of range: {n} text(s)")
        return b

    def table(self, batch: int = 0, query: int = -1, upto: int | None = None) -> Table:
        """One row per input token: its share of the output at ``query`` (counted among the real
        tokens, -1: the last), rolled out up to layer ``upto`` (default: every layer)."""
        R = self.rollout(upto, batch)
        real = (
            torch.nonzero(self.mask[batch]).flatten().tolist()
            if self.mask is not None
            else list(range(R.shape[-1]))
        )
        if not -len(real) <= query < len(real):
            raise ProbeError(f"query {query} does not exist: text {batch} has {len(real)} real tokens")
        i = real[query]
        toks = self.tokens[batch] if batch < len(self.tokens) else []
        rows = [
            {"position": n, "token": toks[n] if n < len(toks) else "", "share": float(R[i, j])}
            for n, j in enumerate(real)
        ]
        upto = self.layers[-1] if upto is None else upto
        title = f"{self.method}: each token's share of position {real.index(i)} after layer {upto}"
        return Table(rows, ["position", "token", "share"], title)

    def main_table(self) -> Table:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """Every layer's matrices and the rollout as nested lists, with the notes."""
        return {
            "method": self.method,
            "stack": self.stack,
            "layers": {str(i): self.matrices[i].tolist() for i in self.layers},
            "rollout": self.rollout().tolist(),
            "errors": {str(i): e for i, e in self.errors.items()},
            "notes": list(self.notes),
        }

    def __repr__(self) -> str:
        B, T, _ = next(iter(self.matrices.values())).shape
        err = f"; max rel error {max(self.errors.values()):.1e}" if self.errors else ""
        return f"TokenMixing({self.method}, {self.stack}, {len(self.matrices)} layers, {B} x {T} x {T}{err})"


__all__ = ["TokenMixing", "normalise_rows", "one_stack", "real_tokens", "anatomy_of"]
