"""models.minigpt against tutorial 001's numbers: 104,598 parameters, loss < 0.1 in 200 steps."""

import pytest
import torch
import torch.nn as nn

import models
from models import minigpt

PHRASES = (
    "graph neural networks pass messages.",
    "attention lets tokens read context.",
    "transformers use self attention.",
)


@pytest.fixture(scope="module")
def trained():
    return minigpt.train(steps=200)  # the tutorial's recipe, run for real: (model, stats)


def test_corpus_and_vocabulary_are_the_tutorials():
    assert len(minigpt.CORPUS) == 8480
    assert minigpt.CHARS == " .acdefghiklmnoprstuwx"
    tok = minigpt.tokenizer()
    assert tok.vocab_size == 22
    assert tok.encode("attention") == [2, 18, 18, 5, 13, 18, 9, 14, 13]
    assert tok.decode(tok.encode(minigpt.CORPUS)) == minigpt.CORPUS


def test_parameter_count_is_the_tutorials():
    assert sum(p.numel() for p in minigpt.build().parameters()) == 104_598


def test_architecture_reads_like_the_tutorial():
    model = minigpt.build()
    assert isinstance(model.blocks, nn.Sequential) and len(model.blocks) == 2
    heads = model.blocks[0].attn.heads
    assert isinstance(heads, nn.ModuleList) and len(heads) == 4
    for lin in (heads[0].key, heads[0].query, heads[0].value):
        assert lin.bias is None and lin.weight.shape == (16, 64)
    assert heads[0].tril.shape == (32, 32)
    assert [type(m) for m in model.blocks[0].ffwd.net] == [nn.Linear, nn.ReLU, nn.Linear]


def test_each_head_returns_causal_weights():
    model = minigpt.build().eval()
    idx = torch.tensor([model.tokenizer.encode("attention lets tokens")])
    x = model.token_embedding_table(idx) + model.position_embedding_table(torch.arange(21))
    with torch.no_grad():
        out, weights = model.blocks[0].attn.heads[0](model.blocks[0].ln1(x))
        _, all_heads = model.blocks[0].attn(x, return_weights=True)
    assert out.shape == (1, 21, 16) and weights.shape == (1, 21, 21)
    assert all_heads.shape == (1, 4, 21, 21)
    future = torch.triu(torch.ones(21, 21, dtype=torch.bool), diagonal=1)
    assert (weights[0][future] == 0).all() and (all_heads[..., future] == 0).all()
    torch.testing.assert_close(all_heads.sum(-1), torch.ones(1, 4, 21))


def test_batches_are_windows_and_their_next_characters():
    data = torch.arange(100)
    x, y = minigpt.get_batch(data, 32, 54, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (54, 32)
    assert torch.equal(y, x + 1)  # on 0..99 "the next character" is "plus one"


@pytest.mark.slow
def test_recipe_reaches_the_tutorials_loss_in_200_steps(trained):
    model, stats = trained
    assert stats.steps == 200 and len(stats.losses) == 200
    assert stats.losses[0] > 2.5  # starts near ln(22) = 3.09
    assert stats.final_loss < 0.1


@pytest.mark.slow
def test_sampling_from_at_recites_the_corpus(trained):
    text = trained[0].generate_text("at", 160)
    assert len(text) == 162 and text.startswith("at")
    assert any(phrase in text for phrase in PHRASES)


def test_sampling_is_reproducible_with_a_generator():
    model = models.load("minigpt")
    idx = torch.tensor([model.tokenizer.encode("at")])
    runs = [model.generate(idx, 40, generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert runs[0].shape == (1, 42) and torch.equal(runs[0], runs[1])


def test_training_is_deterministic():
    first, _ = minigpt.train(steps=15)
    second, _ = minigpt.train(steps=15)
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name]), name


def test_shipped_checkpoint_is_trained_and_recites_the_corpus():
    model = models.load("minigpt")
    assert not model.training
    assert model.name == "minigpt" and model.context_length == 32
    assert model.is_encoder_decoder is False and model.tokenizer.pad_id is None
    assert model.train_info["steps"] == 200 and model.train_info["final_loss"] < 0.1
    assert any(phrase in model.generate_text("at", 160) for phrase in PHRASES)


def test_context_longer_than_block_size_is_an_error():
    with pytest.raises(ValueError, match="33 tokens"):
        minigpt.build()(torch.zeros(1, 33, dtype=torch.long))


def test_out_of_vocabulary_prompt_names_the_characters():
    with pytest.raises(ValueError, match=r"characters not in the vocabulary: 'Z', '中'"):
        models.load("minigpt").generate_text("aZ中")
