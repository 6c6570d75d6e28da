"""models.translator against tutorial 004: "ich mochte ein bier" -> "i want a beer E".

The translator is trained once for this module (about 30 Adam steps), through `models.load`
with PROBE_CACHE_DIR pointing at a temporary directory, so the first-use path is what is tested.
"""

import contextlib
import io
import math

import pytest
import torch

import models
from models import translator
from models.translator import Config


@pytest.fixture(scope="module")
def first_use(tmp_path_factory):
    """(model, cache_dir, stderr) of the first models.load("translator") in an empty cache."""
    cache = tmp_path_factory.mktemp("probe-cache")
    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(stderr):
        mp.setenv("PROBE_CACHE_DIR", str(cache))
        model = models.load("translator")
    return model, cache, stderr.getvalue()


@pytest.fixture(scope="module")
def model(first_use):
    return first_use[0]


@pytest.fixture(scope="module")
def batch(model):
    return translator.make_batch(model.tokenizer)


def expected_parameters(c: Config) -> int:
    """The architecture, counted by hand: (trainable, frozen)."""
    linear = lambda n_in, n_out: n_in * n_out + n_out  # noqa: E731
    layer_norm = 2 * c.d_model
    mha = (
        2 * linear(c.d_model, c.n_heads * c.d_k)  # W_Q, W_K
        + linear(c.d_model, c.n_heads * c.d_v)  # W_V
        + linear(c.n_heads * c.d_v, c.d_model)  # linear
        + layer_norm
    )
    ffn = linear(c.d_model, c.d_ff) + linear(c.d_ff, c.d_model) + layer_norm  # 1x1 convs
    embeddings = (len(c.src_vocab) + len(c.tgt_vocab)) * c.d_model
    projection = c.d_model * len(c.tgt_vocab)  # no bias
    trainable = c.n_layers * (mha + ffn) + c.n_layers * (2 * mha + ffn) + embeddings + projection
    frozen = 2 * (c.max_len + 1) * c.d_model  # the two sinusoid tables
    return trainable, frozen


def test_parameter_count_follows_the_architecture(model):
    trainable, frozen = expected_parameters(model.config)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == trainable
    assert sum(p.numel() for p in model.parameters() if not p.requires_grad) == frozen
    assert trainable == 44_148_224  # ~44 M, ~176 MB of float32


def test_hyper_parameters_are_the_papers(model):
    c = model.config
    assert (c.d_model, c.d_ff, c.d_k, c.d_v, c.n_layers, c.n_heads) == (512, 2048, 64, 64, 6, 8)
    assert len(model.encoder.layers) == len(model.decoder.layers) == 6
    mha = model.encoder.layers[0].enc_self_attn
    assert mha.W_Q.bias is not None and mha.linear.bias is not None
    assert model.encoder.layers[0].pos_ffn.conv1.kernel_size == (1,)
    assert model.projection.bias is None


def test_first_use_trains_into_the_cache_dir_with_a_notice(first_use):
    model, cache, stderr = first_use
    path = cache / "models" / "translator.safetensors"
    assert [p.name for p in path.parent.iterdir()] == ["translator.safetensors"]  # no temp left
    notice = [line for line in stderr.splitlines() if line.startswith("probe:")]
    assert len(notice) == 1 and "translator" in notice[0] and str(path) in notice[0]
    assert "steps until loss" in stderr  # the progress bar
    # the notice says how big the checkpoint will be: the architecture's parameters in float32
    trainable, frozen = expected_parameters(model.config)
    size = 4 * (trainable + frozen)
    assert f"its {size / 1e6:.0f} MB checkpoint" in notice[0]
    assert size < path.stat().st_size < size + 100_000  # the file: tensors plus a small header
    # the bar ends full at the steps taken, whatever its expected length was
    steps = model.train_info["steps"]
    assert f"{steps}/{steps} [" in stderr.split("\r")[-1]


def test_training_stopped_at_the_tutorials_threshold(model):
    info = model.train_info
    assert info["final_loss"] < 1e-4
    assert 0 < info["steps"] < info["recipe"]["max_steps"]
    assert info["recipe"]["seed"] == 2026 and info["recipe"]["lr"] == 1e-4


def test_second_load_reads_the_cache_silently(first_use, monkeypatch, capsys):
    model, cache, _ = first_use
    monkeypatch.setenv("PROBE_CACHE_DIR", str(cache))
    again = models.load("translator")
    assert capsys.readouterr().err == ""
    assert not again.training
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


@pytest.mark.parametrize("source", ["ich mochte ein bier", "ich mochte ein bier P"])
def test_greedy_translation(model, source):
    assert model.translate(source) == "i want a beer E"


def test_teacher_forced_predictions_are_the_target(model, batch):
    enc_inputs, dec_inputs, target = batch
    with torch.no_grad():
        logits, *_ = model(enc_inputs, dec_inputs)
    assert logits.shape == (1, 5, 7)
    assert model.tokenizer.target.decode(logits[0].argmax(-1)) == "i want a beer E"
    loss = torch.nn.functional.cross_entropy(logits.view(-1, 7), target.view(-1), ignore_index=0)
    assert loss < 1e-3


def test_every_layer_returns_its_attention(model, batch):
    enc_inputs, dec_inputs, _ = batch
    with torch.no_grad():
        _, enc_self, dec_self, dec_enc = model(enc_inputs, dec_inputs)
    assert len(enc_self) == len(dec_self) == len(dec_enc) == 6
    assert all(a.shape == (1, 8, 5, 5) for a in enc_self + dec_self + dec_enc)
    for a in enc_self + dec_self + dec_enc:
        torch.testing.assert_close(a.sum(-1), torch.ones(1, 8, 5))


def test_source_pad_columns_are_exactly_zero(model, batch):
    enc_inputs, dec_inputs, _ = batch
    assert enc_inputs[0, 4] == 0  # "P"
    with torch.no_grad():
        _, enc_self, _, dec_enc = model(enc_inputs, dec_inputs)
    for a in enc_self + dec_enc:
        assert (a[..., 4] == 0).all()
        assert (a[..., :4] > 0).all()


def test_decoder_self_attention_is_causal(model, batch):
    enc_inputs, dec_inputs, _ = batch
    with torch.no_grad():
        _, _, dec_self, _ = model(enc_inputs, dec_inputs)
    future = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
    for a in dec_self:
        assert (a[..., future] == 0).all()
        assert (a[..., 0, 0] == 1).all()  # "S" can only read itself


def test_masks_match_the_tutorials():
    seq = torch.tensor([[1, 2, 3, 4, 0]])
    pad = translator.get_attn_pad_mask(seq, seq)
    assert pad.shape == (1, 5, 5) and pad[0].tolist() == [[False] * 4 + [True]] * 5
    sub = translator.get_attn_subsequent_mask(torch.tensor([[5, 1, 2, 3, 4]]))
    assert sub[0].int().tolist() == [
        [0, 1, 1, 1, 1],
        [0, 0, 1, 1, 1],
        [0, 0, 0, 1, 1],
        [0, 0, 0, 0, 1],
        [0, 0, 0, 0, 0],
    ]


def test_positions_are_real_and_pads_use_the_zero_row(model):
    assert translator.positions(torch.tensor([[1, 2, 3, 4, 0], [3, 4, 0, 0, 0]]), 16).tolist() == [
        [0, 1, 2, 3, 16],
        [0, 1, 16, 16, 16],
    ]
    table = model.encoder.pos_emb.weight
    assert table.shape == (17, 512) and not table.requires_grad
    assert (table[16] == 0).all()
    for pos, i in [(0, 0), (0, 1), (3, 0), (3, 1), (7, 100), (7, 101), (15, 511)]:
        angle = pos / 10000 ** (2 * (i // 2) / 512)
        want = math.sin(angle) if i % 2 == 0 else math.cos(angle)
        assert table[pos, i].item() == pytest.approx(want, abs=1e-6)


def test_a_trailing_pad_does_not_change_the_tokens_encoding(model):
    with torch.no_grad():
        padded, _ = model.encoder(torch.tensor([[1, 2, 3, 4, 0]]))
        plain, _ = model.encoder(torch.tensor([[1, 2, 3, 4]]))
    torch.testing.assert_close(padded[:, :4], plain, atol=1e-5, rtol=1e-5)


def test_common_attributes(model):
    assert model.name == "translator" and model.is_encoder_decoder is True
    assert model.context_length == model.encoder.pos_emb.weight.shape[0] - 1 == 16
    tok = model.tokenizer
    assert tok.pad_id == 0 and tok.vocab_size == 5 and tok.target.vocab_size == 7


def test_tokenizers_for_both_sides(model):
    tok = model.tokenizer
    assert tok.encode("ich mochte ein bier P") == [1, 2, 3, 4, 0]
    assert tok.tokenize("ich mochte ein bier") == ["ich", "mochte", "ein", "bier"]
    assert tok.target.encode("S i want a beer") == [5, 1, 2, 3, 4]
    assert tok.target.decode([1, 2, 3, 4, 6]) == "i want a beer E"
    with pytest.raises(ValueError, match=r"words not in the vocabulary: 'Wasser'"):
        tok.encode("ich mochte ein Wasser")
    with pytest.raises(ValueError, match=r"words not in the vocabulary: 'wine'"):
        tok.target.encode("S i want a wine")
    with pytest.raises(ValueError, match="empty text"):
        model.translate("")


def test_too_long_a_sentence_is_an_error(model):
    with pytest.raises(ValueError, match="source of 17 tokens"):
        model.translate(" ".join(["bier"] * 17))


def test_main_job_shows_every_model(first_use, monkeypatch, capsys):
    from models.__main__ import main

    monkeypatch.setenv("PROBE_CACHE_DIR", str(first_use[1]))  # reuse the trained translator
    assert main() == 0
    out = capsys.readouterr().out
    assert "ich mochte ein bier -> i want a beer E" in out
    assert "x (4, 8, 32) -> out (4, 8, 16), wei (4, 8, 8)" in out
    assert '160 characters sampled after "at"' in out
    assert "next-digit predictions for 3141592653" in out


def test_feed_forward_is_the_tutorials_two_conv1d(model):
    # the FFN applies its convs' weights with F.linear; oracle: the Conv1d modules themselves
    ffn = model.encoder.layers[2].pos_ffn
    x = torch.randn(2, 5, 512, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ffn.layer_norm(ffn.conv2(torch.relu(ffn.conv1(x.transpose(1, 2)))).transpose(1, 2) + x)
        torch.testing.assert_close(ffn(x), want, atol=1e-5, rtol=1e-5)


def test_training_optimizer_makes_adams_update():
    # the recipe's optimizer (fused where torch has it) against torch's default Adam loop
    torch.manual_seed(0)
    a = torch.nn.Linear(8, 4)
    b = torch.nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = translator._adam(a.parameters(), 1e-2), torch.optim.Adam(b.parameters(), lr=1e-2)
    x = torch.randn(3, 8)
    for _ in range(3):
        for m, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            m(x).square().sum().backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-6)
