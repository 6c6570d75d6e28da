"""SigLIP's attention pooling head (issue 30): ``SiglipMultiheadAttentionPoolingHead``, one learned
query reading the tower's patches through ``nn.MultiheadAttention``, is captured as what it is: a
one-layer stack of its own (named by its module path, never ``decoder``) whose cross-attention is
``[batch, heads, 1, patches]``, its layer's metadata saying so; the tower's layers and a
vision-language model's language layers stay their own (PaliGemma with ``vision_use_head=True``
was refused: the head was adopted as a layer of the whole model, swallowing the language layers).

Oracles: HF eager ``output_attentions`` of the same weights (the language model's; the vision
tower run on its own); the head's weights recomputed here by its own ``nn.MultiheadAttention`` on
the query, keys and values it was called with (read by a hook), ``need_weights=True,
average_attn_weights=False``.
"""

from __future__ import annotations

import torch
import transformers as tf
from test_images import SMALL, TOL, _pair

import probe

tf.logging.set_verbosity_error()
VISION = dict(**SMALL, image_size=32, patch_size=8, vision_use_head=True)  # 4 x 4 patches


def _head_weights(head, run):
    """The pooling head's per-head weights ``[batch, heads, 1, patches]`` for ``run()``."""
    seen = {}

    def grab(module, args, kwargs):
        seen["args"] = args

    handle = head.attention.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            out = run()
    finally:
        handle.remove()
    q, k, v = seen["args"]
    with torch.no_grad():
        _, w = head.attention(q, k, v, need_weights=True, average_attn_weights=False)
    return out, w


def test_paligemma_with_the_pooling_head_is_captured_exactly():
    cfg = tf.PaliGemmaConfig(
        vision_config=VISION,
        text_config=dict(**SMALL, num_key_value_heads=2, head_dim=8, vocab_size=64),
        image_token_index=60,
        projection_dim=32,
    )
    model, eager = _pair(tf.PaliGemmaForConditionalGeneration, cfg)
    ids = torch.tensor([[60] * 16 + [1, 5, 6, 7], [60] * 16 + [1, 8, 9, 10]])
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    types = torch.zeros_like(ids)  # the pictures and a prefix read both ways, a suffix causally
    types[:, 18:] = 1
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}
    inputs["token_type_ids"] = types
    cache = probe.capture(model, inputs)
    tower = eager.model.vision_tower
    out, head = _head_weights(tower.head, lambda: eager(**inputs, output_attentions=True))
    with torch.no_grad():
        vis = tower(pixel_values=pixels, output_attentions=True).attentions
    stacks = cache.metadata["stacks"]
    lm, enc = "model.language_model.layers", "model.vision_tower.encoder.layers"
    pool = "model.vision_tower.head"
    assert list(stacks) == [enc, pool, lm]
    assert (stacks[enc]["layers"], stacks[pool]["layers"], stacks[lm]["layers"]) == (2, 1, 2)
    for layer in range(2):
        torch.testing.assert_close(cache.pattern(lm, layer), out.attentions[layer], atol=TOL, rtol=0)
        torch.testing.assert_close(cache.pattern(enc, layer), vis[layer], atol=TOL, rtol=0)
    assert tuple(head.shape) == (2, 4, 1, 16)
    torch.testing.assert_close(cache.pattern(pool, 0, "cross"), head, atol=TOL, rtol=0)
    entry = next(e for e in cache.metadata["layers"] if e["stack"] == pool)
    assert "attention pooling head" in entry["pooling"] and "head.probe" in entry["pooling"]
    # the one query's map over the tower's patch grid, from the head's own weights
    got = probe.attention_map(cache, 0, query=0, stack=pool, batch=1)
    torch.testing.assert_close(got, head[1, :, 0].mean(0).reshape(4, 4), atol=TOL, rtol=0)
    # and the language model's image tokens still lie on that grid
    got = probe.attention_map(cache, 1, query=19, stack=lm)
    torch.testing.assert_close(got, out.attentions[1][0, :, 19, :16].mean(0).reshape(4, 4), atol=TOL, rtol=0)


def test_a_siglip_vision_model_heads_stack_is_no_decoder():
    model, eager = _pair(tf.SiglipVisionModel, tf.SiglipVisionConfig(**VISION))
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    cache = probe.capture(model, {"pixel_values": pixels})
    out, head = _head_weights(eager.head, lambda: eager(pixel_values=pixels, output_attentions=True))
    assert list(cache.metadata["stacks"]) == ["encoder", "head"]
    for layer in range(2):
        torch.testing.assert_close(cache.pattern("encoder", layer), out.attentions[layer], atol=TOL, rtol=0)
    torch.testing.assert_close(cache.pattern("head", 0, "cross"), head, atol=TOL, rtol=0)
    assert "pooling" in cache.metadata["layers"][-1]
    stats = probe.head_stats(cache, progress=False).table
    assert {r["stack"] for r in stats} == {"encoder", "head"}
