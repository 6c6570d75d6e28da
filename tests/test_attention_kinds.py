"""Attention that is not one plain softmax over the keys: sinks, flex_attention, local windows,
several patterns per layer, differential attention. Each against an oracle probe never computes:
the weights Hugging Face's eager attention returns (``output_attentions=True``, same weights) or a
masked softmax written here."""

from __future__ import annotations

import copy
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as tf  # noqa: E402
from torch import nn  # noqa: E402

import probe  # noqa: E402

tf.logging.set_verbosity_error()
TOL = 1e-6


def _ids(batch=2, T=7, vocab=96, pad_left=2):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :pad_left] = 0
    return ids, mask


def _capture(model, **x):
    with torch.no_grad(), probe.trace(model) as t:
        out = model(**x, output_attentions=True)
    return t.cache, out


def _close(got, want, tol=TOL):
    assert got.shape == want.shape
    assert float((got.float() - want.detach().float()).abs().max()) <= tol


# -- attention sinks ----------------------------------------------------------------------------
def _gpt_oss():
    cfg = tf.GptOssConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = tf.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "sinks"):
                m.sinks.normal_(0.0, 2.0)  # sinks that take a visible share
    return model


def test_gpt_oss_sink_pattern_over_real_keys_and_sink_mass_beside_it():
    model = _gpt_oss()
    ids, mask = _ids()
    cache, out = _capture(model, input_ids=ids, attention_mask=mask)
    for i in range(2):
        want = out.attentions[i]  # eager: the softmax over keys + sink, the sink column dropped
        _close(cache[f"decoder.blocks.{i}.self_attn.pattern"], want)
        # the sink's mass: the rest of each row's probability
        sink = cache[f"decoder.blocks.{i}.self_attn.sink"]
        _close(sink, 1 - want.sum(-1))
        assert float(sink.min()) > 1e-3  # the sinks really take mass: the check above means something
        info = cache.metadata["layers"][i]["self_attn"]
        assert "sink" in info["kind"] and info["heads"] == 4
    # the chain and the deltas are unaffected
    assert torch.equal(cache["decoder.blocks.0.resid_post"], cache["decoder.blocks.1.resid_pre"])


class SinkBlock(nn.Module):
    """Softmax over [scores | sink]: the sink logit per head, written out here."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.sink = nn.Parameter(torch.tensor([0.5, -1.0]))

    def scores(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
        T = x.size(1)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        return s, v

    def forward(self, x):
        s, v = self.scores(x)
        col = self.sink.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        w = torch.cat([s, col], -1).softmax(-1)[..., :-1]
        return x + self.out((w @ v).transpose(1, 2).flatten(2))


def test_hand_written_sink_against_a_softmax_written_here():
    torch.manual_seed(1)
    model = nn.Sequential(SinkBlock(), SinkBlock()).eval()
    x = torch.randn(2, 6, 16)
    with torch.no_grad(), probe.trace(model) as t:
        model(x)
    with torch.no_grad():
        s, _ = model[0].scores(x)
        e = s.double().exp()
        z = e.sum(-1, keepdim=True) + model[0].sink.double().exp().view(1, -1, 1, 1)
        sink = model[0].sink.double().exp().view(1, -1, 1) / z[..., 0]
    _close(t.cache["decoder.blocks.0.self_attn.pattern"], (e / z).float())
    _close(t.cache["decoder.blocks.0.self_attn.sink"], sink.float())


# -- flex_attention -----------------------------------------------------------------------------
class FlexBlock(nn.Module):
    """flex_attention with a score_mod (a per-head distance bias read from a buffer) and a block
    mask (causal, a window of ``window`` keys), grouped-query heads."""

    def __init__(self, d=32, heads=4, kv_heads=2, window=5):
        super().__init__()
        self.h, self.kv, self.dh, self.window = heads, kv_heads, d // heads, window
        self.q = nn.Linear(d, d)
        self.kv_proj = nn.Linear(d, 2 * kv_heads * self.dh)
        self.o = nn.Linear(d, d)
        self.register_buffer("slope", torch.linspace(0.1, 0.8, heads))

    def qk(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.h, self.dh).transpose(1, 2)
        k, v = self.kv_proj(x).view(b, t, 2, self.kv, self.dh).permute(2, 0, 3, 1, 4)
        return q, k, v

    def forward(self, x):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        q, k, v = self.qk(x)
        slope, window = self.slope, self.window

        def score_mod(s, b, h, qi, ki):
            return s - slope[h] * (qi - ki)

        def mask_mod(b, h, qi, ki):
            return (qi >= ki) & (qi - ki < window)

        T = x.size(1)
        mask = create_block_mask(mask_mod, None, None, T, T, device=x.device, BLOCK_SIZE=8)
        y = flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=True)
        return x + self.o(y.transpose(1, 2).flatten(2))


def _masked_softmax(q, k, bias, allowed):
    """softmax(q kᵀ/√d + bias) over allowed keys, float64; key heads repeated to the query heads."""
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.size(-1)) + bias
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).float()


def test_hand_written_flex_attention_with_score_mod_and_block_mask():
    import warnings

    torch.manual_seed(2)
    model = nn.Sequential(FlexBlock(), FlexBlock()).eval()
    x = torch.randn(2, 19, 32)  # 19 rows: blocks of 8 with a ragged last one
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention's own "called without torch.compile"
        with torch.no_grad():
            want_out = model(x)
            with probe.trace(model) as t:
                got_out = model(x)
    assert torch.equal(got_out, want_out)  # the model ran as without probe
    i, j = torch.arange(19)[:, None], torch.arange(19)[None]
    h = x
    with torch.no_grad():
        for layer, block in enumerate(model):
            q, k, _ = block.qk(h)
            bias = -block.slope.double().view(1, -1, 1, 1) * (i - j)
            want = _masked_softmax(q, k, bias, (i >= j) & (i - j < 5))
            _close(t.cache[f"decoder.blocks.{layer}.self_attn.pattern"], want)
            h = block(h)
    assert t.cache.metadata["attention_implementations"] == ["flex"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_transformers_flex_attention_model_against_eager(arch):
    # transformers runs flex_attention through torch.compile (inductor). Llama with a padded batch
    # (a block mask from the attention mask); Qwen2 through probe.capture with no mask, which once
    # died inside the compiler (InductorError: the traced call kept flex's log-sum-exp output alive)
    import warnings

    Config, Model = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
    }[arch]
    cfg = Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = Model._from_config(cfg, attn_implementation="flex_attention").eval()
    # a config of its own: _from_config sets the implementation on the config it is given, and a
    # shared one switched the flex model to eager too (this test then ran no flex_attention)
    eager = Model._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    assert model.config._attn_implementation == "flex_attention"
    ids, mask = _ids()
    inputs = {"input_ids": ids, "attention_mask": mask} if arch == "llama" else {"input_ids": ids}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if arch == "llama":
            with torch.no_grad(), probe.trace(model) as t:
                model(**inputs)
            cache = t.cache
        else:
            with torch.no_grad():
                plain = model(ids).logits  # compiles flex_attention on its own first, as a user would
            cache = probe.capture(model, ids)  # as the user called it: gradients on
    with torch.no_grad():
        want = eager(**inputs, output_attentions=True, output_hidden_states=True)
    real = 2 if arch == "llama" else 0  # text 1's real queries (2 pads on the left for llama)
    for i in range(2):
        got = cache[f"decoder.blocks.{i}.self_attn.pattern"]
        _close(got[0], want.attentions[i][0])
        _close(got[1, :, real:], want.attentions[i][1, :, real:])
        if real:
            assert float(got[1, :, real:, :real].abs().max()) == 0  # real queries give padding no weight
    resid, want_resid = cache["decoder.blocks.1.resid_pre"], want.hidden_states[1]
    torch.testing.assert_close(resid[0], want_resid[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(resid[1, real:], want_resid[1, real:], atol=1e-6, rtol=0)  # pads: any value
    deltas = {"self_attn": "sublayer output", "mlp": "sublayer output"}
    assert cache.metadata["layers"][0]["deltas"] == deltas
    assert cache.metadata["attention_implementations"] == ["flex"]
    if arch == "qwen2":
        torch.testing.assert_close(plain, want.logits, atol=1e-5, rtol=0)


# -- differential attention ---------------------------------------------------------------------
def test_diffllama_stores_the_models_heads_as_combined_maps_with_their_parts():
    cfg = tf.DiffLlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = tf.DiffLlamaForCausalLM(cfg).eval()  # default implementation (sdpa)
    eager = tf.DiffLlamaForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    ids, mask = _ids()
    with torch.no_grad(), probe.trace(model) as t:
        model(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        soft = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    for i, layer in enumerate(eager.model.layers):
        att = layer.self_attn
        # λ as the paper and the module define it, written out here
        lam = (
            torch.exp((att.lambda_q1 * att.lambda_k1).sum())
            - torch.exp((att.lambda_q2 * att.lambda_k2).sum())
        ).item() + att.lambda_init
        a1, a2 = soft[i][:, :4], soft[i][:, 4:]  # head h pairs query heads h and h + 4
        got = t.cache[f"decoder.blocks.{i}.self_attn.pattern"]
        assert got.shape == (2, 4, 7, 7)  # the model's 4 differential heads, not 8 softmaxes
        _close(got[0], (a1 - lam * a2)[0])
        _close(got[1, :, 2:], (a1 - lam * a2)[1, :, 2:])  # text 1's real queries
        parts = t.cache[f"decoder.blocks.{i}.self_attn.parts"]
        _close(parts[0], torch.stack([a1, a2], 2)[0])
        assert "differential" in t.cache.metadata["layers"][i]["self_attn"]["kind"]


# -- several attentions per layer ---------------------------------------------------------------
def test_minimax_lightning_layer_returns_a_state_not_a_pattern():
    # MiniMax's eager output_attentions has an entry for its linear-attention layer too: the
    # [head_dim, head_dim] key-value state, not weights over keys; probe stores the softmax
    # layer's pattern exactly and says the linear layer has no attention
    cfg = tf.MiniMaxConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=6,
        num_local_experts=2,
        num_experts_per_tok=1,
        max_position_embeddings=64,
        block_size=4,
        layer_types=["full_attention", "linear_attention"],
    )
    torch.manual_seed(0)
    model = tf.MiniMaxForCausalLM(cfg).eval()
    eager = tf.MiniMaxForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    ids, _ = _ids()
    with torch.no_grad(), probe.trace(model) as t:
        model(input_ids=ids)
    with torch.no_grad():
        want = eager(input_ids=ids, output_attentions=True).attentions
    _close(t.cache["decoder.blocks.0.self_attn.pattern"], want[0])
    assert want[1].shape[-2:] == (6, 6)  # head_dim x head_dim: a state, not [query, key]
    assert "decoder.blocks.1.self_attn.pattern" not in t.cache
    assert "no attention" in t.cache.metadata["layers"][1]["residual_note"]


def test_deepseek_v4_compressed_keys_are_stored_beside_the_pattern():
    # its compressed attention runs one softmax over the positions, block summaries and a sink:
    # stored as pattern (positions), compressed (summaries) and sink, against eager's [T, T + C]
    # (the sink dropped), for a sequence of 9 that closes summaries in both layers
    cfg = tf.DeepseekV4Config(
        vocab_size=96,
        hidden_size=32,
        moe_intermediate_size=16,
        head_dim=16,
        q_lora_rank=16,
        o_lora_rank=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        sliding_window=4,
        index_head_dim=8,
        index_topk=4,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        qk_rope_head_dim=8,
        o_groups=2,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
    )
    torch.manual_seed(0)
    model = tf.DeepseekV4ForCausalLM(cfg).eval()
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    cache = probe.capture(model, ids)
    twin = type(model)._from_config(cfg, attn_implementation="eager").eval()
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        want = twin(ids, output_attentions=True).attentions
    for layer, w in enumerate(want):
        key = f"decoder.blocks.{layer}.self_attn"
        torch.testing.assert_close(cache[f"{key}.pattern"], w[..., :9], atol=1e-6, rtol=0)
        torch.testing.assert_close(cache[f"{key}.compressed"], w[..., 9:], atol=1e-6, rtol=0)
        torch.testing.assert_close(cache[f"{key}.sink"], 1 - w.sum(-1), atol=1e-5, rtol=0)
    assert cache["decoder.blocks.1.self_attn.compressed"].shape[-1] > 0


# -- CpmAnt -------------------------------------------------------------------------------------
def test_cpmant_patterns_cover_its_prompt_slots_and_match_eager_on_the_tokens():
    # CpmAnt runs its layers over prompt_length learned prompt slots ahead of the tokens and its
    # output_attentions drops them ([prompt:, prompt:]); probe stores what the layers computed,
    # prompt slots included, so the tokens' block is the eager weights
    cfg = tf.CpmAntConfig(
        vocab_size=96,
        hidden_size=32,
        num_attention_heads=4,
        dim_head=8,
        dim_ff=64,
        num_hidden_layers=2,
        prompt_length=4,
        position_bias_num_buckets=16,
        position_bias_max_distance=32,
    )
    torch.manual_seed(0)
    model = tf.CpmAntModel(cfg).eval()
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    cache, out = _capture(model, input_ids=ids, attention_mask=mask)
    stack = cache.stacks[0]
    for i in range(2):
        got = cache[f"{stack}.blocks.{i}.self_attn.pattern"]
        assert got.shape == (2, 4, 4 + 7, 4 + 7)
        _close(got[:, :, 4:, 4:], out.attentions[i])
        assert torch.allclose(got.sum(-1)[0], torch.ones(4, 11))  # rows over prompt + tokens sum to 1
    # the metadata marks the prompt slots: as many as the config's prompt_length, the same number
    # as the positions the patterns hold beyond the 7 tokens
    slots = cache.metadata["prompt_slots"]
    assert slots["count"] == cfg.prompt_length == got.shape[-1] - ids.shape[1]
    assert "positions 0..3" in slots["note"]


def test_a_compiler_failure_inside_the_forward_is_one_line():
    # a compiled function the model calls fails to compile while probe watches: one ProbeError
    # naming the fix, not torch's compiler traceback (the model's own error, uncompiled, is kept)
    def broken_backend(gm, example_inputs):
        raise RuntimeError("the backend cannot lower this graph")

    @torch.compile(backend=broken_backend, fullgraph=True)
    def scaled(x):
        return torch.softmax(x @ x.transpose(-1, -2), -1) @ x

    class Compiled(nn.Module):
        def forward(self, x):
            return x + scaled(x)

    torch._dynamo.reset()
    with pytest.raises(probe.ProbeError, match=r"^torch\.compile failed inside the forward.*uncompiled") as e:
        probe.capture(nn.Sequential(Compiled()), torch.randn(1, 5, 8))
    assert "\n" not in str(e.value) and e.value.__suppress_context__
