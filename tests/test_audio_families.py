"""A handful of audio families, built tiny and captured with ``probe.capture(model, inputs)`` on a
spectrogram or a waveform, against eager ``output_attentions`` of the same weights (and, for
WavLM, whose eager weights are the head average, against the per-head softmax written here).
The inputs are those the catalogue sweep makes from each config (``tests/catalogue_audio.py``)."""

from __future__ import annotations

import catalogue_audio as A
import catalogue_configs as K
import catalogue_inputs as I
import pytest
import torch

import probe
from probe.errors import ProbeError


def _eager(model, inputs):
    from catalogue_oracles import eager_twin

    with torch.no_grad():
        out = eager_twin(model)(**inputs, output_attentions=True)
    enc = getattr(out, "encoder_attentions", None) or out.attentions
    return (
        list(enc),
        list(getattr(out, "decoder_attentions", None) or []),
        list(getattr(out, "cross_attentions", None) or []),
    )


def _patterns(cache, stack, kind="self"):
    return [cache.pattern(stack, i, kind).float() for i in cache.layer_indices(stack)]


@pytest.mark.parametrize(
    "model_type",
    [
        "wav2vec2",
        pytest.param("hubert", marks=pytest.mark.slow),
        pytest.param("data2vec-audio", marks=pytest.mark.slow),
    ],
)
def test_waveform_encoders_against_eager(model_type):
    model = K.build(model_type)
    inputs, failed = A.audio_inputs(model)
    assert inputs is not None, failed
    assert inputs["input_values"].shape[0] == 2 and inputs["attention_mask"][1, -1] == 0
    cache = probe.capture(model, dict(inputs))
    enc, _, _ = _eager(model, inputs)
    got = _patterns(cache, "encoder")
    assert len(got) == len(enc) == model.config.num_hidden_layers
    for p, w in zip(got, enc, strict=True):
        assert p.shape[-1] >= A.FRAMES  # the feature extractor made at least 16 frames
        torch.testing.assert_close(p, w.float(), atol=1e-5, rtol=0)


def test_whisper_encoder_decoder_against_eager():
    # 2 · max_source_positions mel frames (the only length Whisper's encoder takes), decoder ids
    model = K.build("whisper")
    inputs, failed = A.audio_inputs(model)
    assert inputs is not None, failed
    x = inputs["input_features"]
    assert tuple(x.shape) == (2, model.config.num_mel_bins, 2 * model.config.max_source_positions)
    cache = probe.capture(model, dict(inputs))
    enc, dec, cross = _eager(model, inputs)
    for got, want in (
        (_patterns(cache, "encoder"), enc),
        (_patterns(cache, "decoder"), dec),
        (_patterns(cache, "decoder", "cross"), cross),
    ):
        assert len(got) == len(want) == 2
        for p, w in zip(got, want, strict=True):
            torch.testing.assert_close(p, w.float(), atol=1e-5, rtol=0)
    assert cache.pattern("decoder", 0, "cross").shape[-1] == model.config.max_source_positions


def test_wavlm_per_head_weights_from_its_direct_attention_call():
    # WavLM calls F.multi_head_attention_forward itself (no nn.MultiheadAttention): the weights are
    # recomputed per head; eager returns only their mean over the heads, so each head is checked
    # against a softmax of the scores computed here from the layer's own projections
    model = K.build("wavlm")
    inputs, _ = A.audio_inputs(model)
    seen = []
    layer = model.encoder.layers[0].attention
    h = layer.register_forward_hook(lambda m, a, kw, out: seen.append((kw or {}, a)), with_kwargs=True)
    try:
        cache = probe.capture(model, dict(inputs))
    finally:
        h.remove()
    enc, _, _ = _eager(model, inputs)
    p = cache.pattern("encoder", 0).float()
    torch.testing.assert_close(p.mean(1, keepdim=True).expand_as(p), enc[0].float(), atol=1e-5, rtol=0)
    # the first layer by hand: q·kᵀ/√d plus the gated relative position bias (WavLM's own code)
    x = seen[0][1][0]
    b, t, d = x.shape
    nh, hd = layer.num_heads, layer.head_dim
    q = (layer.q_proj(x) * hd**-0.5).view(b, t, nh, hd).transpose(1, 2)
    k = layer.k_proj(x).view(b, t, nh, hd).transpose(1, 2)
    bias = layer.compute_bias(t, t)[None].expand(b, -1, -1, -1)
    g = layer.gru_rel_pos_linear(x.view(b, t, nh, hd).transpose(1, 2)).view(b, nh, t, 2, 4).sum(-1)
    ga, gb = torch.sigmoid(g).chunk(2, dim=-1)
    gate = ga * (gb * layer.gru_rel_pos_const - 1.0) + 2.0
    kw, args = seen[0]
    mask = kw.get("attention_mask", args[1] if len(args) > 1 else None)  # 1 at real frames
    with torch.no_grad():
        s = q @ k.transpose(-1, -2) + gate * bias
        if mask is not None:
            s = s.masked_fill(mask.ne(1)[:, None, None, :], float("-inf"))
        want = s.softmax(-1)
    assert mask is not None and not mask[1].all()  # the second row's last frames are padding
    assert not torch.allclose(p[:, 0], p[:, 1])  # the heads differ: no average stored
    torch.testing.assert_close(p, want, atol=1e-5, rtol=0)


def test_sew_d_in_place_masked_softmax_is_refused_naming_the_layer():
    model = K.build("sew-d")
    inputs, _ = A.audio_inputs(model)
    with pytest.raises(ProbeError, match=r"encoder\.encoder\.layer\.0\.attention: .*modified in place"):
        probe.capture(model, dict(inputs))


def test_audio_inputs_follow_the_config():
    # a waveform long enough for 16 frames of wav2vec2's convolutions; a spectrogram layout by
    # trying [batch, mel, frames] and [batch, frames, mel] (Speech2Text takes the second)
    w2v = K.build("wav2vec2")
    assert A.takes_audio(type(w2v)) and not I.takes_pixels(type(w2v))
    x, _ = A.audio_inputs(w2v)
    n = x["input_values"].shape[1]
    frames = A._conv_length(n, w2v.config.conv_kernel, w2v.config.conv_stride)
    assert frames >= A.FRAMES > A._conv_length(n - 320, w2v.config.conv_kernel, w2v.config.conv_stride)
    s2t = K.build("speech_to_text")
    x, _ = A.audio_inputs(s2t)
    assert x["input_features"].shape[-1] == s2t.config.input_feat_per_channel
    assert "decoder_input_ids" in x
    assert not A.takes_audio(type(K.build("gpt2")))


def test_the_check_sees_a_wrong_head_behind_wavlms_averaged_eager(monkeypatch):
    # eager's head mean cannot see two heads swapped; the per-head softmaxes of the eager forward can
    import catalogue_check as C

    model = K.build("wavlm")
    inputs, _ = A.audio_inputs(model)
    assert C.check_model(model, inputs)["status"] == "exact"
    real = C.probe_patterns

    def swapped(cache):
        out = real(cache)
        label, kind, p = out[0]
        return [(label, kind, p[:, [1, 0, 2, 3]])] + out[1:]

    monkeypatch.setattr(C, "probe_patterns", swapped)
    verdict = C.check_model(model, inputs)
    assert verdict["status"] == "wrong" and "pattern 0 matches none" in verdict["reason"], verdict


def test_audio_tokens_in_the_text_as_many_as_the_audio_features():
    # Qwen2-Audio: one audio per row and as many audio tokens as its encoder makes of it (the
    # 64 frames of max_source_positions 32, pooled 2x), the forward runs, the capture is exact
    import catalogue_check as C

    model = K.build("qwen2_audio")
    assert A.takes_audio_text(type(model)) and not A.takes_audio(type(model))
    inputs, failed = A.audio_text_inputs(model)
    assert inputs is not None, failed
    n = (inputs["input_ids"] == model.config.audio_token_index).sum(1)
    assert n.tolist() == [model.config.audio_config.max_source_positions // 2] * 2
    assert C.check_model(model, inputs)["status"] == "exact"
