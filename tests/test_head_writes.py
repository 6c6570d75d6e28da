"""probe.head_writes: each head's write, against the models' own computation.

Oracles: the attention module's own output (a forward hook on the module the model's source names:
GPT-2's ``attn``, Llama's ``self_attn``, T5's ``SelfAttention``/``EncDecAttention``, ViT's
``attention``, GPT-NeoX's fused-QKV ``attention``), which the heads' writes plus the bias must sum
to (<= 1e-5 relative); and one write computed by hand from Hugging Face's eager GPT-2: the pattern
it returns times the head's values (``c_attn`` applied to ``ln_1`` of the stream it returns),
times the head's rows of ``c_proj``.
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
import toys  # noqa: E402

import probe  # noqa: E402
from probe.errors import ProbeError  # noqa: E402

VOCAB = 100


def _ids(b=2, n=7, seed=0):
    return torch.randint(3, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


def _outputs(model, paths, run):
    """The first tensor each module at ``paths`` returns in ``run()`` (a forward hook: the oracle)."""
    got = {}

    def keep(path):
        def hook(mod, args, out):
            got[path] = (out[0] if isinstance(out, tuple) else out).detach()

        return hook

    handles = [model.get_submodule(p).register_forward_hook(keep(p)) for p in paths]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return got


def _assert_sums(hw, model, run, keys):
    """Sum over heads + bias == the attention module's output, for every ``(key, module path)``."""
    got = _outputs(model, [p for _, p in keys], run)
    for (stack, layer, role), path in keys:
        total = hw.total(layer, stack=stack, role=role)
        want = got[path].float().reshape(total.shape)
        err = (total - want).abs().max() / want.abs().max()
        assert err <= 1e-5, (stack, layer, role, err.item())


def test_gpt2_one_write_by_hand_from_eager_attention():
    m = hf.gpt2(VOCAB)
    ids = _ids()
    hw = probe.head_writes(m, ids)
    out = hf.eager_twin(m)(ids, output_attentions=True, output_hidden_states=True)
    dh = 16
    for layer in (0, 2):
        block = m.transformer.h[layer].attn
        with torch.no_grad():
            x = m.transformer.h[layer].ln_1(out.hidden_states[layer])
            v = x @ block.c_attn.weight[:, 128:] + block.c_attn.bias[128:]  # [q | k | v]: v is last
            for h in range(4):
                z = out.attentions[layer][:, h] @ v[..., h * dh : (h + 1) * dh]
                want = z @ block.c_proj.weight[h * dh : (h + 1) * dh]
                torch.testing.assert_close(hw.write(layer, h), want, rtol=0, atol=1e-5)
    paths = [(("decoder", i, "self"), f"transformer.h.{i}.attn") for i in range(3)]
    _assert_sums(hw, m, lambda: m(ids), paths)


def test_llama_gqa_writes_sum_to_self_attn_output():
    m = hf.llama(VOCAB)
    ids = _ids()
    hw = probe.head_writes(m, ids)
    assert hw.write(1).shape == (2, 8, 7, 64)
    assert torch.equal(hw.bias[("decoder", 0, "self")], torch.zeros(64))  # o_proj has no bias
    _assert_sums(
        hw, m, lambda: m(ids), [(("decoder", i, "self"), f"model.layers.{i}.self_attn") for i in range(2)]
    )


def test_encoder_decoder_self_and_cross_attention():
    m = hf.t5(VOCAB)
    g = torch.Generator().manual_seed(0)
    x = {
        "input_ids": torch.randint(3, VOCAB, (2, 6), generator=g),
        "decoder_input_ids": torch.randint(3, VOCAB, (2, 5), generator=g),
    }
    hw = probe.head_writes(m, x)
    keys = [(("encoder", i, "self"), f"encoder.block.{i}.layer.0.SelfAttention") for i in range(3)]
    keys += [(("decoder", i, "self"), f"decoder.block.{i}.layer.0.SelfAttention") for i in range(3)]
    keys += [(("decoder", i, "cross"), f"decoder.block.{i}.layer.1.EncDecAttention") for i in range(3)]
    _assert_sums(hw, m, lambda: m(**x), keys)
    assert hw.write(1, stack="decoder", role="cross").shape == (2, 4, 5, 64)


def test_vit_and_a_fused_qkv_model():
    cfg = tf.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=(32, 48),
        patch_size=8,
    )
    torch.manual_seed(0)
    vit = tf.ViTModel(cfg).eval()
    x = {"pixel_values": torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(1))}
    hw = probe.head_writes(vit, x)
    assert hw.write(0).shape == (2, 4, 25, 32)  # [CLS] + 4 x 6 patches
    _assert_sums(
        hw, vit, lambda: vit(**x), [(("encoder", i, "self"), f"layers.{i}.attention") for i in range(2)]
    )
    neox = hf.neox(VOCAB)  # query_key_value: [head, (q, k, v), d_head] in one Linear
    ids = _ids()
    hw = probe.head_writes(neox, ids)
    _assert_sums(
        hw,
        neox,
        lambda: neox(ids),
        [(("decoder", i, "self"), f"gpt_neox.layers.{i}.attention") for i in range(2)],
    )


def test_check_table_and_selection():
    m = hf.gpt2(VOCAB)
    hw = probe.head_writes(m, _ids(), layers=[1])
    assert list(hw.writes) == [("decoder", 1, "self")]
    check = hw.check()
    assert check.column("layer") == [1] and check.column("rel_error")[0] <= 1e-5
    t = hw.table()
    assert len(t) == 4 and abs(sum(t.column("share")) - 1) < 1e-6
    n = hw.norms(1)  # [batch, heads, pos]
    assert t.column("mean_norm")[2] == pytest.approx(n[:, 2].mean().item(), rel=1e-5)
    with pytest.raises(ProbeError, match="kept"):
        hw.write(0)
    with pytest.raises(ProbeError, match="4 heads"):
        hw.write(1, 4)
    with pytest.raises(ProbeError, match="selects no attention"):
        probe.head_writes(m, _ids(), layers=[9])


def test_padding_is_left_out_of_the_table():
    m = hf.gpt2(VOCAB)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    hw = probe.head_writes(m, {"input_ids": ids, "attention_mask": mask})
    n = hw.norms(0)
    real = torch.cat([n[0], n[1, :, :5]], dim=-1)  # [heads, real positions]
    assert hw.table().column("mean_norm")[1] == pytest.approx(real[1].mean().item(), rel=1e-5)


def test_refusals_in_one_line():
    post = A.ARCHS["roberta"].build()
    with pytest.raises(ProbeError, match="post-norm") as e:
        probe.head_writes(post, A.inputs("roberta", post))
    assert "\n" not in str(e.value)
    sandwich = A.ARCHS["gemma2"].build()  # a norm after the attention, before the stream
    with pytest.raises(ProbeError, match="not the recorded delta"):
        probe.head_writes(sandwich, A.inputs("gemma2", sandwich))
    torch.manual_seed(0)
    fused = toys.ToyLM(kind="mha").eval()  # nn.MultiheadAttention: no output projection module to split
    with pytest.raises(ProbeError, match="decoder layer 0 self-attention: .*fused kernel"):
        probe.head_writes(fused, torch.randint(0, 40, (1, 6)))
