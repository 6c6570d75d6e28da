"""torch's fused attention modules: the weights they never return, recomputed from their parameters.

``nn.MultiheadAttention`` (and torch's encoder layers) leave their fast paths whenever a
torch-function mode is active, so the watcher runs them with its mode suspended and nothing
inside is seen. Once such a call returns, its weights are recomputed here from the module's own
parameters and the call's arguments, whichever kernel produced the module's output; an
``nn.TransformerEncoderLayer`` that ran as one fused kernel is replayed with its own modules
(torch's slow path, the same arithmetic) for the stream after its attention sublayer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from probe.capture.calls import output_tensor

_MHA_ARGS = (
    "query",
    "key",
    "value",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "average_attn_weights",
    "is_causal",
)


def mha_weights(module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> Tensor | None:
    """The per-head weights an ``nn.MultiheadAttention`` call used, as ``[batch, head, L, S]``.

    Recomputed with ``F.multi_head_attention_forward(need_weights=True,
    average_attn_weights=False)`` from the module's own parameters and the call's arguments, so it
    works whichever kernel (fast path or not) produced the module's output.
    """
    bound = dict(zip(_MHA_ARGS, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in _MHA_ARGS})
    query, key, value = bound["query"], bound["key"], bound["value"]
    batched = query.dim() == 3
    if module.batch_first and batched:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    separate = not module._qkv_same_embed_dim
    attn_mask = bound.get("attn_mask")
    is_causal = bool(bound.get("is_causal", False))
    if is_causal and attn_mask is None:
        L, S = query.size(0), key.size(0)
        attn_mask = torch.ones(L, S, dtype=torch.bool, device=query.device).triu_(1)
    _, weights = F.multi_head_attention_forward(
        query,
        key,
        value,
        module.embed_dim,
        module.num_heads,
        module.in_proj_weight,
        module.in_proj_bias,
        module.bias_k,
        module.bias_v,
        module.add_zero_attn,
        0.0,
        module.out_proj.weight,
        module.out_proj.bias,
        training=False,
        key_padding_mask=bound.get("key_padding_mask"),
        need_weights=True,
        attn_mask=attn_mask,
        use_separate_proj_weight=separate,
        q_proj_weight=module.q_proj_weight if separate else None,
        k_proj_weight=module.k_proj_weight if separate else None,
        v_proj_weight=module.v_proj_weight if separate else None,
        average_attn_weights=False,
        is_causal=False,
    )
    if weights is None:
        return None
    return weights if batched else weights.unsqueeze(0)


def mha_function_weights(func: Any, args: tuple, kwargs: dict) -> Tensor | None:
    """The per-head weights ``[batch, head, L, S]`` of a direct ``F.multi_head_attention_forward``
    call (WavLM's attention calls the function, no module): the call repeated with
    ``need_weights=True, average_attn_weights=False`` and no dropout, with the mode off."""
    import inspect

    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.arguments.update(need_weights=True, average_attn_weights=False, training=False, dropout_p=0.0)
    _, weights = func(*bound.args, **bound.kwargs)
    if weights is None:
        return None
    return weights if bound.arguments["query"].dim() == 3 else weights.unsqueeze(0)


@dataclass
class EncoderLayerReplay:
    """An ``nn.TransformerEncoderLayer`` call replayed: its input and output (padded where they were
    nested tensors), its attention weights and the stream after its attention sublayer."""

    x: Tensor
    out: Tensor
    weights: Tensor | None
    after_attn: Tensor


def replay_encoder_layer(
    layer: nn.TransformerEncoderLayer, args: tuple, kwargs: dict, output: Any
) -> EncoderLayerReplay:
    """Recompute what a fused ``nn.TransformerEncoderLayer`` call computed inside (see the module
    docstring). Runs the layer's own modules: the caller keeps them out of the capture."""
    names = ("src", "src_mask", "src_key_padding_mask", "is_causal")
    bound = dict(zip(names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    x, out = bound["src"], output_tensor(output)
    kpm = bound.get("src_key_padding_mask")
    if x.is_nested:  # TransformerEncoder's nested-tensor path: the padding lives in the sizes
        lengths = torch.tensor([t.size(0) for t in x.unbind()], device=x.device)
        x = x.to_padded_tensor(0.0)
        out = out.to_padded_tensor(0.0, x.shape)
        kpm = torch.arange(x.size(1), device=x.device)[None, :] >= lengths[:, None]
    mask, causal = bound.get("src_mask"), bool(bound.get("is_causal", False))
    if causal and mask is None:
        mask = torch.ones(x.size(-2), x.size(-2), dtype=torch.bool, device=x.device).triu_(1)
    attn_kw = {"attn_mask": mask, "key_padding_mask": kpm}
    with torch.no_grad():
        a_in = layer.norm1(x) if layer.norm_first else x
        weights = mha_weights(layer.self_attn, (a_in, a_in, a_in), attn_kw)
        sa = layer.self_attn(a_in, a_in, a_in, need_weights=False, **attn_kw)[0]
        s1 = x + sa if layer.norm_first else layer.norm1(x + sa)
    return EncoderLayerReplay(x, out, weights, s1)
