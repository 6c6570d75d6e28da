"""Roles where the keys come from another sequence than the queries (issue 22, roles and stacks).

* BLT's local encoder runs patch queries over byte keys (a learned projection of the bytes makes
  the patches): cross-attention, not Funnel's pooled self-attention.
* DiffusionGemma's decoder runs one softmax over the encoder's cached prompt keys then the
  canvas's own: stored as T5Gemma 2's merged attention is, ``cross_attn`` (the prompt's keys) and
  ``self_attn`` (the canvas's), the note saying the source's keys come first.
* A KV-cached decoding step given its cache as ``cache=`` (the newer name) stays self-attention.

Oracles: the softmax of the arguments each ``scaled_dot_product_attention`` call was handed
(``catalogue_check.sdpa_spy``), in run order, and HF eager ``output_attentions`` with the same
weights.
"""

from __future__ import annotations

import copy

import catalogue_check as C
import catalogue_configs as K
import pytest
import torch

import probe


def _capture(model, x):
    with torch.no_grad(), probe.trace(model) as t:
        model(**x)
    return t.cache


@pytest.mark.slow
def test_blt_patch_over_byte_attention_is_cross_and_every_pattern_matches_sdpa_in_run_order():
    torch.manual_seed(0)
    model = K.build("blt")
    x = C.make_inputs(model)
    cache = _capture(model, x)
    want = C.run_sdpa_oracle(model, x)
    enc_cross = "local_encoder.cross_attn_layers"
    assert cache.attentions(enc_cross, 0) == [("cross", None)]
    q, k = cache.pattern(enc_cross, 0, "cross").shape[-2:]
    assert k == x["input_ids"].shape[1] and q != k  # patch queries over the bytes
    dec, dec_cross = "local_decoder.layers", "local_decoder.cross_attn_layers"
    run = [("patcher.layers", 0, "self"), ("patcher.layers", 1, "self")]
    run += [("local_encoder.layers", 0, "self"), ("local_encoder.layers", 1, "self"), (enc_cross, 0, "cross")]
    run += [("global_transformer.layers", 0, "self"), ("global_transformer.layers", 1, "self")]
    run += [(dec_cross, 0, "cross"), (dec, 0, "self"), (dec_cross, 1, "cross"), (dec, 1, "self")]
    assert len(want) == len(run)
    for (stack, layer, role), w in zip(run, want, strict=True):
        got = cache.pattern(stack, layer, role).float()
        torch.testing.assert_close(got, w, rtol=0, atol=1e-6)


def test_diffusion_gemma_decoder_prompt_then_canvas_softmax_is_stored_as_cross_and_self():
    torch.manual_seed(0)
    model = K.build("diffusion_gemma")
    x = C.make_inputs(model)
    cache = _capture(model, x)
    sdpa = C.run_sdpa_oracle(model, x)  # encoder layers, then decoder layers
    with torch.no_grad():
        eager = C.eager_twin(model)(**x, output_attentions=True).attentions  # the decoder's
    T, n_enc = x["input_ids"].shape[1], len(cache.layer_indices("encoder"))
    canvas = x["decoder_input_ids"].shape[1]
    for layer in cache.layer_indices("decoder"):
        assert cache.attentions("decoder", layer) == [("self", None), ("cross", None)]
        own = cache.pattern("decoder", layer, "self").float()
        prompt = cache.pattern("decoder", layer, "cross").float()
        assert own.shape[-2:] == (canvas, canvas) and prompt.shape[-2:] == (canvas, T)
        joint = torch.cat([prompt, own], dim=-1)  # the one softmax, prompt keys first
        torch.testing.assert_close(joint, sdpa[n_enc + layer], rtol=0, atol=1e-6)
        torch.testing.assert_close(joint, eager[layer], rtol=0, atol=1e-5)  # eager's own rounding
        note = cache.metadata["layers"][n_enc + layer]["merged_attention"]
        assert "the source's keys then the layer's own" in note
    for layer in cache.layer_indices("encoder"):
        torch.testing.assert_close(cache.pattern("encoder", layer).float(), sdpa[layer], rtol=0, atol=1e-6)


def test_a_kv_cached_step_given_cache_by_its_newer_name_stays_self_attention():
    torch.manual_seed(0)
    model = K.build("llama")
    ids = torch.randint(4, 200, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        past = model(input_ids=ids[:, :6], use_cache=True).past_key_values
    twin = C.eager_twin(model)
    with torch.no_grad():
        want = twin(input_ids=ids[:, 6:], cache=copy.deepcopy(past), output_attentions=True).attentions
    cache = _capture(model, {"input_ids": ids[:, 6:], "cache": past})
    for layer, w in enumerate(want):
        assert cache.attentions("decoder", layer) == [("self", None)]
        got = cache.pattern("decoder", layer).float()
        assert got.shape[-2:] == (4, 10)
        torch.testing.assert_close(got, w, rtol=0, atol=1e-6)
