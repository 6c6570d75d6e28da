"""probe.capture / probe.trace on hand-written modules, checked against oracles written here."""

from __future__ import annotations

import pytest
import torch
from toys import ALL_KINDS, SDPA_KINDS, SOFTMAX_KINDS, NoAttention, ToyLM, ToySeq2Seq, alibi_bias

import probe
from probe import ProbeError


def masked_softmax(q, k, scale, allowed=None, bias=None):
    """The oracle: softmax(q kᵀ · scale) over allowed keys, computed the textbook way."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scale
    if bias is not None:
        scores = scores + bias.double()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1).float()


def oracle_weights(attn, x):
    """Per-head weights [B, H, T, T] that toys.Attention ``attn`` computes on input ``x``."""
    T = x.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if attn.kind == "mha":
        _, w = attn.mha(x, x, x, attn_mask=~causal, need_weights=True, average_attn_weights=False)
        return w
    if attn.kind in SOFTMAX_KINDS:
        return attn.weights
    q, k, _ = attn.qkv(x)
    scale = 0.3 if attn.kind == "sdpa_scale" else attn.hd**-0.5
    if attn.kind == "sdpa_float":
        return masked_softmax(q, k, scale, bias=alibi_bias(attn.h, T, T))
    return masked_softmax(q, k, scale, allowed=causal)


def run_with_inputs(model, ids, modules):
    """Run ``model`` plainly, recording the input and output of each module in ``modules``."""
    seen = {}
    hooks = [
        m.register_forward_hook(lambda mod, a, o, name=name: seen.__setitem__(name, (a[0], o)))
        for name, m in modules.items()
    ]
    try:
        out = model(ids)
    finally:
        for h in hooks:
            h.remove()
    return out, seen


@pytest.mark.parametrize("post_norm", [False, True], ids=["prenorm", "postnorm"])
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_patterns_match_oracle_and_outputs_unchanged(kind, post_norm):
    torch.manual_seed(0)
    model = ToyLM(kind, post_norm=post_norm, n_kv_heads=2 if kind == "sdpa_gqa" else None).eval()
    ids = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        plain = model(ids)
        with probe.trace(model) as t:
            traced = model(ids)
        assert torch.equal(plain, traced), "capture changed the model's output"
        attns = {f"{i}": b.attn for i, b in enumerate(model.blocks)}
        _, seen = run_with_inputs(model, ids, attns)
    cache = t.cache
    assert cache.stacks == ["decoder"]
    for i, attn in enumerate(model.blocks):
        x = seen[str(i)][0]
        with torch.no_grad():
            expected = oracle_weights(attn.attn, x)
        got = cache.pattern("decoder", i)
        assert got.shape == (2, 4, 9, 9)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
        assert torch.all(torch.triu(got, 1) == 0)
    impl = "mha" if kind == "mha" else "sdpa" if kind in SDPA_KINDS else "softmax"
    assert cache.metadata["attention_implementations"] == [impl]


@pytest.mark.parametrize("kind", ["sdpa_causal", "F.softmax", "mha"])
def test_prenorm_deltas_are_the_sublayer_outputs(kind):
    torch.manual_seed(1)
    model = ToyLM(kind).eval()
    ids = torch.randint(0, 40, (2, 7))
    mods = {}
    for i, b in enumerate(model.blocks):
        mods[f"attn{i}"], mods[f"mlp{i}"], mods[f"block{i}"] = b.attn, b.mlp, b
    with torch.no_grad():
        _, seen = run_with_inputs(model, ids, mods)
        cache = probe.capture(model, ids)
    for i in range(3):
        pre = cache[f"decoder.blocks.{i}.resid_pre"]
        assert torch.equal(pre, seen[f"block{i}"][0])
        assert torch.equal(cache[f"decoder.blocks.{i}.self_attn.delta"], seen[f"attn{i}"][1])
        assert torch.equal(cache[f"decoder.blocks.{i}.mlp.delta"], seen[f"mlp{i}"][1])
        assert torch.equal(cache[f"decoder.blocks.{i}.resid_post"], seen[f"block{i}"][1])
        total = pre + cache[f"decoder.blocks.{i}.self_attn.delta"] + cache[f"decoder.blocks.{i}.mlp.delta"]
        torch.testing.assert_close(total, cache[f"decoder.blocks.{i}.resid_post"], atol=1e-5, rtol=0)
        if i < 2:
            assert torch.equal(
                cache[f"decoder.blocks.{i}.resid_post"], cache[f"decoder.blocks.{i + 1}.resid_pre"]
            )


@pytest.mark.parametrize("kind", ["sdpa_causal", "F.softmax"])
def test_parallel_block_deltas_are_each_sublayer_output(kind):
    torch.manual_seed(6)
    model = ToyLM(kind, post_norm="parallel").eval()
    ids = torch.randint(0, 40, (2, 6))
    mods = {}
    for i, b in enumerate(model.blocks):
        mods[f"attn{i}"], mods[f"mlp{i}"] = b.attn, b.mlp
    with torch.no_grad():
        _, seen = run_with_inputs(model, ids, mods)
        cache = probe.capture(model, ids)
    for i in range(3):
        assert torch.equal(cache[f"decoder.blocks.{i}.self_attn.delta"], seen[f"attn{i}"][1])
        assert torch.equal(cache[f"decoder.blocks.{i}.mlp.delta"], seen[f"mlp{i}"][1])
        total = cache[f"decoder.blocks.{i}.resid_pre"] + seen[f"attn{i}"][1] + seen[f"mlp{i}"][1]
        torch.testing.assert_close(total, cache[f"decoder.blocks.{i}.resid_post"], atol=1e-5, rtol=0)


def test_postnorm_deltas_are_stream_differences():
    torch.manual_seed(2)
    model = ToyLM("torch.softmax", post_norm=True).eval()
    ids = torch.randint(0, 40, (1, 8))
    mods = {}
    for i, b in enumerate(model.blocks):
        mods[f"ln1_{i}"], mods[f"block{i}"] = b.ln1, b
    with torch.no_grad():
        _, seen = run_with_inputs(model, ids, mods)
        cache = probe.capture(model, ids)
    for i in range(3):
        x, out = seen[f"block{i}"]
        s1 = seen[f"ln1_{i}"][1]  # the stream after the attention sublayer: ln1(x + attn(x))
        torch.testing.assert_close(cache[f"decoder.blocks.{i}.self_attn.delta"], s1 - x, atol=1e-6, rtol=0)
        torch.testing.assert_close(cache[f"decoder.blocks.{i}.mlp.delta"], out - s1, atol=1e-6, rtol=0)


def test_encoder_decoder_roles_stacks_and_cross_attention():
    torch.manual_seed(3)
    model = ToySeq2Seq().eval()
    src = torch.tensor([[5, 6, 7, 8, 0, 0], [9, 4, 3, 2, 1, 11]])
    tgt = torch.randint(1, 30, (2, 4))
    seen = {}
    hooks = [
        b.cross_attn.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, (a[0], a[1], a[2])))
        for i, b in enumerate(model.decoder)
    ]
    with torch.no_grad():
        plain = model(src, tgt)
        with probe.trace(model) as t:
            traced = model(src, tgt)
    for h in hooks:
        h.remove()
    assert torch.equal(plain, traced)
    cache = t.cache
    assert cache.stacks == ["encoder", "decoder"]
    assert cache.n_layers("encoder") == 2 and cache.n_layers("decoder") == 3
    assert "encoder.blocks.0.cross_attn.pattern" not in cache
    for i, blk in enumerate(model.decoder):
        x, memory, mask = seen[i]
        with torch.no_grad():
            q = blk.cross_attn.q(x).view(2, 4, 4, 8).transpose(1, 2)
            k = blk.cross_attn.k(memory).view(2, 6, 4, 8).transpose(1, 2)
        expected = masked_softmax(q, k, 8**-0.5, allowed=mask[:, None, None, :])
        got = cache.pattern("decoder", i, "cross")
        assert got.shape == (2, 4, 4, 6)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
        assert torch.all(got[0, :, :, 4:] == 0), "source pads must get no attention"
        torch.testing.assert_close(cache.pattern("decoder", i), blk.self_attn.weights, atol=0, rtol=0)
        pre = cache[f"decoder.blocks.{i}.resid_pre"]
        parts = ("self_attn", "cross_attn", "mlp")
        total = pre + sum(cache[f"decoder.blocks.{i}.{p}.delta"] for p in parts)
        torch.testing.assert_close(total, cache[f"decoder.blocks.{i}.resid_post"], atol=1e-5, rtol=0)


def test_separate_head_modules_are_stacked_as_heads():
    import models

    gpt = models.load("minigpt")
    ids = torch.tensor([gpt.tokenizer.encode("attention lets tokens")])
    cache = probe.capture(gpt, ids)
    head_weights = []
    hooks = [
        h.register_forward_hook(lambda m, a, o: head_weights.append(o[1]))
        for blk in gpt.blocks
        for h in blk.attn.heads
    ]
    with torch.no_grad():
        gpt(ids)
    for h in hooks:
        h.remove()
    assert len(head_weights) == 8
    for layer in range(2):
        expected = torch.stack(head_weights[4 * layer : 4 * layer + 4], dim=1)
        torch.testing.assert_close(cache.pattern("decoder", layer), expected, atol=1e-6, rtol=0)


def test_layers_heads_and_dtype_filters():
    torch.manual_seed(4)
    model = ToyLM("sdpa_causal").eval()
    ids = torch.randint(0, 40, (1, 6))
    full = probe.capture(model, ids)
    part = probe.capture(model, ids, layers=[1, 2], heads=[0, 3], dtype="float16")
    assert part.n_layers("decoder") == 2
    assert "decoder.blocks.0.self_attn.pattern" not in part
    p = part.pattern("decoder", 2)
    assert p.dtype == torch.float16 and p.shape == (1, 2, 6, 6)
    torch.testing.assert_close(p.float(), full.pattern("decoder", 2)[:, [0, 3]], atol=1e-3, rtol=0)
    assert part.metadata["dtype"] == "float16"
    bf = probe.capture(model, ids, dtype=torch.bfloat16)
    assert bf["decoder.blocks.0.resid_pre"].dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("streamed", [False, True])
def test_recomputed_patterns_in_a_smaller_dtype_are_the_float32_weights_rounded(dtype, streamed, tmp_path):
    # the weights are converted on their one copy into storage: the same rounding as .to(dtype)
    # (torch's own cast is the oracle), also across chunks of query rows (T > 128) and the two
    # reused buffers of a streamed capture
    torch.manual_seed(9)
    lm = ToyLM("sdpa_causal", n_layers=4).eval()
    lm.pos = torch.nn.Embedding(200, 32)
    ids = torch.randint(0, 40, (2, 200))
    out = tmp_path / "c.safetensors" if streamed else None
    small = probe.capture(lm, ids, dtype=dtype, out=out)
    full = probe.capture(lm, ids)
    for layer in range(4):
        p = small.pattern("decoder", layer)
        assert p.dtype == dtype
        assert torch.equal(p, full.pattern("decoder", layer).to(dtype))


def test_no_attention_is_a_clear_error():
    with pytest.raises(ProbeError, match="no attention found in NoAttention"):
        probe.capture(NoAttention(), torch.randn(1, 3, 8))


def test_layers_out_of_range_is_a_clear_error():
    with pytest.raises(ProbeError, match="selects no layer"):
        probe.capture(ToyLM().eval(), torch.randint(0, 40, (1, 4)), layers=[7])


def test_trace_refuses_two_forward_passes():
    model = ToyLM().eval()
    ids = torch.randint(0, 40, (1, 4))
    with pytest.raises(ProbeError, match="2 forward passes"):
        with probe.trace(model):
            model(ids)
            model(ids)


def test_hooks_are_removed_after_capture():
    model = ToyLM().eval()
    probe.capture(model, torch.randint(0, 40, (1, 4)))
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert torch._C._len_torch_function_stack() == 0


def test_metadata_dtype_says_what_was_stored():
    torch.manual_seed(5)
    model = ToyLM("sdpa_causal").eval().to(torch.bfloat16)
    cache = probe.capture(model, torch.randint(0, 40, (1, 5)))
    # SDPA weights are computed in float32; the bf16 model's residual stream stays bf16
    assert cache.pattern("decoder", 0).dtype == torch.float32
    assert cache["decoder.blocks.0.resid_pre"].dtype == torch.bfloat16
    assert cache.metadata["dtype"] == "bfloat16, float32"


def test_kv_cached_softmax_over_cached_and_new_keys_is_recorded():
    """A hand-written softmax over [new queries, cached + new keys] (a KV-cached decoding call) is a pattern.

    Oracle: each layer's weights computed in the test from the attention module's own input and
    the cached keys (q·kᵀ/√d, bottom-right causal mask, softmax).
    """
    from causal_gallery import D, H, TinyLM

    model = TinyLM(["ok", "ok"])
    ids = torch.tensor([[3, 7, 1, 9, 4, 2, 8, 5, 6, 11]])
    n = 6
    with torch.no_grad():
        past = model(ids[:, :n], use_cache=True).past_key_values
    seen = {}
    hooks = [
        b.attn.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, (a[0], a[2])))
        for i, b in enumerate(model.blocks)
    ]
    with torch.no_grad(), probe.trace(model) as t:
        model(ids[:, n:], past_key_values=past, use_cache=True)
    for h in hooks:
        h.remove()
    T, S = ids.shape[1] - n, ids.shape[1]
    for i, b in enumerate(model.blocks):
        x, (pk, _) = seen[i]
        q, k, _ = b.attn.qkv(x).view(1, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        k = torch.cat([pk, k], 2)
        s = q @ k.transpose(-2, -1) / (D // H) ** 0.5
        future = torch.arange(S)[None, :] > torch.arange(T)[:, None] + (S - T)
        want = s.masked_fill(future, float("-inf")).softmax(-1)
        got = t.cache.pattern("decoder", i)
        assert got.shape == (1, H, T, S)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
