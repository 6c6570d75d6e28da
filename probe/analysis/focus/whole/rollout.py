"""Attention rollout (Abnar & Zuidema 2020), layer by layer: ``Â_l = 0.5·mean_h W_l + 0.5·I``
(padded rows identity), ``R = Â_L ··· Â_1`` per stack (:class:`Rollout`)."""

from __future__ import annotations

import torch


class Rollout:
    """The rollout of each stack so far (``R``: stack -> ``[batch, T, T]``), one layer at a time
    (:meth:`add`), in the order the layers are read."""

    def __init__(self) -> None:
        self.R: dict[str, torch.Tensor] = {}
        self.lower: dict[str, bool] = {}  # every layer of the stack so far lower-triangular

    def add(self, stack: str, head_sum: torch.Tensor, heads: int, real: torch.Tensor, causal: bool) -> None:
        """Multiply in one layer of ``stack``: ``head_sum`` ``[batch, T, T]`` is its pattern summed
        over its ``heads``; ``real`` ``[batch, T]`` the real positions; ``causal`` whether the layer
        is causal (is_causal ignores padding: a padded batch is taken as dense)."""
        tri = self.lower.get(stack, True) and causal and bool(real.all())
        self.lower[stack] = tri
        self.R[stack] = rollout_step(self.R.get(stack), head_sum / heads, real, lower=tri)


def rollout_step(R: torch.Tensor | None, W: torch.Tensor, real: torch.Tensor, *, lower: bool) -> torch.Tensor:
    """One layer of attention rollout: R ← (0.5·W + 0.5·I) R, padding rows kept as identity.
    ``lower``: W and R are lower-triangular (causal layers), so the product is too."""
    B, T, _ = W.shape
    eye = torch.eye(T).expand(B, T, T)
    A = torch.where(real[:, :, None], 0.5 * W + 0.5 * eye, eye)
    if R is None:
        return A
    return _lower_matmul(A, R) if lower else A @ R


def _lower_matmul(A: torch.Tensor, R: torch.Tensor, leaf: int = 256) -> torch.Tensor:
    """``A @ R`` for lower-triangular ``A`` and ``R`` (``[B, T, T]``), skipping the zero blocks:
    with A = [[A11, 0], [A21, A22]] and R likewise, the product is [[A11 R11, 0], [A21 R11 + A22 R21,
    A22 R22]], recursively (about a third of the dense product's multiplications)."""
    T = A.shape[-1]
    if T <= leaf:
        return A @ R
    m = T // 2
    out = A.new_zeros(A.shape)
    R11 = R[..., :m, :m]
    out[..., :m, :m] = _lower_matmul(A[..., :m, :m], R11, leaf)
    out[..., m:, :m] = A[..., m:, :m] @ R11 + A[..., m:, m:] @ R[..., m:, :m]
    out[..., m:, m:] = _lower_matmul(A[..., m:, m:], R[..., m:, m:], leaf)
    return out


__all__ = ["Rollout", "rollout_step"]
