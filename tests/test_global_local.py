"""Pegasus-X's block-local attention with global tokens (issue 22, local attention): the encoder's
two softmaxes per layer mapped back, ``pattern`` ``[b, h, T, T]`` (the tokens over the tokens,
zeros outside each query's block), ``globals`` ``[b, h, T, G]`` (the tokens over the global
tokens) and ``global_rows`` ``[b, h, G, G + T]`` (the global tokens over [global | tokens]).

Oracle: the weights the model's attention module returns itself (its third output,
``{"global", "local"}``, read by a hook on the eager twin), mapped back here with the layer's own
``stagger_blocks_this_layer`` (a staggered layer pads ``block_size // 2`` ahead of the blocks).
"""

from __future__ import annotations

import torch
import transformers as tf
from test_catalogue_structure import VOCAB, _eager, _ids, _seeded

import probe

N, G, T = 4, 3, 10  # block size, global tokens, input length (not a multiple of the block)


def pegasus_x():
    cfg = tf.PegasusXConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=3, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, block_size=N,
        num_global_tokens=G, stagger_local_blocks=True, max_position_embeddings=64,
    )  # fmt: skip
    return _seeded(tf.PegasusXModel, cfg)


def _inputs():
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, 7:] = 0
    return {"input_ids": _ids(2, T), "attention_mask": mask, "decoder_input_ids": _ids(2, 5, seed=1)}


def _model_weights(model, x):
    """Each encoder layer's own ``({"global", "local"}, staggered)`` from the eager twin."""
    twin, got = _eager(model), []
    hooks = [
        ly.self_attn.register_forward_hook(
            lambda m, i, o, s=ly.stagger_blocks_this_layer: got.append((o[2], s))
        )
        for ly in twin.encoder.layers
    ]
    try:
        with torch.no_grad():
            twin(**x)
    finally:
        for h in hooks:
            h.remove()
    return got


def _mapped(probs, stagger):
    """The model's weights as (pattern, globals, global_rows), written here position by position."""
    local, glob = probs["local"], probs["global"]
    shift = N // 2 if stagger else 0
    b, h = local.shape[:2]
    pos = torch.arange(local.shape[2] * N)  # padded positions
    real = pos - shift
    keep = (real >= 0) & (real < T)
    blk, col = pos // N, pos % N
    full = local[:, :, blk, col][..., G:]  # [b, h, P, n]: each padded query's own block keys
    pattern = torch.zeros(b, h, T, T)
    for p in pos[keep].tolist():
        for c in range(N):
            k = int(blk[p]) * N + c - shift
            if 0 <= k < T:
                pattern[:, :, p - shift, k] = full[:, :, p, c]
    globals_ = local[:, :, blk, col][..., :G][:, :, keep]
    rows = torch.cat([glob[..., :G], glob[..., G + shift : G + shift + T]], dim=-1)
    return pattern, globals_, rows


def test_pegasus_x_encoder_blocks_and_global_tokens_are_mapped_back_exactly():
    model = pegasus_x()
    x = _inputs()
    with torch.no_grad(), probe.trace(model) as t:
        model(**x)
    c = t.cache
    want = _model_weights(model, x)
    assert [s for _, s in want] == [False, True, False]  # both kinds of layer are exercised
    for layer, (probs, stagger) in enumerate(want):
        assert c.attentions("encoder", layer) == [("self", None)]
        pattern, globals_, rows = _mapped(probs, stagger)
        key = f"encoder.blocks.{layer}.self_attn"
        torch.testing.assert_close(c[f"{key}.pattern"], pattern, atol=1e-6, rtol=0)
        torch.testing.assert_close(c[f"{key}.globals"], globals_, atol=1e-6, rtol=0)
        torch.testing.assert_close(c[f"{key}.global_rows"], rows, atol=1e-6, rtol=0)
        # every token's weights on the tokens and the global tokens make up its softmax
        total = c[f"{key}.pattern"].sum(-1) + c[f"{key}.globals"].sum(-1)
        torch.testing.assert_close(total, torch.ones_like(total), atol=1e-5, rtol=0)
        assert "global tokens" in c.metadata["layers"][layer]["self_attn"]["kind"]
    assert c.pattern("encoder", 0).shape == (2, 2, T, T)
    # a query looks only inside its block: layer 0's blocks are 0-3, 4-7, 8-9
    p0 = c.pattern("encoder", 0)
    assert float(p0[:, :, :4, 4:].abs().max()) == 0.0 and float(p0[0, :, 4:8, 4:8].min()) > 0


def test_pegasus_x_head_selection_keeps_the_same_heads_of_every_field():
    model = pegasus_x()
    x = _inputs()
    with torch.no_grad(), probe.trace(model, heads=[1]) as t:
        model(**x)
    pattern, globals_, rows = _mapped(*_model_weights(model, x)[1])
    key = "encoder.blocks.1.self_attn"
    torch.testing.assert_close(t.cache[f"{key}.pattern"], pattern[:, 1:], atol=1e-6, rtol=0)
    torch.testing.assert_close(t.cache[f"{key}.globals"], globals_[:, 1:], atol=1e-6, rtol=0)
    torch.testing.assert_close(t.cache[f"{key}.global_rows"], rows[:, 1:], atol=1e-6, rtol=0)


def test_pegasus_x_decoder_is_captured_beside_the_encoder():
    model = pegasus_x()
    with torch.no_grad(), probe.trace(model) as t:
        model(**_inputs())
    assert t.cache.attentions("decoder", 0) == [("self", None), ("cross", None)]


def test_pegasus_x_keep_rows_and_topk_keep_the_global_fields_whole():
    model = pegasus_x()
    x = _inputs()
    caches = []
    for keep in (None, {"rows": [0, 2]}, {"topk": 2}):
        with torch.no_grad(), probe.trace(model, **({} if keep is None else {"keep": keep})) as t:
            model(**x)
        caches.append(t.cache)
    whole, *kept = caches
    for c in kept:
        for layer in range(3):
            key = f"encoder.blocks.{layer}.self_attn"
            for field in ("globals", "global_rows"):
                torch.testing.assert_close(c[f"{key}.{field}"], whole[f"{key}.{field}"], atol=0, rtol=0)
