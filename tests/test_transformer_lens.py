"""probe on TransformerLens's ``TransformerBridge``, checked against TransformerLens's own cache.

TransformerLens 4 has no ``HookedTransformer``: ``TransformerBridge.boot_transformers`` wraps a
Hugging Face model and recomputes attention itself (an explicit masked softmax, eager), firing
``blocks.<i>.attn.hook_pattern`` on the way. Everything here is offline: a seeded random GPT-2
and a byte-level BPE trained on a few sentences, saved to and reloaded from a temp folder.

Booting mutates the model it wraps (its attention modules are replaced by bridges and its
config is switched to eager attention), so the bridge gets its own model object *and* its own
config; the plain HF oracle keeps SDPA, where probe recomputes the weights beside the kernel.

Oracles: TransformerLens's ``run_with_cache`` (patterns, residual stream, sublayer outputs), the
bridge's own output without probe, and probe's cache on the plain HF model with the same weights.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in this module may reach the Hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import hf_fixtures as H  # noqa: E402
import huggingface_hub.constants  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

# Imported at module level on purpose (no importorskip): CI installs TransformerLens, and a
# missing install must fail loudly rather than skip.
from transformer_lens import TransformerBridge  # noqa: E402

import probe  # noqa: E402

TEXTS = [
    "attention lets tokens read from each other.",
    "the quick brown fox jumps over the lazy dog.",
    "a transformer computes an attention pattern in every layer and head.",
]
VOCAB, N_LAYER, N_HEAD, D_MODEL = 300, 3, 4, 64
T = 24  # token-id inputs: [2, T]


def tl_pattern(tl_cache, layer: int) -> torch.Tensor:
    """TransformerLens's pattern of ``layer``, [batch, head, query, key] like probe's."""
    return tl_cache[f"blocks.{layer}.attn.hook_pattern"]


# probe's residual keys -> TransformerLens's hook names, per block
RESIDUAL_NAMES = {
    "resid_pre": "hook_resid_pre",
    "self_attn.delta": "hook_attn_out",
    "mlp.delta": "hook_mlp_out",
    "resid_post": "hook_resid_post",
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # the env vars above are read when huggingface_hub is first imported (maybe by another module)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE (GPT-2 style) of exactly VOCAB entries, saved as a HF tokenizer folder."""
    path = tmp_path_factory.mktemp("tokenizer")
    H.bpe_tokenizer(path, texts=TEXTS, vocab=VOCAB)
    return path


def load_tokenizer(path):
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) == VOCAB
    return tok


def gpt2(state_dict=None) -> transformers.GPT2LMHeadModel:
    """A small random GPT-2 with its own config object (booting a bridge edits the config)."""
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=D_MODEL,
        n_layer=N_LAYER,
        n_head=N_HEAD,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


def boot(hf_model, tokenizer_dir):
    bridge = TransformerBridge.boot_transformers(
        str(tokenizer_dir), hf_model=hf_model, tokenizer=load_tokenizer(tokenizer_dir), device="cpu"
    )
    return bridge.eval()


@pytest.fixture(scope="module")
def hf():
    """The plain HF GPT-2 on SDPA: never wrapped."""
    return gpt2()


@pytest.fixture(scope="module")
def bridge(hf, tokenizer_dir):
    """A TransformerBridge over a separate GPT-2 object with the same weights as ``hf``."""
    b = boot(gpt2(hf.state_dict()), tokenizer_dir)
    assert hf.config._attn_implementation == "sdpa", "booting the bridge changed the plain HF model"
    return b


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))


def assert_patterns_match_tl(cache, tl_cache, batch: int, length: int, stack: str = "decoder") -> None:
    for layer in range(N_LAYER):
        got, want = cache.pattern(stack, layer), tl_pattern(tl_cache, layer)
        assert got.shape == want.shape == (batch, N_HEAD, length, length)
        for head in range(N_HEAD):
            torch.testing.assert_close(
                got[:, head], want[:, head], atol=1e-5, rtol=0, msg=f"layer {layer} head {head}"
            )


def test_patterns_equal_run_with_cache_on_ids(bridge, ids):
    cache = probe.capture(bridge, ids)
    _, tl_cache = bridge.run_with_cache(ids)
    assert cache.stacks == ["decoder"]
    assert cache.metadata["attention_implementations"] == ["softmax"]  # the bridge's own softmax
    assert_patterns_match_tl(cache, tl_cache, *ids.shape)


def test_patterns_equal_run_with_cache_on_texts(bridge):
    # probe tokenizes with the bridge's tokenizer (BOS prepended, right padding) and hands the
    # bridge the padding mask; TransformerLens gets the same ids and mask
    cache = probe.capture(bridge, TEXTS)
    enc = bridge.tokenizer(TEXTS, padding=True, return_tensors="pt")
    assert cache.metadata["attention_mask"] == enc.attention_mask.tolist()
    assert cache.tokens[0][0] == "<|endoftext|>"
    _, tl_cache = bridge.run_with_cache(enc.input_ids, attention_mask=enc.attention_mask)
    assert_patterns_match_tl(cache, tl_cache, *enc.input_ids.shape)


def test_outputs_bit_identical_with_capture(bridge, ids):
    with torch.no_grad():
        plain = bridge(ids)
        with probe.trace(bridge) as t:
            traced = bridge(ids)
    assert torch.equal(plain, traced)
    assert len(t.cache.keys()) == 5 * N_LAYER


def test_bridge_cache_equals_plain_hf_cache(bridge, hf, ids):
    on_bridge = probe.capture(bridge, ids)
    on_hf = probe.capture(hf, ids)
    assert on_bridge.keys() == on_hf.keys()
    for key in on_hf.keys():
        torch.testing.assert_close(on_bridge[key], on_hf[key], atol=1e-5, rtol=0, msg=key)
    # same numbers, different routes: the bridge's softmax vs SDPA weights recomputed by probe
    assert on_hf.metadata["attention_implementations"] == ["sdpa"]
    with torch.no_grad():
        torch.testing.assert_close(bridge(ids), hf(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_residual_stream_invariants_and_tl_hooks(bridge, ids):
    cache = probe.capture(bridge, ids)
    _, tl_cache = bridge.run_with_cache(ids)
    for layer in range(N_LAYER):
        r = {name: cache[f"decoder.blocks.{layer}.{name}"] for name in RESIDUAL_NAMES}
        assert r["resid_pre"].shape == (*ids.shape, D_MODEL)
        total = r["resid_pre"] + r["self_attn.delta"] + r["mlp.delta"]
        torch.testing.assert_close(total, r["resid_post"], atol=1e-5, rtol=0)
        if layer + 1 < N_LAYER:
            assert torch.equal(r["resid_post"], cache[f"decoder.blocks.{layer + 1}.resid_pre"])
        for name, hook in RESIDUAL_NAMES.items():
            torch.testing.assert_close(
                r[name], tl_cache[f"blocks.{layer}.{hook}"], atol=1e-5, rtol=0, msg=f"{layer} {name}"
            )


def test_selected_layers_heads_streamed_to_disk(bridge, ids, tmp_path):
    out = tmp_path / "bridge.safetensors"
    cache = probe.capture(bridge, ids, out=out, layers=[1], heads=[0, 2])
    _, tl_cache = bridge.run_with_cache(ids)
    assert out.exists()
    assert [k for k in cache.keys() if k.endswith("pattern")] == ["decoder.blocks.1.self_attn.pattern"]
    torch.testing.assert_close(
        cache.pattern("decoder", 1), tl_pattern(tl_cache, 1)[:, [0, 2]], atol=1e-5, rtol=0
    )


def test_left_padded_batch_patterns_equal_run_with_cache(bridge, ids):
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding on the first row: its pad queries see no key at all
    with torch.no_grad(), probe.trace(bridge) as t:
        bridge(ids, attention_mask=mask)
    _, tl_cache = bridge.run_with_cache(ids, attention_mask=mask)
    # an all-masked row comes out uniform (finfo.min fill), not causal-looking: still a decoder
    assert t.cache.stacks == ["decoder"]
    assert_patterns_match_tl(t.cache, tl_cache, *ids.shape)


def test_left_padded_texts_equal_each_text_alone(tokenizer_dir, hf):
    # the bridge is no transformers model, but its forward takes attention_mask: probe passes it
    bridge = boot(gpt2(hf.state_dict()), tokenizer_dir)
    bridge.tokenizer.padding_side = "left"
    batched = probe.capture(bridge, TEXTS)
    assert batched.metadata["padding_side"] == "left"
    for i, text in enumerate(TEXTS):
        alone = probe.capture(bridge, text)
        for layer in range(N_LAYER):
            want = alone.pattern("decoder", layer)[0]
            n = want.shape[-1]
            got = batched.pattern("decoder", layer)[i, :, -n:, -n:]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"text {i} layer {layer}")


def test_compatibility_mode_patterns_equal_run_with_cache(tokenizer_dir, hf, ids):
    # HookedTransformer numerics: LayerNorm folded, weights centred; a separate bridge and model
    bridge = boot(gpt2(hf.state_dict()), tokenizer_dir)
    bridge.enable_compatibility_mode()
    with torch.no_grad():
        plain = bridge(ids)
        with probe.trace(bridge) as t:
            traced = bridge(ids)
    assert torch.equal(plain, traced)
    _, tl_cache = bridge.run_with_cache(ids)
    assert_patterns_match_tl(t.cache, tl_cache, *ids.shape)
    on_hf = probe.capture(hf, ids)
    for layer in range(N_LAYER):  # folding LayerNorm leaves the attention pattern unchanged
        torch.testing.assert_close(
            t.cache.pattern("decoder", layer), on_hf.pattern("decoder", layer), atol=1e-5, rtol=0
        )
