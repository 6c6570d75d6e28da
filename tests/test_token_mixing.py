"""probe.alti and probe.value_zeroing against loops written here.

ALTI (Ferrando et al. 2022): for every query ``i`` and key ``j`` the term ``T_i(x_j)`` is built
from Hugging Face eager attention's weights, the values computed from the model's own norm and
value projection, the heads' rows of the output projection and the residual ``x_i``; scored with
the L1 formula, rows normalised, rolled out by matrix products. Value zeroing (Mohebbi et al.
2023): one forward per token with a hook zeroing that token's values in one layer, ``1 - cos``
against the unchanged forward's hidden state. probe batches the copies, which round differently
from one forward at a time, and ``1 - cos`` of nearly equal vectors magnifies that: the
comparison allows 1e-4 on rows normalised to sum 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

sys.path.insert(0, str(Path(__file__).parent))

import hf_fixtures as hf  # noqa: E402

import probe  # noqa: E402
from probe.errors import ProbeError  # noqa: E402

VOCAB = 100


def _ids(b=2, n=7, seed=0):
    return torch.randint(3, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


def _alti_loop(x, alpha, head_out, b_O):
    """ALTI of one layer by loops: ``head_out(b, h, j)`` is what head h writes from key j."""
    B, H, T, _ = alpha.shape
    C = torch.zeros(B, T, T)
    for b in range(B):
        for i in range(T):
            terms = []
            for j in range(T):
                t = sum(alpha[b, h, i, j] * head_out(b, h, j) for h in range(H))
                terms.append(t + x[b, i] if i == j else t)
            y = sum(terms) + b_O
            for j in range(T):
                C[b, i, j] = max(0.0, (y.abs().sum() - (y - terms[j]).abs().sum()).item())
            C[b, i] /= C[b, i].sum()
    return C


def test_alti_gpt2_by_hand():
    m = hf.gpt2(VOCAB)
    ids = _ids()
    got = probe.alti(m, ids)
    out = hf.eager_twin(m)(ids, output_attentions=True, output_hidden_states=True)
    d, H = 64, 4
    dh = d // H
    rollout = None
    for layer, blk in enumerate(m.transformer.h):
        with torch.no_grad():
            x = out.hidden_states[layer]
            v = blk.ln_1(x) @ blk.attn.c_attn.weight[:, 2 * d :] + blk.attn.c_attn.bias[2 * d :]
            W = blk.attn.c_proj.weight

            def head_out(b, h, j, v=v, W=W):
                return v[b, j, h * dh : (h + 1) * dh] @ W[h * dh : (h + 1) * dh]

            C = _alti_loop(x, out.attentions[layer], head_out, blk.attn.c_proj.bias)
        torch.testing.assert_close(got.layer(layer), C, rtol=0, atol=1e-5)
        rollout = C if rollout is None else C @ rollout
    torch.testing.assert_close(got.rollout(), rollout, rtol=0, atol=1e-5)
    assert max(got.errors.values()) <= 1e-5
    assert any("MLP" in n for n in got.notes)


def test_alti_llama_gqa_by_hand():
    m = hf.llama(VOCAB)
    ids = _ids(b=1, n=6, seed=3)
    got = probe.alti(m, ids)
    out = hf.eager_twin(m)(ids, output_attentions=True, output_hidden_states=True)
    H, Hkv, dh = 8, 2, 8
    for layer, blk in enumerate(m.model.layers):
        with torch.no_grad():
            x = out.hidden_states[layer]
            v = blk.self_attn.v_proj(blk.input_layernorm(x))
            Wo = blk.self_attn.o_proj.weight

            def head_out(b, h, j, v=v, Wo=Wo):
                g = h // (H // Hkv)
                return v[b, j, g * dh : (g + 1) * dh] @ Wo[:, h * dh : (h + 1) * dh].T

            C = _alti_loop(x, out.attentions[layer], head_out, torch.zeros(64))
        torch.testing.assert_close(got.layer(layer), C, rtol=0, atol=1e-5)


def test_alti_table_and_padding():
    m = hf.gpt2(VOCAB)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # the second text left-padded by two
    got = probe.alti(m, {"input_ids": ids, "attention_mask": mask})
    R = got.rollout()
    assert torch.equal(R[1, :2], torch.eye(7)[:2])  # padding rows stay the identity
    assert float(R[1, 2:, :2].abs().max()) == 0.0  # and no real token takes from padding
    torch.testing.assert_close(R[1, 2:].sum(-1), torch.ones(5))
    t = got.table(batch=1, query=-1)
    assert [r["position"] for r in t] == list(range(5))
    assert sum(r["share"] for r in t) == pytest.approx(1.0, abs=1e-5)


def test_alti_refusals():
    torch.manual_seed(0)
    cfg = tf.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    bert = tf.BertModel(cfg).eval()
    with pytest.raises(ProbeError, match=r"probe has no ALTI for this model \(encoder/0/self: .*post-norm"):
        probe.alti(bert, torch.tensor([[1, 5, 7, 9, 2]]))
    t5 = hf.t5(VOCAB)
    src = {"input_ids": _ids(b=1, n=6), "decoder_input_ids": _ids(b=1, n=5, seed=1)}
    with pytest.raises(ProbeError, match="the model has stacks encoder, decoder; pass stack="):
        probe.alti(t5, src)
    with pytest.raises(ProbeError, match="cross-attention"):
        probe.alti(t5, src, stack="decoder")


def _zeroing_loop(m, ids, layer, v_module, cols):
    """Value zeroing of one layer, one token at a time: ``[B, T, T]``."""
    B, T = ids.shape
    with torch.no_grad():
        base = m(ids, output_hidden_states=True).hidden_states[layer + 1]
        C = torch.zeros(B, T, T)
        for j in range(T):

            def zero(mod, args, o, j=j):
                o = o.clone()
                o[:, j, cols] = 0
                return o

            h = v_module.register_forward_hook(zero)
            y = m(ids, output_hidden_states=True).hidden_states[layer + 1]
            h.remove()
            C[:, :, j] = 1 - F.cosine_similarity(base, y, dim=-1)
    return C / C.sum(-1, keepdim=True)


def test_value_zeroing_by_hand():
    gpt2, llama = hf.gpt2(VOCAB), hf.llama(VOCAB)
    ids = _ids()
    got = probe.value_zeroing(gpt2, ids, layers=[0, 1], batch_size=3)  # chunks of 2 tokens, one short
    assert got.layers == [0, 1]
    for layer in (0, 1):  # GPT-2's fused c_attn: only its value columns are zeroed
        want = _zeroing_loop(gpt2, ids, layer, gpt2.transformer.h[layer].attn.c_attn, slice(128, None))
        torch.testing.assert_close(got.layer(layer), want, rtol=0, atol=1e-4)
    got = probe.value_zeroing(llama, ids)
    for layer in (0, 1):
        want = _zeroing_loop(llama, ids, layer, llama.model.layers[layer].self_attn.v_proj, slice(None))
        torch.testing.assert_close(got.layer(layer), want, rtol=0, atol=1e-4)
    torch.testing.assert_close(got.rollout(), got.layer(1) @ got.layer(0))


def test_value_zeroing_refusals():
    m = hf.gpt2(VOCAB)
    with pytest.raises(ProbeError, match="batch_size: copies of the inputs per forward"):
        probe.value_zeroing(m, _ids(), batch_size=1)
    with pytest.raises(ProbeError, match="decoder layer 7 has no self-attention"):
        probe.value_zeroing(m, _ids(), layers=[7])
