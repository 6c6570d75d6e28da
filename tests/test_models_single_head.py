"""models.single_head against the tutorial's own lines (000), replayed here as the oracle."""

import pytest
import torch
import torch.nn as nn
from torch.nn import functional as F

import models
from models import single_head


def tutorial():
    """Tutorial 000, line by line: returns (x, out, wei, (key, query, value))."""
    torch.manual_seed(1337)
    B, T, C = 4, 8, 32
    x = torch.randn(B, T, C)
    key = nn.Linear(C, 16, bias=False)
    query = nn.Linear(C, 16, bias=False)
    value = nn.Linear(C, 16, bias=False)
    k, q, v = key(x), query(x), value(x)
    wei = q @ k.transpose(-2, -1)
    tril = torch.tril(torch.ones(T, T))
    wei = wei.masked_fill(tril == 0, float("-inf"))
    wei = F.softmax(wei, dim=-1)
    return x, wei @ v, wei, (key, query, value)


@pytest.fixture(scope="module")
def expected():
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        return tutorial()


def test_example_input_is_the_tutorials_x(expected):
    assert torch.equal(single_head.example_input(), expected[0])


def test_weights_are_the_tutorials_seeded_init(expected):
    head = single_head.build()
    for mine, theirs in zip((head.key, head.query, head.value), expected[3], strict=True):
        assert torch.equal(mine.weight, theirs.weight)
        assert mine.bias is None


def test_forward_reproduces_the_tutorial(expected):
    x, out_expected, wei_expected, _ = expected
    with torch.no_grad():
        out, wei = single_head.build()(x)
    assert out.shape == (4, 8, 16) and wei.shape == (4, 8, 8)
    torch.testing.assert_close(wei, wei_expected)
    torch.testing.assert_close(out, out_expected)


def test_weights_are_causal(expected):
    with torch.no_grad():
        _, wei = single_head.build()(expected[0])
    future = torch.triu(torch.ones(8, 8, dtype=torch.bool), diagonal=1)
    assert (wei[:, future] == 0).all()
    torch.testing.assert_close(wei.sum(-1), torch.ones(4, 8))
    assert (wei[:, 0, 0] == 1).all()  # the first token can only read itself


def test_build_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    single_head.build()
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(3), after)


def test_load_gives_the_saved_seeded_head_in_eval_mode():
    head = models.load("single_head")
    assert not head.training
    assert head.name == "single_head" and head.context_length == 8
    assert head.is_encoder_decoder is False
    for name, tensor in single_head.build().state_dict().items():
        assert torch.equal(head.state_dict()[name], tensor)
    assert head.train_info["steps"] == 0 and head.train_info["final_loss"] is None


def test_its_tokenizer_refuses_text_and_says_what_to_pass():
    head = models.load("single_head")
    with pytest.raises(ValueError, match=r"float tensors of shape \(B, T, 32\)"):
        head.tokenizer.encode("hello")
    assert head.tokenizer.pad_id is None and head.tokenizer.vocab_size is None


def test_longer_than_the_mask_is_an_error():
    with pytest.raises(ValueError, match="9 positions"):
        single_head.build()(torch.randn(1, 9, 32))
