"""The key-column scale of a derived pattern kind (:mod:`probe.capture.consumers.kinds`), applied
the same way by every consumer: to a whole pattern, a block of rows, selected rows."""

from __future__ import annotations

import torch
from torch import Tensor

from probe.errors import ProbeError


def scaled(block: Tensor, scale: Tensor, *, first: bool = False) -> Tensor:
    """``block`` ``[..., rows, keys]`` (leading dims ``[B, H]`` or ``[B·H]``) times ``scale``
    ``[B, H, keys]`` per key column, as float32; ``first``: the block may hold only the first
    keys (a causal row block's), scaled by the first columns of ``scale``."""
    B, H, K = scale.shape
    k = block.shape[-1]
    if k > K or (k != K and not first):
        raise ProbeError(f"a pattern over {k} keys was given a scale over {K}; they must match")
    s = scale[..., :k].to(device=block.device, dtype=torch.float32)
    lead = tuple(block.shape[:-2])
    if lead == (B, H):
        return block.float() * s[:, :, None, :]
    n = 1
    for d in lead:
        n *= d
    if n != B * H:
        raise ProbeError(
            f"a pattern of shape {list(block.shape)} does not line up with its scale "
            f"[batch {B}, heads {H}, keys {K}]"
        )
    return (block.float().reshape(B, H, *block.shape[-2:]) * s[:, :, None, :]).reshape(block.shape)


__all__ = ["scaled"]
