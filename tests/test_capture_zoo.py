"""Capture on every zoo model, checked against the weights each model returns itself."""

from __future__ import annotations

import pytest
import torch

import models
import probe
from probe import ProbeError


@pytest.fixture(scope="module")
def zoo():
    return {name: models.load(name) for name in models.names()}


def test_single_head(zoo):
    from models.single_head import example_input

    model = zoo["single_head"]
    x = example_input()
    cache = probe.capture(model, x)
    with torch.no_grad():
        _, wei = model(x)
    assert cache.keys() == ["decoder.blocks.0.self_attn.pattern"]  # no residual stream here
    pattern = cache.pattern("decoder", 0)
    assert pattern.shape == (4, 1, 8, 8)
    torch.testing.assert_close(pattern[:, 0], wei, atol=1e-6, rtol=0)


def test_minigpt_patterns_and_residuals(zoo):
    gpt = zoo["minigpt"]
    text = "attention lets tokens read."
    cache = probe.capture(gpt, text)
    ids = torch.tensor([gpt.tokenizer.encode(text)])
    with torch.no_grad():
        x = gpt.token_embedding_table(ids) + gpt.position_embedding_table(torch.arange(ids.shape[1]))
        for layer, block in enumerate(gpt.blocks):
            _, weights = block.attn(block.ln1(x), return_weights=True)
            torch.testing.assert_close(cache.pattern("decoder", layer), weights, atol=1e-6, rtol=0)
            torch.testing.assert_close(cache[f"decoder.blocks.{layer}.resid_pre"], x, atol=0, rtol=0)
            x = block(x)
            torch.testing.assert_close(cache[f"decoder.blocks.{layer}.resid_post"], x, atol=0, rtol=0)
    assert cache.tokens == [list(text)]
    assert cache.metadata["model"]["name"] == "minigpt"


def test_fused_decoder(zoo):
    model = zoo["fused_decoder"]
    cache = probe.capture(model, "3141592653")
    ids = torch.tensor([model.tokenizer.encode("3141592653")])
    with torch.no_grad():
        logits, attn = model(ids)
    torch.testing.assert_close(cache.pattern("decoder", 0), attn, atol=1e-6, rtol=0)
    pre = cache["decoder.blocks.0.resid_pre"]
    torch.testing.assert_close(
        pre + cache["decoder.blocks.0.self_attn.delta"],
        cache["decoder.blocks.0.resid_post"],
        atol=1e-6,
        rtol=0,
    )


def test_translator_greedy_and_teacher_forced(zoo):
    model = zoo["translator"]
    cache = probe.capture(model, "ich mochte ein bier")
    assert cache.metadata["target_tokens"] == [["S", "i", "want", "a", "beer"]]
    assert cache.metadata["target_source"] == "greedy"
    forced = probe.capture(model, "ich mochte ein bier", target="S i want a beer")
    src = torch.tensor([model.tokenizer.encode("ich mochte ein bier")])
    tgt = torch.tensor([model.tokenizer.target.encode("S i want a beer")])
    with torch.no_grad():
        _, enc, dec, cross = model(src, tgt)
    assert forced.stacks == ["encoder", "decoder"]
    for layer in range(6):
        for c in (cache, forced):
            torch.testing.assert_close(c.pattern("encoder", layer), enc[layer], atol=1e-6, rtol=0)
            torch.testing.assert_close(c.pattern("decoder", layer), dec[layer], atol=1e-6, rtol=0)
            torch.testing.assert_close(c.pattern("decoder", layer, "cross"), cross[layer], atol=1e-6, rtol=0)
        for stack, parts in (
            ("encoder", ("self_attn", "mlp")),
            ("decoder", ("self_attn", "cross_attn", "mlp")),
        ):
            pre = forced[f"{stack}.blocks.{layer}.resid_pre"]
            total = pre + sum(forced[f"{stack}.blocks.{layer}.{p}.delta"] for p in parts)
            torch.testing.assert_close(total, forced[f"{stack}.blocks.{layer}.resid_post"], atol=1e-5, rtol=0)
            if layer < 5:
                assert torch.equal(
                    forced[f"{stack}.blocks.{layer}.resid_post"],
                    forced[f"{stack}.blocks.{layer + 1}.resid_pre"],
                )


def test_translator_padded_batch_matches_single_texts(zoo):
    model = zoo["translator"]
    texts = ["ich mochte ein bier", "ich mochte"]
    targets = ["S i want a beer", "S i want"]
    batch = probe.capture(model, texts, target=targets)
    assert batch.metadata["attention_mask"] == [[1, 1, 1, 1], [1, 1, 0, 0]]
    for i, (t, g) in enumerate(zip(texts, targets, strict=True)):
        alone = probe.capture(model, t, target=g)
        n, m = len(t.split()), len(g.split())
        for layer in range(6):
            torch.testing.assert_close(
                batch.pattern("encoder", layer)[i, :, :n, :n],
                alone.pattern("encoder", layer)[0],
                atol=1e-5,
                rtol=0,
            )
            torch.testing.assert_close(
                batch.pattern("decoder", layer, "cross")[i, :, :m, :n],
                alone.pattern("decoder", layer, "cross")[0],
                atol=1e-5,
                rtol=0,
            )
            assert torch.all(batch.pattern("encoder", layer)[i, :, :, n:] == 0)  # pads never read


def test_minigpt_batch_of_texts_is_right_padded(zoo):
    gpt = zoo["minigpt"]
    cache = probe.capture(gpt, ["attention", "at"])
    assert cache.metadata["attention_mask"][1] == [1, 1] + [0] * 7
    alone = probe.capture(gpt, "at")
    torch.testing.assert_close(
        cache.pattern("decoder", 1)[1, :, :2, :2], alone.pattern("decoder", 1)[0], atol=1e-6, rtol=0
    )


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("minigpt", "", "empty text"),
        ("minigpt", "   ", "empty text"),
        ("minigpt", "a" * 33, "accepts at most 32"),
        ("minigpt", "Zebra 中文", "'Z'"),
        ("translator", "ich trinke bier", "trinke"),
        ("fused_decoder", "31x4", "x"),
    ],
)
def test_bad_text_is_a_clear_error(zoo, name, text, message):
    with pytest.raises(ProbeError, match=message):
        probe.capture(zoo[name], text)


def test_target_only_for_encoder_decoders(zoo):
    with pytest.raises(ProbeError, match="not an encoder-decoder"):
        probe.capture(zoo["minigpt"], "at", target="at")
    with pytest.raises(ProbeError, match="one target per text"):
        probe.capture(zoo["translator"], ["ich", "bier"], target="S i")
