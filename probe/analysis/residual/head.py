"""The model's read-out: its final normalisation and unembedding, found by watching one forward.

The unembedding is the last submodule called whose output ends in the vocabulary (the model's
logits' last dimension) and whose input ends in ``d_model``. The final norm is the submodule whose
input equals the last layer's ``resid_post`` and whose output equals the unembedding's input; when
the unembedding reads ``resid_post`` itself, there is no final norm. Both can also be given.

For direct logit attribution the norm is frozen: its scale (LayerNorm's ``sqrt(var + eps)`` or
RMSNorm's ``sqrt(mean(x²) + eps)``) is computed once from the full stream and then held fixed, so
the norm becomes affine and the logit splits into a sum over the stream's parts. The form (LayerNorm,
RMSNorm, RMSNorm with ``1 + weight``) is recognised by reproducing the norm's recorded output, not
from its class name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from probe.errors import ProbeError


@dataclass
class FrozenNorm:
    """A final norm in affine form: ``y = weight * (x - center * mean(x)) / scale + bias``.

    ``kind`` is ``"layernorm"``, ``"rmsnorm"``, ``"rmsnorm(1+w)"`` or ``"identity"``.
    """

    kind: str
    weight: Tensor | None
    bias: Tensor | None
    eps: float
    center: bool

    def scale(self, x: Tensor) -> Tensor:
        """The norm's divisor for each vector of ``x`` ``[..., d]`` -> ``[..., 1]``."""
        if self.kind == "identity":
            return torch.ones_like(x[..., :1])
        if self.center:
            return torch.sqrt(x.var(dim=-1, unbiased=False, keepdim=True) + self.eps)
        return torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)

    def linear(self, part: Tensor, scale: Tensor) -> Tensor:
        """The part's share of the normed stream with the scale frozen (no bias)."""
        if self.center:
            part = part - part.mean(dim=-1, keepdim=True)
        y = part / scale
        return y * self.weight if self.weight is not None else y

    def __call__(self, x: Tensor) -> Tensor:
        y = self.linear(x, self.scale(x))
        return y + self.bias if self.bias is not None else y


def _eps(m: Any) -> list[float]:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        v = getattr(m, attr, None)
        if isinstance(v, float):
            return [v]
    return [1e-5, 1e-6, 1e-12]


def freeze(norm: Any, x: Tensor, y: Tensor) -> FrozenNorm | None:
    """The affine form of ``norm`` that reproduces ``y = norm(x)``, or None when no form does."""
    if norm is None:
        return FrozenNorm("identity", None, None, 0.0, False)
    w = getattr(norm, "weight", None)
    b = getattr(norm, "bias", None)
    w = w.detach().float() if isinstance(w, Tensor) and w.dim() == 1 else None
    b = b.detach().float() if isinstance(b, Tensor) and b.dim() == 1 else None
    x, y = x.float(), y.float()
    tol = 1e-4 * (1 + y.abs().max().item())
    for eps in _eps(norm):
        cands = [FrozenNorm("layernorm", w, b, eps, True), FrozenNorm("rmsnorm", w, b, eps, False)]
        if w is not None:
            cands.append(FrozenNorm("rmsnorm(1+w)", 1 + w, b, eps, False))
        for c in cands:
            if (c(x) - y).abs().max().item() <= tol:
                return c
    return None


@dataclass
class ReadOut:
    """How the model turns its last stream into logits: ``unembed(norm(resid_post))``.

    ``norm`` is the module (None: no final norm), ``frozen`` its affine form (None: not LayerNorm/
    RMSNorm-like, so no attribution), ``unembed`` the module; ``W`` ``[vocab, d_model]`` and ``b``
    ``[vocab]`` its weight and bias as a linear map, checked against the recorded call.
    """

    norm: Any
    norm_name: str
    frozen: FrozenNorm | None
    unembed: Any
    unembed_name: str
    W: Tensor
    b: Tensor | None

    def logits(self, h: Tensor) -> Tensor:
        """The model's own read-out of stream ``h`` ``[..., d]`` -> ``[..., vocab]`` (float32)."""
        with torch.no_grad():
            x = h.to(self.W.dtype) if self.norm is None else self.norm(h.to(_dtype(self.norm, h)))
            return self.unembed(x).float()


def _dtype(m: Any, h: Tensor) -> torch.dtype:
    for p in getattr(m, "parameters", lambda: [])():
        return p.dtype
    return h.dtype


def _as_linear(unembed: Any, x: Tensor, out: Tensor, vocab: int, d: int) -> tuple[Tensor, Tensor | None]:
    """``(W [vocab, d], b [vocab] | None)`` with ``out == x @ W.T + b``, checked on the recorded call."""
    w = getattr(unembed, "weight", None)
    if not isinstance(w, Tensor) or w.dim() != 2:
        raise ProbeError("the unembedding has no 2-D weight; pass unembed= a Linear-like module")
    w = w.detach().float()
    b = getattr(unembed, "bias", None)
    b = b.detach().float() if isinstance(b, Tensor) else None
    options = []
    if w.shape == (vocab, d):
        options.append(w)
    if w.shape == (d, vocab):
        options.append(w.T)
    for W in options:
        pred = x.float() @ W.T + (b if b is not None else 0)
        if (pred - out.float()).abs().max().item() <= 1e-4 * (1 + out.abs().max().item()):
            return W, b
    raise ProbeError(
        "the unembedding is not a plain linear map of its input (weight and output disagree); "
        "pass unembed= the module that maps the stream to the logits"
    )


def model_logits(outputs: Any) -> Tensor:
    """The logits in a model's return value: ``.logits``, or the first tensor of a tuple."""
    if hasattr(outputs, "logits") and isinstance(outputs.logits, Tensor):
        return outputs.logits
    if isinstance(outputs, Tensor):
        return outputs
    if isinstance(outputs, (tuple, list)):
        for o in outputs:
            if isinstance(o, Tensor) and o.dim() >= 2:
                return o
    raise ProbeError(
        "the model's output holds no logits tensor; the logit lens needs a model that returns logits"
    )


def find_readout(
    calls: list,
    outputs: Any,
    final: Tensor,
    *,
    norm: Any = None,
    unembed: Any = None,
    given_norm: bool = False,
) -> ReadOut:
    """The :class:`ReadOut` from the recorded ``calls`` of one forward.

    ``final`` is the last layer's ``resid_post`` ``[batch, pos, d]``; ``norm``/``unembed`` override
    the search (``given_norm`` says ``norm`` was given, so None then means "no final norm").
    """
    logits = model_logits(outputs)
    vocab, d = logits.shape[-1], final.shape[-1]
    byid = {id(c.module): c for c in calls}
    if unembed is None:
        cands = [
            c
            for c in calls
            if isinstance(c.output, Tensor)
            and isinstance(c.input, Tensor)
            and c.output.shape[-1] == vocab
            and c.input.shape[-1] == d
            and not list(c.module.children())
        ]
        if not cands:
            raise ProbeError(
                f"no submodule maps d_model={d} to the vocabulary ({vocab}); pass unembed= the output layer"
            )
        u_call = cands[-1]
    else:
        u_call = next((c for c in reversed(calls) if c.module is unembed), None)
        if u_call is None:
            raise ProbeError("the unembed= module did not run in the model's forward; give its output layer")
    u_in = u_call.input
    norm_call = None
    if given_norm:
        if norm is not None:
            norm_call = byid.get(id(norm)) or next((c for c in reversed(calls) if c.module is norm), None)
    elif u_in.shape == final.shape and torch.equal(u_in, final):
        norm = None  # the unembedding reads the last stream itself (post-norm blocks, no final norm)
    else:
        found = [
            c
            for c in calls
            if isinstance(c.output, Tensor)
            and c.output.shape == u_in.shape
            and torch.equal(c.output, u_in)
            and isinstance(c.input, Tensor)
            and c.input.shape == final.shape
            and torch.equal(c.input, final)
        ]
        if not found:
            raise ProbeError(
                "could not find the final norm (no submodule maps the last resid_post to the "
                "unembedding's input); pass norm= the final norm module, or norm=None for none"
            )
        norm_call = found[-1]
        norm = norm_call.module
    frozen = None
    if norm is None:
        frozen = freeze(None, final, final)
    elif norm_call is not None:
        frozen = freeze(norm, norm_call.input, norm_call.output)
    W, b = _as_linear(u_call.module, u_in, u_call.output, vocab, d)
    return ReadOut(
        norm,
        norm_call.name if norm_call is not None else "",
        frozen,
        u_call.module,
        u_call.name,
        W,
        b,
    )


def is_leaf(name: str, m: nn.Module) -> bool:
    """Record filter for :func:`probe.forward.run_recorded`: leaf modules (no children)."""
    return not list(m.children())


__all__ = ["FrozenNorm", "ReadOut", "find_readout", "freeze", "model_logits", "is_leaf"]
