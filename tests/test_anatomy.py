"""probe.intervene.anatomy: which module plays which role, checked against the models' own code.

Oracles: the layouts the model sources define (GPT-2's ``c_attn`` is ``[q | k | v]``, GPT-NeoX's
``query_key_value`` is ``[head, (q, k, v), d_head]``, Llama's ``repeat_kv`` gives head ``h`` the
key head ``h // (H / Hkv)``, minigpt has one Linear per head and role), the modules the sources
name (``ln_1``, ``input_layernorm``, ``ln_f``), and a head's pattern recomputed in the test from
the per-head weights and compared with what Hugging Face's eager attention returns.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).parent))

import arch_fixtures as A  # noqa: E402
import hf_fixtures as hf  # noqa: E402

import models  # noqa: E402
from models import induction  # noqa: E402
from probe.errors import ProbeError  # noqa: E402
from probe.intervene.anatomy import anatomy  # noqa: E402

VOCAB = 100


def _ids(n=7, seed=0):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def gpt2():
    m = hf.gpt2(VOCAB)
    return m, anatomy(m, _ids())


@pytest.fixture(scope="module")
def llama():
    m = hf.llama(VOCAB)
    return m, anatomy(m, _ids())


def test_gpt2_fused_c_attn_is_q_k_v_side_by_side(gpt2):
    m, an = gpt2
    d, H, dh = 64, 4, 16
    for i, block in enumerate(m.transformer.h):
        a = an.attention[("decoder", i, "self")]
        assert (a.heads, a.kv_heads, a.d_head, a.kv_of) == (H, H, dh, list(range(H)))
        for h in range(H):
            for blocks, base in ((a.q, 0), (a.k, d), (a.v, 2 * d)):
                assert blocks[h].module is block.attn.c_attn
                assert blocks[h].cols == slice(base + h * dh, base + (h + 1) * dh)
        assert a.out.module is block.attn.c_proj
        assert a.norm is block.ln_1 and a.kv_norm is block.ln_1
        mlp = an.mlp[("decoder", i)]
        assert mlp.norm is block.ln_2 and mlp.readers == [block.mlp.c_fc] and not mlp.parallel
        assert mlp.out.module is block.mlp.c_proj
    assert an.final_norm is m.transformer.ln_f and an.unembed is m.lm_head
    assert not an.refused


def test_gpt2_head_pattern_recomputed_from_head_weights_equals_eager(gpt2):
    m, an = gpt2
    ids = _ids()
    out = hf.eager_twin(m)(ids, output_attentions=True, output_hidden_states=True)
    for layer in range(3):
        hw = an.head_weights("decoder", layer)
        W_c = m.transformer.h[layer].attn.c_attn.weight.detach()  # Conv1D: [in, out]
        assert torch.equal(hw.W_Q[1], W_c[:, 16:32]) and torch.equal(hw.W_V[2], W_c[:, 128 + 32 : 128 + 48])
        x = m.transformer.h[layer].ln_1(out.hidden_states[layer])[0]
        for h in range(4):
            q = x @ hw.W_Q[h] + hw.b_Q[h]
            k = x @ hw.W_K[hw.kv_of[h]] + hw.b_K[hw.kv_of[h]]
            s = (q @ k.T) / 4.0
            s = s.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
            torch.testing.assert_close(s.softmax(-1), out.attentions[layer][0, h], rtol=0, atol=1e-6)


def test_llama_gqa_blocks_follow_repeat_kv_and_values_reach_the_heads(llama):
    m, an = llama
    H, Hkv, dh = 8, 2, 8
    ids = _ids()
    twin = hf.eager_twin(m)
    got = {}
    hooks = [
        layer.self_attn.o_proj.register_forward_hook(lambda mod, a, o, _i=i: got.setdefault(_i, o[0]))
        for i, layer in enumerate(twin.model.layers)
    ]
    with torch.no_grad():
        out = twin(ids, output_attentions=True, output_hidden_states=True)
    for h in hooks:
        h.remove()
    for i, layer in enumerate(m.model.layers):
        a = an.attention[("decoder", i, "self")]
        assert a.kv_of == [h // (H // Hkv) for h in range(H)] and a.kv_heads == Hkv
        assert [b.module for b in a.q] == [layer.self_attn.q_proj] * H
        assert [b.cols for b in a.k] == [slice(g * dh, (g + 1) * dh) for g in range(Hkv)]
        assert a.norm is layer.input_layernorm and a.out.module is layer.self_attn.o_proj
        mlp = an.mlp[("decoder", i)]
        assert mlp.readers == [layer.mlp.gate_proj, layer.mlp.up_proj]
        assert mlp.norm is layer.post_attention_layernorm and not mlp.parallel
        # each head's pattern (eager's) times its values through W_O, summed: the o_proj output
        hw = an.head_weights("decoder", i)
        with torch.no_grad():
            x = layer.input_layernorm(out.hidden_states[i])[0]
            write = sum(
                out.attentions[i][0, h] @ (x @ hw.W_V[a.kv_of[h]] + hw.b_V[a.kv_of[h]]) @ hw.W_O[h]
                for h in range(H)
            )
        torch.testing.assert_close(write + hw.b_O, got[i], rtol=0, atol=1e-5)
    assert an.final_norm is m.model.norm and an.unembed is m.lm_head


def test_neox_interleaved_fused_qkv_and_parallel_mlp():
    m = hf.neox(VOCAB)
    an = anatomy(m, _ids())
    dh = 16
    for i, layer in enumerate(m.gpt_neox.layers):
        a = an.attention[("decoder", i, "self")]
        for h in range(4):  # [head, (q, k, v), d_head]
            assert a.q[h].cols == slice((3 * h) * dh, (3 * h + 1) * dh)
            assert a.k[h].cols == slice((3 * h + 1) * dh, (3 * h + 2) * dh)
            assert a.v[h].cols == slice((3 * h + 2) * dh, (3 * h + 3) * dh)
        assert a.norm is layer.input_layernorm
        mlp = an.mlp[("decoder", i)]
        assert mlp.parallel and mlp.norm is layer.post_attention_layernorm


def test_minigpt_one_module_per_head_and_role():
    m = models.load("minigpt")
    an = anatomy(m, "the cat sat on the mat")
    for i, block in enumerate(m.blocks):
        a = an.attention[("decoder", i, "self")]
        for h, head in enumerate(block.attn.heads):
            assert (a.q[h].module, a.k[h].module, a.v[h].module) == (head.query, head.key, head.value)
            assert a.q[h].cols == slice(0, 16)
        assert a.out.module is block.attn.proj and a.norm is block.ln1
        assert an.mlp[("decoder", i)].readers == [block.ffwd.net[0]]
        hw = an.head_weights("decoder", i)
        assert torch.equal(hw.W_K[3], block.attn.heads[3].key.weight.detach().T)
    assert an.final_norm is m.ln_f and an.unembed is m.lm_head


def _induction_blocks_as_written(m, an) -> None:
    """Every head's q, k and v block is the model's own split of its projections (models/induction.py)."""
    for i, block in enumerate(m.blocks):
        a, at = an.attention[("decoder", i, "self")], block.attn
        assert a.heads == at.n_head and a.norm is None
        for h in range(at.n_head):
            cols = slice(at.d_head * h, at.d_head * (h + 1))
            for role, mod in (("q", at.q), ("k", at.k), ("v", at.v)):
                got = getattr(a, role)[h]
                assert got.module is mod and got.cols == cols, (i, h, role, got)


def test_attention_only_model_has_no_norm_no_mlp_and_nothing_refused():
    torch.manual_seed(0)
    m = induction.build().eval()
    an = anatomy(m, "^ABCDABCD")
    _induction_blocks_as_written(m, an)
    assert not an.mlp and not an.refused
    assert an.final_norm is None and an.unembed is m.lm_head


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_heads_saturated_on_the_first_token_are_still_split(seed):
    """The trained induction model's layer-0 heads put nearly all their weight on the first token:
    a value or key perturbed at the middle position barely moves them (exactly nothing, once the
    softmax underflows). The check perturbs such blocks again, louder and at the first position,
    and finds every head's blocks where the model's code puts them."""
    m = models.load("induction")
    from models.induction import CHARS

    g = torch.Generator().manual_seed(seed)
    first = torch.randint(1, len(CHARS), (1, 20), generator=g)
    ids = torch.cat([torch.zeros(1, 1, dtype=torch.long), first, first[:, :8]], 1)
    an = anatomy(m, ids)
    assert not an.refused
    _induction_blocks_as_written(m, an)


def test_encoder_decoder_cross_attention_keys_read_the_encoders_final_norm():
    m = hf.t5(VOCAB)
    g = torch.Generator().manual_seed(0)
    x = {
        "input_ids": torch.randint(3, VOCAB, (1, 6), generator=g),
        "decoder_input_ids": torch.randint(3, VOCAB, (1, 5), generator=g),
    }
    an = anatomy(m, x)
    block = m.decoder.block[1]
    a = an.attention[("decoder", 1, "cross")]
    assert (
        a.q[0].module is block.layer[1].EncDecAttention.q
        and a.k[0].module is block.layer[1].EncDecAttention.k
    )
    assert a.norm is block.layer[1].layer_norm and a.kv_norm is m.encoder.final_layer_norm
    assert an.attention[("encoder", 0, "self")].norm is m.encoder.block[0].layer[0].layer_norm
    # T5 scales the last stream by d_model ** -0.5 outside any module: no read-out, said in one line
    assert "final norm" in an.refused[("readout",)]


def test_falcon_multi_query_and_post_norm_bert_like():
    m = A.ARCHS["falcon"].build()
    an = anatomy(m, A.inputs("falcon", m)["input_ids"][:1])
    a = an.attention[("decoder", 0, "self")]
    assert a.kv_heads == 1 and a.kv_of == [0, 0, 0, 0] and a.k[0].cols == slice(32, 40)
    m = A.ARCHS["roberta"].build()
    an = anatomy(m, A.inputs("roberta", m)["input_ids"][:1])
    a = an.attention[("encoder", 1, "self")]
    assert a.norm is None and a.delta == "stream difference"
    assert a.q[0].module is m.encoder.layer[1].attention.self.query


def test_refusals_are_one_line_and_raised_when_needed(gpt2):
    m, _ = gpt2
    an = anatomy(m, _ids(2))
    why = an.refused[("decoder", 0, "self")]
    assert "at least 3" in why and "\n" not in why
    with pytest.raises(ProbeError, match="at least 3"):
        an.head_weights("decoder", 0)
    with pytest.raises(ProbeError, match="not an attention"):
        gpt2[1].attn("decoder", 7)


def test_matrix_reads_linear_and_conv1d_as_x_at_w_plus_b(gpt2):
    m, an = gpt2
    x = torch.randn(5, 64)
    for mod in (m.transformer.h[0].attn.c_attn, m.lm_head):
        W, b = an.matrix(mod)
        with torch.no_grad():
            torch.testing.assert_close(x @ W + (b if b is not None else 0), mod(x), rtol=0, atol=1e-5)


def test_bloom_runs_the_whole_model_on_copies_where_its_layer_cannot_run_alone():
    # BLOOM hands each layer ALiBi as [batch * heads, 1, keys]: copies of one layer's arguments do
    # not fit, so the check runs the whole model on copies of the input (and stops after it)
    m = A.ARCHS["bloom"].build()
    an = anatomy(m, A.inputs("bloom", m)["input_ids"][:1])
    dh = 8
    for i, layer in enumerate(m.transformer.h):
        a = an.attention[("decoder", i, "self")]
        for h in range(4):  # query_key_value viewed as [head, (q, k, v), d_head]
            assert a.q[h].cols == slice(3 * h * dh, (3 * h + 1) * dh)
            assert a.v[h].cols == slice((3 * h + 2) * dh, (3 * h + 3) * dh)
        assert a.q[0].module is layer.self_attention.query_key_value and a.norm is layer.input_layernorm
    assert not an.refused


def test_vit_from_pictures_as_model_arguments():
    cfg = tf.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=(32, 48),
        patch_size=8,
    )
    torch.manual_seed(0)
    vit = tf.ViTForImageClassification(cfg).eval()
    an = anatomy(vit, {"pixel_values": torch.randn(2, 3, 32, 48)})  # the first picture is used
    layer = vit.vit.layers[1]
    a = an.attention[("encoder", 1, "self")]
    assert [b.module for b in a.k] == [layer.attention.k_proj] * 4 and a.k[3].cols == slice(24, 32)
    assert a.norm is layer.layernorm_before and an.mlp[("encoder", 1)].norm is layer.layernorm_after
    assert "readout" in str(list(an.refused))  # a classifier reads [CLS] only: no per-position read-out


def test_a_norm_over_the_whole_projection_is_refused_in_one_line():
    # OLMo 2 normalises q and k over all heads' channels at once: one head's block moves every head
    m = A.ARCHS["olmo2"].build()
    an = anatomy(m, A.inputs("olmo2", m)["input_ids"][:1])
    why = an.refused[("decoder", 0, "self")]
    assert "cannot be split per head" in why and "\n" not in why
    with pytest.raises(ProbeError, match="decoder layer 0 self: .*cannot be split per head"):
        an.head_weights("decoder", 0)


def test_value_blocks_whose_heads_barely_read_the_perturbed_position():
    # vit_zoo's layer-3 head 1 gives the middle patch of this picture a weight of about 1e-5: the
    # value check must see the change as a multiple of the delta through the float rounding
    from models import shapes

    vit = models.load("vit_zoo")
    pic = [shapes.to_pil(x) for x in shapes.generate(3, seed=0).images[:1]]
    an = anatomy(vit, pic, processor=vit.processor)
    for i, block in enumerate(vit.blocks):
        a = an.attention[("encoder", i, "self")]
        assert [b.cols for b in a.v] == [slice(128 + 16 * h, 144 + 16 * h) for h in range(4)]
        assert a.v[0].module is block.attn.qkv
