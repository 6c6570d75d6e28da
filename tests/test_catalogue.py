"""A fixed sample of the catalogue sweep (``benchmarks/catalogue.py``) in CI: each family built
tiny, run on random ids with a padded row, captured by probe on its default attention and every
stored pattern compared with eager ``output_attentions`` of the same weights (or a softmax of the
arguments handed to SDPA where eager differs); the sample covers decoders, encoders,
encoder-decoders, grouped-query and multi-query attention, ALiBi, sliding-window and local
attention, and cross-attention.

Families that probe does not get right yet are ``xfail(strict=True)``: when a fix lands, they
pass, the strict mark turns that into a failure, and the mark is removed with the fix.
"""

from __future__ import annotations

import catalogue_check as C
import catalogue_configs as K
import catalogue_inputs as I
import catalogue_layouts as L
import catalogue_oracles as O
import pytest
import torch

# model type -> what it exercises
EXACT = {
    "gpt2": "decoder, learned positions",
    "llama": "decoder, GQA, rotary",
    "mistral": "sliding-window attention, GQA",
    "qwen2": "GQA, qkv bias",
    "gemma2": "a sliding-window and a global layer, soft-capped scores (eager)",
    "gemma3_text": "a sliding-window and a global layer, qk-norm",
    "phi": "parallel attention + MLP, partial rotary",
    "falcon": "multi-query, parallel attention",
    "bloom": "ALiBi",
    "mpt": "ALiBi",
    "gpt_neox": "parallel residual, partial rotary",
    "gpt_bigcode": "multi-query attention",
    "gpt_neo": "a global and a local attention layer",
    "gptj": "rotary on part of the head",
    "olmo2": "qk-norm, norm after sublayers",
    "qwen3": "qk-norm, GQA",
    "mixtral": "routed experts (router softmax is not attention)",
    "opt": "decoder, learned positions with offset",
    "bert": "encoder, padding mask",
    "roberta": "encoder, padding-aware positions",
    "distilbert": "encoder",
    "deberta-v2": "disentangled relative attention (eager)",
    "big_bird": "block-sparse model on full attention",
    "xlnet": "two-stream relative attention",
    "t5": "encoder-decoder, relative bias, cross-attention",
    "bart": "encoder-decoder, cross-attention",
    "marian": "encoder-decoder, sinusoidal positions",
    "m2m_100": "encoder-decoder",
    "mt5": "encoder-decoder, gated FFN",
    "recurrent_gemma": "hybrid: recurrent layers and one attention layer",
    "chameleon": "decoder, qk-norm",
    # per-layer configs: reading head_dim etc. from the global config raises in transformers
    "gemma4_text": "per-layer configs (the metadata reads the config through its own to_dict)",
    # one softmax layer and one linear-attention layer, whose eager map (q·kᵀ with decay, negative
    # weights) is no softmax: the check sets it aside and compares the softmax layer
    "minimax": "hybrid: full attention and lightning (linear) attention",
    "albert": "one layer module run for every layer: one cache layer per call",
    # two looped stacks run alternately: stored stack by stack, eager returns them in run order
    "hrm_text": "two stacks of blocks, each run several times (one cache layer per call)",
    "funnel": "pooled queries over the previous layer's output, blocks run several times",
    "gpt_oss": "a learned sink column joined to the scores (stored beside the pattern)",
    "flint": "a learned sink column joined to the scores",
    "t5gemma2": "one softmax over own keys then the encoder's: stored as self and cross parts",
    # eager's own layouts mapped to probe's [query, key] by the check (catalogue_layouts.py)
    "longformer": "sliding-chunk attention, eager's [query, window] layout mapped back",
    "led": "sliding-chunk encoder attention, eager's [query, window] layout mapped back",
    "longt5": "block-local encoder attention, eager's 5-d blocks mapped back",
    "deepseek_v4": "compressed attention: positions, block summaries and sink stored apart",
    "reformer": "exp(x - logsumexp) weights: local chunks rolled, LSH chunks mapped through the sort",
    "prophetnet": "n-gram decoder: main stream self_attn.0, predict streams self_attn.1.., eager scores",
    "pegasus_x": "block-local encoder attention with global tokens, its module's weights mapped back",
    "diffllama": "differential attention: a1 - λ·a2 per head, and its two softmaxes as parts",
    "cpmant": "prompt positions ahead of the text, cropped as eager crops them",
    # runs its list elements with layer.forward(...): layers found from their children's calls
    "squeezebert": "list elements run without their hooks, channel-first stream, eager returns scores",
    "longcat_flash": "two attention sublayers per layer: self_attn.0 and self_attn.1",
    # block attention residuals: softmaxes over earlier blocks' outputs (depth), not stored
    "inkling2": "per-token sink logit; block attention residuals over depth set aside",
    "inkling2_text": "per-token sink logit; block attention residuals over depth set aside",
    "inkling2_loop": "looped layers; block attention residuals over depth set aside",
    "inkling2_loop_text": "looped layers; block attention residuals over depth set aside",
    "glm5_next_text": "hyper-connection softmaxes over streams (not stored), linear-attention layer",
    "gemma3n_text": "KV sharing: the last two layers reuse earlier layers' keys and values",
    "zamba": "hybrid: one attention block shared (tied) by the hybrid layers",
    "deepseek_v2": "multi-head latent attention (MLA)",
    "dory": "a recurrent layer run twice per forward between input and output layers",
    "lilt": "layout and text streams: two softmaxes of one module, self_attn.0 and self_attn.1",
    "blt": "patch-over-byte attention is cross; five stacks; eager returns 4 of 11 (the rest vs SDPA)",
    "diffusion_gemma": "decoder's one softmax over the encoder's cached prompt keys then its own",
    "musicgen_melody": "a T5 text encoder eager does not return (checked against SDPA)",
    # image and vision-language families, on inputs made from their config (catalogue_inputs.py)
    "vit": "pixels at the config's image size: [CLS] + patch grid",
    "dinov2_with_registers": "[CLS], register tokens and patches",
    "clip": "a text tower on ids and a vision tower on pixels",
    "siglip_vision_model": "an attention-pooling head (nn.MultiheadAttention, checked by a hook)",
    "llava": "image tokens in the text, as many as the tower makes of one image",
    "idefics3": "pixels [batch, images, C, H, W] and a pixel mask, pixel-shuffled image tokens",
    "git": "eager-only towers that output_attentions leaves out (checked against the eager softmaxes)",
    "swin": "shifted windows: eager's per-window weights mapped to the patch grid by the check",
    "maskformer-swin": "shifted windows, eager fails with output_attentions (its softmaxes mapped)",
    "qwen2_vl": "packed pictures: per-picture SDPA calls joined block-diagonally by the check",
    "hunyuan_vl": "packed pictures in a [1, positions, dim] tower (stored as extra heads before)",
    "idefics2": "the resampler's one softmax over [image features; latents]: cross first, then self",
    "phi4_multimodal_vision": "eager differs from SDPA: the model's own softmaxes and pooling weights decide",
    # audio families, on a spectrogram or a waveform made from their config (catalogue_audio.py)
    "whisper": "2 · max_source_positions mel frames, decoder ids, cross-attention over the frames",
    "speech_to_text": "a [batch, frames, mel] spectrogram through convolutions, encoder-decoder",
    "wav2vec2": "a waveform through the convolution feature extractor, a padded row",
    "wavlm": "a direct F.multi_head_attention_forward call; eager returns the head mean",
    "audio-spectrogram-transformer": "a spectrogram cut into patches",
    "qwen2_audio": "audio tokens in the text, as many as the audio encoder makes of one audio",
    "seamless_m4t_v2": "speech encoder on stacked frames; eager differs from SDPA (SDPA decides)",
}

# model type -> why it is not exact yet (issue 22); the owner removes the mark with the fix
KNOWN = {}

SAMPLE = [pytest.param(m, id=m) for m in EXACT] + [
    pytest.param(m, id=m, marks=pytest.mark.xfail(strict=True, reason=why)) for m, why in KNOWN.items()
]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SAMPLE)
def test_catalogue_family_is_exact(model_type):
    torch.manual_seed(0)
    model = K.build(model_type)
    verdict = I.check_family(model)
    assert verdict["status"] == "exact", verdict
    assert verdict["n_probe"] > 0


def test_the_check_sees_a_missing_pattern(monkeypatch):
    model = K.build("bert")
    real = C.probe_patterns
    monkeypatch.setattr(C, "probe_patterns", lambda cache: real(cache)[1:])
    verdict = C.check_model(model)
    assert verdict["status"] == "wrong" and "1 patterns stored, oracle has 2" in verdict["reason"], verdict


@pytest.mark.parametrize("model_type", ["gpt2", "longformer", "longt5", "swin"])
def test_the_check_sees_a_wrong_pattern(monkeypatch, model_type):
    # the oracle comparison itself: a pattern probe stored with one head's weights moved to other
    # keys is "wrong"; for local patterns, against eager mapped back (the mapping is no blanket
    # that makes any pattern pass)
    model = K.build(model_type)
    real = C.probe_patterns

    def shifted(cache):
        out = real(cache)
        label, kind, p = out[0]
        p = p.clone()
        p[:, 0] = p[:, 0].roll(1, dims=-1)
        return [(label, kind, p)] + out[1:]

    monkeypatch.setattr(C, "probe_patterns", shifted)
    verdict = C.check_model(model, I.fitted_inputs(model) if I.takes_pixels(type(model)) else None)
    # Swin: eager returns each stage's last layer, so the first layer's move is SDPA's to see
    seen = max(d for d in (verdict["eager_diff"], verdict["sdpa_diff"]) if d is not None)
    assert verdict["status"] == "wrong" and seen > 1e-3, verdict


def test_the_check_sees_a_wrong_differential_lambda(monkeypatch):
    # the combined map a1 - λ·a2 is compared, so a λ off by 0.1 makes DiffLlama "wrong"
    model = K.build("diffllama")
    real = L.differential_lambdas
    monkeypatch.setattr(L, "differential_lambdas", lambda m: [x + 0.1 for x in real(m)])
    verdict = C.check_model(model)
    assert verdict["status"] == "wrong" and verdict["eager_diff"] > 1e-3, verdict


def _local_softmax(b, h, T, allowed):
    """A softmax over random scores where ``allowed[i, k]``, zeros elsewhere: ``[b, h, T, T]``."""
    g = torch.Generator().manual_seed(3)
    s = torch.randn(b, h, T, T, generator=g).masked_fill(~allowed, float("-inf"))
    return s.softmax(-1)


def test_band_layout_mapped_back_against_a_softmax_written_here():
    # Longformer's layout built here from a windowed softmax: column x + j of query i holds key
    # i - w + j, the first x columns the global tokens (weights there are zero in the window)
    T, w = 7, 2
    i = torch.arange(T)
    glob = torch.zeros(2, T, dtype=torch.long)
    glob[:, 4] = 1
    allowed = ((i[:, None] - i[None, :]).abs() <= w) | (i[None, :] == 4)
    want = _local_softmax(2, 3, T, allowed)
    e = torch.zeros(2, 3, T, 1 + 2 * w + 1)
    e[..., 0] = want[..., 4]
    for q in range(T):
        for j in range(2 * w + 1):
            if 0 <= q - w + j < T and q - w + j != 4:
                e[:, :, q, 1 + j] = want[:, :, q, q - w + j]
    torch.testing.assert_close(L.band_to_keys(e, glob), want, atol=1e-7, rtol=0)
    e[0, 0, 0, 1] = 0.5  # weight on key -2: no such layout
    assert L.band_to_keys(e, glob) is None


def test_block_layout_mapped_back_against_a_softmax_written_here():
    # LongT5's layout built here from a block-local softmax: query a of block i over the keys of
    # blocks i - 1 .. i + 1, T = 7 not filling the last block of n = 3
    T, n = 7, 3
    blk = torch.arange(T) // n
    want = _local_softmax(2, 2, T, (blk[:, None] - blk[None, :]).abs() <= 1)
    nb = -(-T // n)
    e = torch.zeros(2, nb, 2, n, 3 * n)
    for q in range(T):
        for c in range(3 * n):
            key = (q // n - 1) * n + c
            if 0 <= key < T:
                e[:, q // n, :, q % n, c] = want[:, :, q, key]
    torch.testing.assert_close(L.blocks_to_keys(e, T), want, atol=1e-7, rtol=0)


def test_the_sdpa_oracle_is_a_masked_softmax():
    # the SDPA spy's softmax against torch's own attention output: weights @ v == sdpa(q, k, v)
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    mask[1, ..., 3:] = False
    store: list = []
    out = C.sdpa_spy(store)(q, k, v, attn_mask=mask, enable_gqa=True)
    w = store[0]
    assert w.shape == (2, 4, 5, 5)
    assert float(w[1, ..., 3:].abs().max()) == 0.0
    torch.testing.assert_close(w @ v.repeat_interleave(2, dim=1), out, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_sweep_cli_resumes_and_writes_the_page(tmp_path):
    # the benchmark end to end on one family: a verdict in the JSON file, a rerun skips it, and the
    # markdown page counts it
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "catalogue.py"
    out = tmp_path / "few.json"
    run = [sys.executable, str(script), "--only", "gpt2", "--out", str(out)]
    first = subprocess.run(run, capture_output=True, text=True, timeout=600, check=True)
    assert "gpt2" in first.stdout
    assert json.loads(out.read_text())["gpt2"]["status"] == "exact"
    again = subprocess.run(run, capture_output=True, text=True, timeout=600, check=True)
    assert "gpt2 " not in again.stdout and '"exact": 1' in again.stdout
    page = subprocess.run(
        [sys.executable, str(script), "--markdown", str(out)], capture_output=True, text=True, check=True
    ).stdout
    # one exact family, no image family among them; two layers, one pattern each, run on ids
    assert "| exact | 1 | 0 | 0 | 0 |" in page and "| `gpt2` | GPT2Model | ids | 2 |" in page


def test_sub_configs_and_missing_libraries_are_not_build_failures():
    # the sweep's statuses for what it cannot build on its own, against transformers' own classes
    import sys
    from pathlib import Path

    import transformers as tf

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from catalogue_classify import classify_build_error, missing_library

    assert tf.BltLocalEncoderConfig in tf.BltConfig.sub_configs.values()
    v = classify_build_error("blt_local_encoder", LookupError("no base or causal-LM model class"), None)
    assert v["status"] == "sub-config" and "`blt`" in v["reason"], v
    # a KeyError (a LookupError too) from a config is a build failure, not a missing class
    v = classify_build_error("gpt2", KeyError("full_attention"), None)
    assert v["status"] == "build failed", v
    e = ImportError("\nTimmWrapperModel requires the timm library but it was not found in your environment.")
    assert missing_library(e)["status"] == "needs a library" and "`timm`" in missing_library(e)["reason"]
    assert missing_library(ImportError("cannot import name x")) is None


def test_the_union_check_sees_a_wrong_pooling_head(monkeypatch):
    # SigLIP's pooling head is an nn.MultiheadAttention that neither eager's outputs nor the SDPA
    # spy returns: the union check holds it to the hook's weights, so one head moved is "wrong"
    model = K.build("siglip_vision_model")
    inputs = I.fitted_inputs(model)
    assert C.check_model(model, inputs)["status"] == "exact"
    real = C.probe_patterns

    def shifted(cache):
        out = real(cache)
        i = next(i for i, (_, _, p) in enumerate(out) if p.shape[-2] == 1)  # the one-query pooling head
        label, kind, p = out[i]
        p = p.clone()
        p[:, 0] = p[:, 0].roll(1, dims=-1)
        return out[:i] + [(label, kind, p)] + out[i + 1 :]

    monkeypatch.setattr(C, "probe_patterns", shifted)
    verdict = C.check_model(model, inputs)
    assert verdict["status"] == "wrong" and "union: MultiheadAttention pattern 0" in verdict["reason"], (
        verdict
    )


def test_the_union_check_wants_every_oracle_pattern_stored():
    # against tensors written here: a pattern an oracle returns and probe left out is "wrong"; the
    # eager softmaxes may vouch for a stored pattern but need not all be stored
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(1, 2, 3, 3, generator=g).softmax(-1) for _ in range(3))
    close = lambda x, y: float((x - y).abs().max()) <= 1e-6  # noqa: E731
    assert O.union_check([a, b], {"eager": [a], "sdpa": [b]}, close)[0]
    ok, why = O.union_check([a], {"eager": [a], "sdpa": [b]}, close)
    assert not ok and "sdpa pattern 0" in why
    assert not O.union_check([a, c], {"eager": [a]}, close)[0]
    assert O.union_check([a, c], {"eager": [a]}, close, {"eager softmax": [b, c, a]})[0]
    assert O.union_check([a], {"eager": [a, a.clone()]}, close)[0]  # a duplicate listed twice
    assert O.union_check([a], {}, close, {"eager softmax": [a.flatten(0, 1)]})[0]  # heads in the batch
    # a packed tower's per-picture calls (3 and 2 patches) joined block-diagonally for a stored 5 x 5
    x, y = torch.rand(1, 2, 3, 3, generator=g), torch.rand(1, 2, 2, 2, generator=g)
    want = torch.zeros(1, 2, 5, 5)
    want[..., :3, :3], want[..., 3:, 3:] = x, y
    joined = O.join_chunks([x, y, b], [want, b])
    assert len(joined) == 2 and torch.equal(joined[0], want) and joined[1] is b
    assert O.join_chunks([x, y], [a]) == [x, y]  # no stored pattern of their joint size: left alone


def test_image_inputs_follow_the_config():
    # pixels at the config's size and channels; a vision-language text with as many image tokens as
    # the model makes of one image (LLaVA: the 12 x 12 patch grid of a 336 px image, no [CLS])
    vit = K.build("vit")
    x = I.fitted_inputs(vit)
    cfg = vit.config
    assert list(x) == ["pixel_values"] and x["pixel_values"].shape == (
        1,
        cfg.num_channels,
        cfg.image_size,
        cfg.image_size,
    )
    llava = K.build("llava")
    x = I.fitted_inputs(llava)
    v = llava.config.vision_config
    n = (x["input_ids"] == llava.config.image_token_id).sum(1)
    assert n.tolist() == [(v.image_size // v.patch_size) ** 2] * 2
    assert x["attention_mask"][1, -2:].sum() == 0 and x["attention_mask"][0].all()
    assert "takes input_features (audio features)" in I.not_image(type(K.build("whisper")))


def test_flattened_patches_are_captured_without_a_grid():
    # Qwen2-VL's pixels are flattened patches [patches, C*t*p*p] with image_grid_thw: probe.capture
    # takes them (no patch grid named from them), and the language model's patterns equal eager's
    import probe

    model = K.build("qwen2_vl")
    inputs = I.fitted_inputs(model)
    assert inputs["pixel_values"].dim() == 2
    cache = probe.capture(model, dict(inputs))
    assert cache.metadata["pixel_shape"] == list(inputs["pixel_values"].shape)
    assert "image_shape" not in cache.metadata
    with torch.no_grad():
        want = C.eager_twin(model)(**inputs, output_attentions=True).attentions
    got = [cache.pattern(s, i) for s in cache.stacks if "language" in s for i in cache.layer_indices(s)]
    assert len(got) == len(want) == 2
    for p, w in zip(got, want, strict=True):
        torch.testing.assert_close(p.float(), w.float(), atol=1e-5, rtol=0)
