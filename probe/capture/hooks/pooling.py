"""Attention pooling heads: a learned query that reads a stack's positions once (SigLIP's head).

SigLIP's vision tower (and SigLIP 2's, Phi-4-multimodal's) ends in a
``MultiheadAttentionPoolingHead``: a learned ``probe`` of ``[1, 1, d_model]``, repeated over the
batch, is the one query of an ``nn.MultiheadAttention`` over the tower's patches; its output
(after a norm and an MLP) is the picture's pooled vector. It is no layer of the tower and no
decoder: probe records it as a layer list of its own (:func:`pooling_heads`), its stack named by
the head's module path, its one cross-attention ``[batch, heads, queries, patches]`` the weights
the ``nn.MultiheadAttention`` used, and the layer's metadata says what it is
(:data:`POOLING_NOTE`). Without this the head was adopted as a layer of the whole module running
it, and a vision-language model (PaliGemma with ``vision_use_head=True``) had its language model's
layers swallowed into that one layer.
"""

from __future__ import annotations

from torch import nn

SUFFIX = ":pool"  # a pooling head's layer list: its module path and this suffix

POOLING_NOTE = (
    "an attention pooling head, not a layer of the stack it reads: its learned query ({param}, "
    "{n} position{s}) reads the stack's output through nn.MultiheadAttention once; cross_attn "
    "is [batch, heads, {n}, positions read]"
)


def _queries(module: nn.Module, width: int) -> tuple[str, int] | None:
    """``(name, n)`` of the module's own learned queries ``[1, n, width]``, or None."""
    for name, p in module.named_parameters(recurse=False):
        if p.dim() == 3 and p.shape[0] == 1 and p.shape[-1] == width:
            return name, int(p.shape[1])
    return None


def pooling_heads(model: nn.Module) -> dict[int, tuple[str, str]]:
    """``id(module) -> (layer list name, note)`` for each attention pooling head of ``model``: a
    module that holds an ``nn.MultiheadAttention`` child and its own learned queries
    ``[1, n, embed_dim]`` as a parameter (see the module docstring)."""
    out: dict[int, tuple[str, str]] = {}
    for path, m in model.named_modules():
        if not any(isinstance(c, nn.MultiheadAttention) for c in m._modules.values()):
            continue  # most modules hold none: skip children()'s generator
        mha = [c for c in m.children() if isinstance(c, nn.MultiheadAttention)]
        if len(mha) != 1:
            continue
        q = _queries(m, mha[0].embed_dim)
        if q is None:
            continue
        param = f"{path}.{q[0]}" if path else q[0]
        note = POOLING_NOTE.format(param=param, n=q[1], s="" if q[1] == 1 else "s")
        out[id(m)] = ((path or "pool") + SUFFIX, note)
    return out


__all__ = ["POOLING_NOTE", "SUFFIX", "pooling_heads"]
