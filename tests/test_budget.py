"""probe.budget: parameters by role and layer, against sum(p.numel()), shapes from the configs, and
the tutorial's GPT-3 table (built on the meta device)."""

from __future__ import annotations

import subprocess
import sys

import hf_fixtures as H
import pytest
import torch
from torch import nn

import models
import probe


def _numel(model):
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


def test_minigpt_104598_broken_down():
    model = models.load("minigpt")
    c = model.config
    b = probe.budget(model)
    assert b.total == _numel(model) == 104_598
    d, hs, L, V = c.n_embd, c.n_embd // c.n_head, c.n_layer, c.vocab_size
    expect = {
        "token embedding": V * d,
        "position embedding": c.block_size * d,
        "W_Q": L * c.n_head * d * hs,
        "W_K": L * c.n_head * d * hs,
        "W_V": L * c.n_head * d * hs,
        "W_O": L * d * d,
        "MLP up": L * d * 4 * d,
        "MLP down": L * 4 * d * d,
        "norms": (2 * L + 1) * 2 * d,
        "biases": L * (d + 4 * d + d) + V,  # proj, up, down per layer; lm_head
        "unembedding": d * V,
        "other": 0,
    }
    assert {r["role"]: r["parameters"] for r in b.by_role} == expect
    layer0 = next(r for r in b.by_layer if r["layer"] == 0)
    assert layer0["total"] == 4 * d * d + 8 * d * d + 6 * d + 4 * d  # matrices, biases, two norms
    assert b.journey == [
        ("token id", 1),
        ("embedding", 64),
        ("attention", 64),
        ("MLP up", 256),
        ("MLP down", 64),
        ("unembedding", 22),
    ]


def test_translator_44165632_broken_down():
    model = models.load("translator")
    c = model.config
    b = probe.budget(model)
    assert b.total == _numel(model) == 44_165_632
    d, L = c.d_model, c.n_layers
    attns = L + 2 * L  # encoder self; decoder self and cross
    assert b.role("W_Q") == b.role("W_K") == b.role("W_V") == attns * d * c.d_k * c.n_heads
    assert b.role("W_O") == attns * c.n_heads * c.d_v * d
    assert b.role("MLP up") == b.role("MLP down") == 2 * L * d * c.d_ff
    assert b.role("token embedding") == (len(c.src_vocab) + len(c.tgt_vocab)) * d
    assert b.role("position embedding") == 2 * (c.max_len + 1) * d  # the frozen sinusoid tables
    assert b.role("unembedding") == d * len(c.tgt_vocab)
    assert b.role("norms") == (attns + 2 * L) * 2 * d
    assert {r["stack"] for r in b.by_layer if r["layer"] != ""} == {"encoder.layers", "decoder.layers"}


def test_fused_decoder_single_block_and_fused_qkv():
    model = models.load("fused_decoder")
    b = probe.budget(model)
    e = model.config.emb_size
    assert b.total == _numel(model)
    assert b.role("W_Q") == b.role("W_K") == b.role("W_V") == b.role("W_O") == e * e


def test_hf_gpt2_tied_embedding_counted_once(tmp_path):
    model = H.gpt2(100)
    assert model.lm_head.weight is model.transformer.wte.weight  # the oracle: one tensor, two roles
    b = probe.budget(model)
    assert b.total == _numel(model)
    assert b.total < sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert b.role("unembedding") == 0 and b.role("token embedding") == 100 * 64
    tied = [r for r in b.params if r["tied"]]
    assert [(r["name"], r["tied"]) for r in tied] == [("transformer.wte.weight", "lm_head.weight")]
    assert b.tied_to == {"unembedding": "token embedding"}  # marked where a reader looks for it
    line = next(x for x in b.to_text().splitlines() if x.strip().startswith("unembedding"))
    assert line.split()[1] == "0" and "tied: the token embedding" in line
    assert b.journey[-1] == ("unembedding", 100)  # the tied matrix still reads out the vocabulary
    assert b.role("W_Q") == 3 * 64 * 64 and b.role("MLP up") == 3 * 64 * 256


def test_hf_llama_grouped_query_attention():
    model = H.llama(100)
    b = probe.budget(model)
    c = model.config
    hd = c.hidden_size // c.num_attention_heads
    L = c.num_hidden_layers
    assert b.total == _numel(model)
    assert b.role("W_K") == b.role("W_V") == L * c.hidden_size * c.num_key_value_heads * hd
    assert b.role("W_Q") == b.role("W_O") == L * c.hidden_size**2
    assert b.role("MLP up") == L * 2 * c.hidden_size * c.intermediate_size  # gate and up
    assert b.role("MLP down") == L * c.intermediate_size * c.hidden_size
    assert b.role("unembedding") == c.vocab_size * c.hidden_size  # untied here


def test_torch_multihead_attention_in_proj_split():
    d, L = 32, 3
    model = nn.Sequential(
        nn.Embedding(50, d),
        nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, 4, 64, batch_first=True), L, enable_nested_tensor=False
        ),
    )
    b = probe.budget(model)
    assert b.total == _numel(model)
    assert b.role("W_Q") == b.role("W_K") == b.role("W_V") == b.role("W_O") == L * d * d
    assert b.role("MLP up") == b.role("MLP down") == L * d * 64
    assert b.role("biases") == L * (3 * d + d + 64 + d)


def test_config_file_on_meta_device(tmp_path):
    import transformers as tf

    cfg = tf.GPT2Config(vocab_size=300, n_positions=32, n_embd=48, n_layer=2, n_head=4)
    cfg.save_pretrained(tmp_path)
    b = probe.budget(tmp_path / "config.json")
    with torch.device("cpu"):
        real = tf.GPT2LMHeadModel(cfg)
    assert b.total == _numel(real)
    with pytest.raises(probe.ProbeError, match="no config file"):
        probe.budget(tmp_path / "nope.json")
    with pytest.raises(probe.ProbeError, match="takes a model"):
        probe.budget(3)


# the tutorial's table: 96 layers, d_model 12,288, 96 heads of 128, d_ff 49,152, vocabulary 50,257
GPT3 = {
    "token embedding": 617_558_016,
    "W_Q": 14_495_514_624,
    "W_K": 14_495_514_624,
    "W_V": 14_495_514_624,
    "W_O": 14_495_514_624,
    "MLP up": 57_982_058_496,
    "MLP down": 57_982_058_496,
    "unembedding": 617_558_016,
}


def test_gpt3_table_exactly():
    # the oracle, from the shapes: 50,257 × 12,288; 96 layers × 96 heads × 128 × 12,288; 96 × 12,288 × 49,152
    assert GPT3["token embedding"] == 50_257 * 12_288
    assert GPT3["W_Q"] == 96 * 96 * 128 * 12_288
    assert GPT3["MLP up"] == 96 * 12_288 * 49_152
    b = probe.budget("gpt3")
    assert {r: b.role(r) for r in GPT3} == GPT3
    assert b.matrices == sum(GPT3.values()) == 175_181_291_520
    # on top: position embedding 2,048 × 12,288; per layer the biases (3d + d + 4d + d) and two
    # LayerNorms (2 × 2d); the final LayerNorm (2d)
    d = 12_288
    assert b.role("position embedding") == 2048 * d == 25_165_824
    assert b.role("biases") == 96 * (3 * d + d + 4 * d + d) == 10_616_832
    assert b.role("norms") == 96 * 4 * d + 2 * d == 4_743_168
    assert b.role("other") == 0
    assert b.total == 175_181_291_520 + 25_165_824 + 10_616_832 + 4_743_168
    assert [n for _, n in b.journey] == [1, 12_288, 12_288, 49_152, 12_288, 50_257]
    assert b.name.startswith("GPT-3")


@pytest.mark.slow  # about 14 s on two cores: CI's slow job runs it (the default pytest keeps to ~15 min)
def test_cli_budget(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "probe", "budget", *args], capture_output=True, text=True, timeout=300
        )

    r = run("--model", "minigpt", "--layers", "--csv", str(tmp_path / "b.csv"))
    assert r.returncode == 0, r.stderr
    assert "104,598" in r.stdout and "MLP down" in r.stdout
    assert (tmp_path / "b.csv").read_text().startswith("role,parameters,share")
    r = run("--config", "gpt3")
    assert r.returncode == 0, r.stderr
    assert "175,181,291,520" in r.stdout and "14,495,514,624" in r.stdout
    r = run("--config", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "no config file" in r.stderr and "Traceback" not in r.stderr
