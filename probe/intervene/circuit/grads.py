"""The gradient of the metric with respect to each target's input, through that target alone.

A backward pass gives ``∂M/∂(projection output)`` for every q/k/v projection and ``∂M/∂(reader
input)`` for every MLP reader and the last layer's output (the tensors a
:class:`~probe.intervene.circuit.wiring.Run` keeps). A target's own gradient follows from those
without another backward:

* a query/key/value block ``y @ W[:, cols] + b[cols]`` (``y = norm(x)``): ``g[..., cols] @
  W[:, cols].T``, all blocks of one projection in one batched product;
* an MLP: the sum over its readers of the gradient at their (aliased) input;
* then back through the norm at the run's own stream ``x``: analytically where the anatomy found
  the norm's affine form (LayerNorm, RMSNorm: ``(u - mean(u) - x̂ · mean(u ⊙ x̂)) / s`` with
  ``u = w ⊙ g``, ``x̂`` the normalised input and ``s`` its scale; no mean term for RMSNorm), else
  by autograd through the norm module on ``K`` stacked copies of ``x``;
* the logits' target is the last layer's output itself.

For a projection's blocks under an affine norm the two steps are one: the norm's weight and
centring are linear in ``u``, so they fold into each block's weight (``A = center(W[:, cols].T ⊙
w)``), ``1/s`` into the block's gradient, and ``mean(u ⊙ x̂)`` is ``g · (x̂ A.T) / d``, taken in
the block's narrow space; each target's gradient is then added to ``out`` by one batched
``baddbmm`` and one ``addcmul`` (``out`` is large: every target at every position), with no
``[blocks, B, T, d]`` temporaries.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from probe.errors import ProbeError
from probe.intervene.circuit.wiring import Group, Proj, Run, Wiring

FORMS = ("layernorm", "rmsnorm", "rmsnorm(1+w)")


def norm_vjp(norm: nn.Module, x: Tensor, gy: Tensor, form: Any = None) -> Tensor:
    """``[K, B, T, d]``: the vector-Jacobian products of ``norm`` at ``x [B, T, d]`` with each of the
    ``K`` cotangents ``gy [K, B, T, d]`` (see the module docstring)."""
    if form is not None and getattr(form, "kind", "") in FORMS:
        xf = x.detach().float()
        s = form.scale(xf)
        xc = xf - xf.mean(-1, keepdim=True) if form.center else xf
        xh = xc / s
        u = gy.float() * form.weight.float() if form.weight is not None else gy.float()
        if form.center:
            u = u - u.mean(-1, keepdim=True)
        return (u - xh * (u * xh).mean(-1, keepdim=True)) / s
    K = gy.shape[0]
    xr = x.detach().float().repeat(K, *([1] * (x.dim() - 1))).to(x.dtype).requires_grad_(True)
    with torch.enable_grad():
        y = norm.forward(xr)
        (g,) = torch.autograd.grad(y, xr, gy.reshape(K * x.shape[0], *x.shape[1:]).to(y.dtype))
    return g.float().reshape(K, *x.shape)


def _blocks_back(p: Proj, gp: Tensor | None, like: Tensor) -> Tensor:
    """``[blocks, B, T, d_in]``: each block's output gradient taken back through its weight."""
    if gp is None:
        return torch.zeros(len(p.blocks), *like.shape, dtype=torch.float32, device=like.device)
    widths = {b.cols.stop - b.cols.start for b in p.blocks}
    if len(widths) == 1:
        (dh,) = widths
        idx = torch.cat([torch.arange(b.cols.start, b.cols.stop) for b in p.blocks]).to(gp.device)
        g = gp.float().index_select(-1, idx).reshape(-1, len(p.blocks), dh).transpose(0, 1)
        Wt = torch.stack([b.W.float().T for b in p.blocks]).to(gp.device)  # [blocks, dh, d_in]
        return torch.bmm(g, Wt).reshape(len(p.blocks), *like.shape[:-1], Wt.shape[-1])
    return torch.stack([gp[..., b.cols].float() @ b.W.float().T for b in p.blocks])


def _span(targets: list[int]) -> slice | None:
    """``targets`` as a slice when they are consecutive (an in-place view of ``out``), else None."""
    if targets and targets == list(range(targets[0], targets[0] + len(targets))):
        return slice(targets[0], targets[0] + len(targets))
    return None


def _fused_blocks(g: Group, gps: list[Tensor | None], x: Tensor, out: Tensor) -> bool:
    """Add every q/k/v target's gradient of attention group ``g`` to ``out`` through the norm's
    affine form in one pass (see the module docstring); False (nothing added) where that form, one
    block width, or consecutive targets are missing: the caller takes the general path."""
    form, span = g.form, _span(sorted(g.targets))
    if span is None or getattr(form, "kind", "") not in FORMS:
        return False
    # in target order: the group's span of ``out`` holds them one after another
    blocks = sorted(
        ((b, gp) for p, gp in zip(g.projs, gps, strict=True) for b in p.blocks), key=lambda t: t[0].target
    )
    widths = {b.cols.stop - b.cols.start for b, _ in blocks}
    if len(widths) != 1:
        return False
    (dh,) = widths
    xf = x.detach().float().reshape(-1, x.shape[-1])  # [N, d]
    d, N = xf.shape[-1], xf.shape[0]
    s = form.scale(xf)  # [N, 1]
    xh = (xf - xf.mean(-1, keepdim=True) if form.center else xf) / s
    A = torch.stack([b.W.float().T for b, _ in blocks]).to(xf.device)  # [K, dh, d]
    if form.weight is not None:
        A = A * form.weight.float().to(xf.device)
    if form.center:
        A = A - A.mean(-1, keepdim=True)
    gb = torch.zeros(len(blocks), N, dh, dtype=torch.float32, device=xf.device)
    for i, (b, gp) in enumerate(blocks):
        if gp is not None:
            gb[i] = gp.reshape(N, -1)[:, b.cols].float()
    dot = (gb * torch.matmul(xh, A.transpose(1, 2))).sum(-1, keepdim=True) / d  # [K, N, 1]: mean(u x̂)
    view = out[span].view(len(blocks), N, d)
    view.baddbmm_(gb / s, A.to(out.device))
    view.addcmul_(xh.to(out.device), (dot / s).to(out.device), value=-1.0)
    return True


def target_grads(wiring: Wiring, run: Run, grads: dict[int, Tensor], out: Tensor) -> Tensor:
    """``out [targets, B, T, d]`` with every target's own gradient (see the module docstring) added
    to it (zero it for one run's gradients; EAP-IG sums its steps in it); ``grads``: the gradients
    of ``run.slots`` by index (None where unused)."""
    for gi, g in enumerate(wiring.groups):
        x = run.streams.get(gi)
        if x is None:
            raise ProbeError(f"the {g.kind} of layer {g.layer} did not run; the model skipped a part")
        if g.kind == "attn":
            gps = [grads.get(run.slot_index[(gi, pi)]) for pi in range(len(g.projs))]
            if g.norm is not None and _fused_blocks(g, gps, x, out):
                continue
            gy = torch.cat([_blocks_back(p, gp, x) for p, gp in zip(g.projs, gps, strict=True)])
        else:
            gy = torch.zeros((1, *x.shape), dtype=torch.float32, device=x.device)
            for r in range(1 if g.kind == "logits" else len(g.readers)):
                part = grads.get(run.slot_index[(gi, r)])
                if part is not None:
                    gy[0] += part.float()
        got = (norm_vjp(g.norm, x, gy, g.form) if g.norm is not None else gy).to(out.device)
        span = _span(g.targets)
        if span is not None:
            out[span] += got
        else:
            out[g.targets] += got
    return out


__all__ = ["target_grads", "norm_vjp"]
