"""Local (chunked, sliding-window) attention: captured mapped back to [query, key], or refused.

Oracles: HF eager ``output_attentions`` mapped back to [query, key] here (Longformer, LED;
RecurrentGemma's windowed mask as is), Canine's own chunk weights (a forward hook on its
self-attention module in the eager twin, mapped back here), the windows written here; for the
layouts probe cannot map yet (LongT5's blocks, Longformer's global attention) the refusal names
the model type and the layers, never a capture that silently lacks them.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from test_catalogue_structure import VOCAB, K, _eager, _ids, _seeded, canine

import probe
from probe.errors import ProbeError


def led():
    cfg = tf.LEDConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, attention_window=4,
        max_encoder_position_embeddings=64, max_decoder_position_embeddings=64,
    )  # fmt: skip
    return _seeded(tf.LEDModel, cfg)


def longt5(kind: str):
    cfg = tf.LongT5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=1, num_heads=2,
        local_radius=3, encoder_attention_type=kind,
    )  # fmt: skip
    return _seeded(tf.LongT5Model, cfg)


def longformer():
    cfg = tf.LongformerConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, attention_window=4, max_position_embeddings=80,
    )  # fmt: skip
    return _seeded(tf.LongformerModel, cfg)


@pytest.mark.parametrize(
    "build, stack",
    [
        (lambda: longt5("transient-global"), "encoder.block"),
    ],
)
def test_encoder_decoders_with_local_encoder_attention_are_refused_naming_the_layers(build, stack):
    model = build()
    ids = _ids(2, 10)
    kind = model.config.model_type
    with pytest.raises(ProbeError, match=rf"^{kind}: layers {stack}\.0, {stack}\.1 compute attention"):
        with torch.no_grad(), probe.trace(model):
            model(input_ids=ids, decoder_input_ids=ids[:, :5])


def _band_back(eager: torch.Tensor) -> torch.Tensor:
    """Longformer's eager ``attentions`` ``[batch, heads, T, 2w + 1]`` (the weight of query ``i``
    on key ``i - w + j`` at column ``j``, its docs say) mapped back to ``[batch, heads, T, T]``."""
    b, h, T, width = eager.shape
    w = width // 2
    out = torch.zeros(b, h, T, T)
    for i in range(T):
        for j in range(width):
            k = i - w + j
            if 0 <= k < T:
                out[:, :, i, k] = eager[:, :, i, j]
            else:  # outside the sequence: the model gives it no weight
                assert bool((eager[:, :, i, j] == 0).all())
    return out


@pytest.mark.parametrize("build", [longformer, led])
def test_sliding_window_attention_is_mapped_back_exact_against_eager(build):
    model, x = build(), _ids(2, 10)
    mask = torch.ones_like(x)
    mask[1, 7:] = 0
    kw = {"decoder_input_ids": x[:, :5]} if model.config.model_type == "led" else {}
    with torch.no_grad(), probe.trace(model) as t:
        model(input_ids=x, attention_mask=mask, **kw)
    cache = t.cache
    with torch.no_grad():
        out = _eager(model)(input_ids=x, attention_mask=mask, output_attentions=True, **kw)
    want = out.encoder_attentions if kw else out.attentions
    T = 12  # the model pads the 10 tokens to a multiple of its window (4) and runs 12 positions
    for layer, w in enumerate(want):
        assert w.shape[-2:] == (10, 5)  # eager crops its weights back to the 10 tokens
        got = cache[f"encoder.blocks.{layer}.self_attn.pattern"]
        assert got.shape == (2, 2, T, T)
        torch.testing.assert_close(got[..., :10, :10], _band_back(w), rtol=0, atol=1e-6)
        # the model's own padding positions: masked keys and zeroed queries, no weight at all
        assert bool((got[..., 10:, :] == 0).all()) and bool((got[..., :, 10:] == 0).all())
        band = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).abs() <= 2
        assert bool((got[..., ~band] == 0).all())
        torch.testing.assert_close(got[0, :, :10].sum(-1), torch.ones(2, 10), rtol=0, atol=1e-6)
        assert bool((got[1, :, 7:] == 0).all())  # the padded queries of the second text are zeroed
    kinds = [e["self_attn"].get("kind", "") for e in cache.metadata["layers"] if "self_attn" in e]
    assert sum(k.startswith("sliding-window attention") for k in kinds) == 2


def test_longformer_global_attention_is_refused_naming_the_layers():
    model, x = longformer(), _ids(1, 10)
    glob = torch.zeros_like(x)
    glob[:, 0] = 1
    with pytest.raises(ProbeError, match=r"^longformer: layers encoder\.layer\.0, encoder\.layer\.1 .*local"):
        with torch.no_grad(), probe.trace(model):
            model(input_ids=x, global_attention_mask=glob)


def _canine_chunks(model, x, mask):
    """The chunk weights Canine's local attention computes, read by a hook on its eager twin's
    self-attention module, mapped back here to [batch, heads, T, T] (zeros outside the chunks)."""
    twin = _eager(model)
    seen = []
    attn = twin.initial_char_encoder.layer[0].attention
    h = attn.self.register_forward_hook(lambda m, a, out: seen.append(out[1]))
    try:
        with torch.no_grad():
            twin(input_ids=x, attention_mask=mask, output_attentions=True)
    finally:
        h.remove()
    T, stride = x.shape[1], model.config.local_transformer_stride
    want = torch.zeros(x.shape[0], seen[0].shape[1], T, T)
    for i, s in enumerate(range(0, T, stride)):
        e = min(T, s + stride)
        want[:, :, s:e, s:e] = seen[i]
    assert len(seen) == len(range(0, T, stride))
    return want


@pytest.mark.parametrize("T", [8, 10, 13])
def test_canine_local_attention_is_mapped_back_to_the_whole_sequence(T):
    model, x = canine(), _ids(2, T)
    mask = torch.ones_like(x)
    mask[1, T - 3 :] = 0  # padding in the second text
    with torch.no_grad(), probe.trace(model) as t:
        model(input_ids=x, attention_mask=mask)
    cache = t.cache
    got = cache[K("initial_char_encoder.layer", 0, "self_attn.pattern")]
    want = _canine_chunks(model, x, mask)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # nothing outside a query's chunk
    stride = model.config.local_transformer_stride
    block = torch.arange(T) // stride
    assert bool((got[..., block[:, None] != block[None, :]] == 0).all())
    kinds = [e["self_attn"].get("kind", "") for e in cache.metadata["layers"] if "self_attn" in e]
    assert sum("local attention computed chunk by chunk" in k for k in kinds) == 1
    assert "initial_char_encoder.layer" in cache.stacks


def recurrent_gemma():
    cfg = tf.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, lru_width=32, attention_window_size=4,
        block_types=["recurrent", "attention"],
    )  # fmt: skip
    return _seeded(tf.RecurrentGemmaModel, cfg)


def test_recurrent_gemma_local_attention_layer_is_exact_and_zero_outside_its_window():
    model, x = recurrent_gemma(), _ids(2, 10)
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # left padding
    with torch.no_grad(), probe.trace(model) as t:
        model(input_ids=x, attention_mask=mask)
    cache = t.cache
    with torch.no_grad():
        (want,) = _eager(model)(input_ids=x, attention_mask=mask, output_attentions=True).attentions
    got = cache["decoder.blocks.1.self_attn.pattern"]  # block 1 is the attention block
    # the padding's own query rows see no key; eager fills them uniformly, SDPA's recompute does not
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(got[1, :, 3:], want[1, :, 3:], rtol=0, atol=1e-6)
    q, k = torch.arange(10)[:, None], torch.arange(10)[None, :]
    outside = (k > q) | (q - k >= 4)  # the causal window of 4 positions, written here
    assert bool((got[0][:, outside] == 0).all()) and bool((got[1, :, 3:][:, outside[3:]] == 0).all())
    assert "decoder.blocks.0.self_attn.pattern" not in cache.keys()  # recurrent blocks: no attention


def _blocks_back(eager: torch.Tensor, T: int) -> torch.Tensor:
    """LongT5's eager local weights ``[batch, blocks, heads, n, 3n]`` (query ``a`` of block ``i``
    over the keys of blocks ``i - 1, i, i + 1``) mapped back to ``[batch, heads, T, T]``."""
    b, nb, h, n, _ = eager.shape
    out = torch.zeros(b, h, T, T)
    for i in range(nb):
        for a in range(n):
            q = i * n + a
            if q >= T:
                continue
            for c in range(3 * n):
                k = (i - 1) * n + c
                if 0 <= k < T:
                    out[:, :, q, k] = eager[:, i, :, a, c]
    return out


@pytest.mark.parametrize("T", [8, 10])
def test_longt5_local_attention_is_mapped_back_exact_against_eager(T):
    model, x = longt5("local"), _ids(2, T)
    mask = torch.ones_like(x)
    mask[1, T - 3 :] = 0
    kw = {"attention_mask": mask, "decoder_input_ids": x[:, :5]}
    with torch.no_grad(), probe.trace(model) as t:
        model(input_ids=x, **kw)
    cache = t.cache
    with torch.no_grad():
        want = _eager(model)(input_ids=x, output_attentions=True, **kw).encoder_attentions
    r = model.config.local_radius
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    for layer, w in enumerate(want):
        got = cache[f"encoder.blocks.{layer}.self_attn.pattern"]
        mapped = _blocks_back(w, T)
        # real query rows only: a padding query's weight past the sequence's ends is not stored
        torch.testing.assert_close(got[0], mapped[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(got[1, :, : T - 3], mapped[1, :, : T - 3], rtol=0, atol=1e-6)
        torch.testing.assert_close(got[0].sum(-1), torch.ones(2, T), rtol=0, atol=1e-6)
        far = (q - k).abs() > r  # outside the local radius, written here
        assert bool((got[0][:, far] == 0).all()) and bool((got[1, :, : T - 3][:, far[: T - 3]] == 0).all())
    kinds = [e["self_attn"].get("kind", "") for e in cache.metadata["layers"] if "self_attn" in e]
    assert sum(k.startswith("block-local attention") for k in kinds) == 2
