"""torch's own transformer layers: patterns equal the weights nn.MultiheadAttention returns with
need_weights=True, average_attn_weights=False, and the fast paths stay fast (bit-identical)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import probe


def mha_oracle(mha, q, k, v, **kw):
    _, w = mha(q, k, v, need_weights=True, average_attn_weights=False, **kw)
    return w


def run(model, *args, **kwargs):
    with torch.no_grad():
        plain = model(*args, **kwargs)
        with probe.trace(model) as t:
            traced = model(*args, **kwargs)
    assert torch.equal(plain, traced), "capture changed the output (fast path lost?)"
    return t.cache


def check_residuals(cache, stack):
    for i in range(cache.n_layers(stack)):
        pre = cache[f"{stack}.blocks.{i}.resid_pre"]
        parts = [k for k in cache.keys() if k.startswith(f"{stack}.blocks.{i}.") and k.endswith("delta")]
        total = pre + sum(cache[k] for k in parts)
        torch.testing.assert_close(total, cache[f"{stack}.blocks.{i}.resid_post"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("nested", [False, True], ids=["padded", "nested"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["postnorm", "prenorm"])
def test_transformer_encoder(norm_first, nested):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=norm_first)
    enc = nn.TransformerEncoder(layer, 3, enable_nested_tensor=nested).eval()
    x = torch.randn(2, 7, 32)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, 5:] = True
    cache = run(enc, x, src_key_padding_mask=kpm)
    assert cache.stacks == ["encoder"] and cache.metadata["attention_implementations"] == ["mha"]
    h = x
    with torch.no_grad():
        for i, lyr in enumerate(enc.layers):
            a_in = lyr.norm1(h) if norm_first else h
            w = mha_oracle(lyr.self_attn, a_in, a_in, a_in, key_padding_mask=kpm)
            torch.testing.assert_close(cache.pattern("encoder", i)[0], w[0], atol=1e-6, rtol=0)
            torch.testing.assert_close(cache.pattern("encoder", i)[1, :, :5], w[1, :, :5], atol=1e-6, rtol=0)
            assert torch.all(cache.pattern("encoder", i)[1, :, :, 5:] == 0)
            torch.testing.assert_close(
                cache[f"encoder.blocks.{i}.resid_pre"][1, :5], h[1, :5], atol=1e-6, rtol=0
            )
            h = lyr(h, src_key_padding_mask=kpm)
    check_residuals(cache, "encoder")


def test_encoder_with_causal_mask():
    torch.manual_seed(1)
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2
    ).eval()
    x = torch.randn(1, 6, 16)
    mask = nn.Transformer.generate_square_subsequent_mask(6)
    cache = run(enc, x, mask=mask, is_causal=True)
    assert cache.stacks == ["decoder"]  # a causal lone stack reads as a decoder
    with torch.no_grad():
        w = mha_oracle(enc.layers[0].self_attn, x, x, x, attn_mask=mask)
    torch.testing.assert_close(cache.pattern("decoder", 0), w, atol=1e-6, rtol=0)


def test_full_transformer_has_encoder_decoder_and_cross_attention():
    torch.manual_seed(2)
    tr = nn.Transformer(32, 4, 2, 2, 64, dropout=0.0, batch_first=True).eval()
    src, tgt = torch.randn(2, 6, 32), torch.randn(2, 4, 32)
    tgt_mask = tr.generate_square_subsequent_mask(4)
    cache = run(tr, src, tgt, tgt_mask=tgt_mask)
    assert cache.stacks == ["encoder", "decoder"]
    with torch.no_grad():
        memory = tr.encoder(src)
        y = tgt
        for i, lyr in enumerate(tr.decoder.layers):
            w_self = mha_oracle(lyr.self_attn, y, y, y, attn_mask=tgt_mask)
            s1 = lyr.norm1(y + lyr.self_attn(y, y, y, attn_mask=tgt_mask, need_weights=False)[0])
            w_cross = mha_oracle(lyr.multihead_attn, s1, memory, memory)
            torch.testing.assert_close(cache.pattern("decoder", i), w_self, atol=1e-6, rtol=0)
            torch.testing.assert_close(cache.pattern("decoder", i, "cross"), w_cross, atol=1e-6, rtol=0)
            y = lyr(y, memory, tgt_mask=tgt_mask)
    check_residuals(cache, "encoder")
    check_residuals(cache, "decoder")


@pytest.mark.parametrize("batch_first", [True, False])
def test_bare_multihead_attention(batch_first):
    torch.manual_seed(3)
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first, kdim=12, vdim=10).eval()
    shape = (lambda b, t, d: (b, t, d)) if batch_first else (lambda b, t, d: (t, b, d))
    q, k, v = torch.randn(*shape(2, 5, 16)), torch.randn(*shape(2, 7, 12)), torch.randn(*shape(2, 7, 10))
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[0, 6] = True
    with torch.no_grad():
        plain = mha(q, k, v, key_padding_mask=kpm, need_weights=False)[0]
        with probe.trace(mha) as t:
            traced = mha(q, k, v, key_padding_mask=kpm, need_weights=False)[0]
        w = mha_oracle(mha, q, k, v, key_padding_mask=kpm)
    assert torch.equal(plain, traced)
    cache = t.cache
    assert cache.keys() == ["decoder.blocks.0.cross_attn.pattern"] or cache.keys()[0].endswith(
        "cross_attn.pattern"
    )
    torch.testing.assert_close(cache[cache.keys()[0]], w, atol=1e-6, rtol=0)


def test_training_mode_slow_path():
    torch.manual_seed(4)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2)
    enc.train()
    x = torch.randn(2, 5, 16, requires_grad=True)
    with probe.trace(enc) as t:
        out = enc(x)
    out.sum().backward()  # capture leaves autograd intact
    assert x.grad is not None
    with torch.no_grad():
        w = mha_oracle(enc.layers[0].self_attn, x, x, x)
    torch.testing.assert_close(t.cache.pattern("encoder", 0), w, atol=1e-6, rtol=0)
    check_residuals(t.cache, "encoder")
