"""Hugging Face models under their default attention (sdpa) and eager: parity with the library's
own ``output_attentions``, bit-identical outputs, residual invariants, padding, tokens."""

from __future__ import annotations

import subprocess
import sys

import hf_fixtures as H
import pytest
import torch

import probe

TEXTS = ["attention lets tokens read context.", "the model is reading"]
TARGETS = ["i want a beer.", "ich mochte ein bier."]
ENC_DEC = {"bart", "t5", "marian"}
NAMES = ["minilm", "gpt2", "llama", "bart", "t5", "marian"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {"bpe": H.bpe_tokenizer(root / "bpe"), "sp": H.sentencepiece_tokenizer(root / "sp")}


@pytest.fixture(scope="module")
def hf(tokenizers):
    bpe, sp = tokenizers["bpe"], tokenizers["sp"]
    bert, fast, _slow = H.minilm()
    return {
        "minilm": (bert, fast),
        "gpt2": (H.gpt2(len(bpe)), bpe),
        "llama": (H.llama(len(bpe)), bpe),
        "bart": (H.bart(len(bpe)), bpe),
        "t5": (H.t5(len(sp)), sp),
        "marian": (H.marian(len(sp)), sp),
    }


def encode(tok, texts, targets=None, side="right"):
    """The inputs the library itself would use: its tokenizer's own padding and labels."""
    old = tok.padding_side
    tok.padding_side = side
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    try:
        enc = dict(tok(texts, padding=True, return_tensors="pt"))
    finally:
        tok.padding_side = old
    enc.pop("token_type_ids", None)
    return enc


def decoder_inputs(model, tok, targets):
    labels = tok(text_target=targets, padding=True, return_tensors="pt")
    start = model.config.decoder_start_token_id
    ids = torch.cat([torch.full((len(targets), 1), start), labels["input_ids"][:, :-1]], dim=1)
    mask = torch.cat([torch.ones(len(targets), 1, dtype=torch.long), labels["attention_mask"][:, :-1]], dim=1)
    return {"decoder_input_ids": ids, "decoder_attention_mask": mask}


def attentions(out, enc_dec):
    if enc_dec:
        return {
            ("encoder", "self"): out.encoder_attentions,
            ("decoder", "self"): out.decoder_attentions,
            ("decoder", "cross"): out.cross_attentions,
        }
    return {None: out.attentions}


def check_residuals(cache):
    for stack in cache.stacks:
        for layer in range(cache.n_layers(stack)):
            pre = cache[f"{stack}.blocks.{layer}.resid_pre"]
            deltas = [
                k for k in cache.keys() if k.startswith(f"{stack}.blocks.{layer}.") and k.endswith("delta")
            ]
            assert len(deltas) == (3 if stack == "decoder" and "cross" in " ".join(deltas) else 2)
            total = pre + sum(cache[k] for k in deltas)
            post = cache[f"{stack}.blocks.{layer}.resid_post"]
            torch.testing.assert_close(total, post, atol=1e-5, rtol=1e-5)
            if layer + 1 < cache.n_layers(stack):
                assert torch.equal(post, cache[f"{stack}.blocks.{layer + 1}.resid_pre"])


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", NAMES)
def test_patterns_match_eager_output_attentions(hf, name, impl):
    model, tok = hf[name]
    enc_dec = name in ENC_DEC
    assert model.config._attn_implementation == "sdpa"  # the library's default
    m = model if impl == "sdpa" else H.eager_twin(model)
    kwargs = encode(tok, TEXTS)
    if enc_dec:
        kwargs.update(decoder_inputs(model, tok, TARGETS))
    with torch.no_grad():
        plain = m(**kwargs)
        with probe.trace(m) as t:
            traced = m(**kwargs)
        oracle = H.eager_twin(model)(**kwargs, output_attentions=True)
    first = "logits" if hasattr(plain, "logits") else "last_hidden_state"
    assert torch.equal(getattr(plain, first), getattr(traced, first)), "capture changed the outputs"
    cache = t.cache
    assert cache.metadata["attention_implementations"] == (["sdpa"] if impl == "sdpa" else ["softmax"])
    expected = attentions(oracle, enc_dec)
    if not enc_dec:
        stack = "encoder" if name == "minilm" else "decoder"
        expected = {(stack, "self"): expected[None]}
    assert cache.stacks == sorted({s for s, _ in expected}, key=["encoder", "decoder"].index)
    for (stack, kind), layers in expected.items():
        assert cache.n_layers(stack) == len(layers)
        for i, e in enumerate(layers):
            torch.testing.assert_close(cache.pattern(stack, i, kind), e, atol=1e-5, rtol=0)
    check_residuals(cache)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", NAMES)
def test_padded_batch_matches_each_text_alone(hf, name, side):
    model, tok = hf[name]
    enc_dec = name in ENC_DEC
    old = tok.padding_side
    tok.padding_side = side
    try:
        batch = probe.capture(model, TEXTS, tokenizer=tok, target=TARGETS if enc_dec else None)
        alone = [
            probe.capture(model, t, tokenizer=tok, target=g if enc_dec else None)
            for t, g in zip(TEXTS, TARGETS, strict=True)
        ]
    finally:
        tok.padding_side = old
    # models without position_ids (BART, T5, Marian) are padded on the right, where positions hold
    assert batch.metadata["padding_side"] == ("right" if enc_dec else side)
    assert ("padding_note" in batch.metadata) == (enc_dec and side == "left")
    for i, single in enumerate(alone):
        src = torch.tensor(batch.metadata["attention_mask"][i], dtype=torch.bool)
        tgt = torch.tensor(batch.metadata["target_attention_mask"][i], dtype=torch.bool) if enc_dec else src
        assert single.tokens[0] == batch.tokens[i] and len(batch.tokens[i]) == int(src.sum())
        for stack in batch.stacks:
            kinds = ["self", "cross"] if stack == "decoder" and enc_dec else ["self"]
            for layer in range(batch.n_layers(stack)):
                for kind in kinds:
                    q = tgt if stack == "decoder" and enc_dec else src
                    k = src if stack == "encoder" or kind == "cross" else q
                    got = batch.pattern(stack, layer, kind)[i][:, q][:, :, k]
                    torch.testing.assert_close(got, single.pattern(stack, layer, kind)[0], atol=1e-5, rtol=0)
                    assert torch.all(batch.pattern(stack, layer, kind)[i][:, q][:, :, ~k] == 0), "pads leak"


def test_tokens_are_what_a_person_reads(hf, tokenizers):
    gpt2, bpe = hf["gpt2"]
    cache = probe.capture(gpt2, "the model is reading 注意力", tokenizer=bpe)
    tokens = cache.tokens[0]
    assert tokens[:4] == ["the", " model", " is", " reading"]  # Ġ shown as the space it is
    assert "".join(tokens) == "the model is reading 注意力"
    assert not any("Ġ" in t or "\ufffd" in t for t in tokens)
    bert, fast, slow = H.minilm()
    cf = probe.capture(bert, "tokenization 注意", tokenizer=fast)
    cs = probe.capture(bert, "tokenization 注意", tokenizer=slow)
    assert cf.metadata["ids"] == cs.metadata["ids"]
    assert "##ization" in cf.tokens[0] and cf.tokens[0][0] == "[CLS]"
    assert cf.tokens[0][1:3] == cs.tokens[0][1:3] == ["token", "##ization"]
    assert "[UNK]:注" in cf.tokens[0]  # what the unknown piece stood for
    assert cf.metadata["special_tokens_mask"][0][0] == 1
    torch.testing.assert_close(cf.pattern("encoder", 5), cs.pattern("encoder", 5), atol=0, rtol=0)
    t5, sp = hf["t5"]
    c = probe.capture(t5, "the model is reading", tokenizer=sp, target="i want a beer.")
    assert "".join(c.tokens[0][:-1]) == " the model is reading" and c.tokens[0][-1] == "</s>"
    assert not any("▁" in t for t in c.tokens[0])


@pytest.mark.parametrize("name", sorted(ENC_DEC))
def test_encoder_decoder_target_and_greedy(hf, name):
    model, tok = hf[name]
    given = probe.capture(model, TEXTS[1], tokenizer=tok, target=TARGETS[0])
    labels = tok(text_target=TARGETS[0])["input_ids"]
    assert given.metadata["target_ids"][0] == [model.config.decoder_start_token_id] + labels[:-1]
    assert given.metadata["target_source"] == "given"
    greedy = probe.capture(model, TEXTS[1], tokenizer=tok)
    assert greedy.metadata["target_source"] == "greedy"
    with torch.no_grad():
        ids = torch.tensor([tok(TEXTS[1])["input_ids"]])
        gen = model.generate(input_ids=ids, do_sample=False, num_beams=1, max_new_tokens=32)[0].tolist()
    assert gen[: len(greedy.metadata["target_ids"][0])] == greedy.metadata["target_ids"][0]
    assert greedy.pattern("decoder", 0, "cross").shape[-1] == len(ids[0])


@pytest.mark.parametrize("arch", ["gptj", "neox"])
def test_parallel_attention_and_mlp_blocks(arch):
    """GPT-J and GPT-NeoX add attention and MLP outputs to the stream together: each delta is
    still its own sublayer's output, and the patterns match eager."""
    model = (H.gptj if arch == "gptj" else H.neox)(200)
    blocks = model.transformer.h if arch == "gptj" else model.gpt_neox.layers
    attn = [b.attn if arch == "gptj" else b.attention for b in blocks]
    ids = torch.randint(0, 200, (2, 7))
    seen = {}
    hooks = [
        m.register_forward_hook(lambda mod, a, o, k=("attn", i): seen.__setitem__(k, o[0]))
        for i, m in enumerate(attn)
    ]
    hooks += [
        b.mlp.register_forward_hook(lambda mod, a, o, k=("mlp", i): seen.__setitem__(k, o))
        for i, b in enumerate(blocks)
    ]
    with torch.no_grad():
        cache = probe.capture(model, ids)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        eager = H.eager_twin(model)(input_ids=ids, output_attentions=True).attentions
    for i in range(2):
        assert torch.equal(cache[f"decoder.blocks.{i}.self_attn.delta"], seen[("attn", i)])
        assert torch.equal(cache[f"decoder.blocks.{i}.mlp.delta"], seen[("mlp", i)])
        torch.testing.assert_close(cache.pattern("decoder", i), eager[i], atol=1e-5, rtol=0)
    check_residuals(cache)


def test_probe_works_without_transformers():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'transformers' or name.startswith('transformers.'):\n"
        "            raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import probe, models\n"
        "c = probe.capture(models.load('minigpt'), 'attention')\n"
        "assert 'transformers' not in sys.modules\n"
        "print(c.pattern('decoder', 1).shape)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "torch.Size([1, 4, 9, 9])" in r.stdout
