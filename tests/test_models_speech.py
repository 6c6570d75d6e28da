"""models.speech, models.speech_features and models.speech_data: the synthesized sentences and their
known word boundaries, the log-mel front end, the shipped checkpoint, and probe's capture of it
(issue 32, item 3).

Oracles: the sentence rebuilt here from the bundled word sounds at the spans it reports (what is
left is the white noise alone); transformers' own `mel_filter_bank` and `spectrogram` (what its
Whisper feature extractor runs) for the front end; the attention weights recomputed here from the
query/key projections each attention module computed (forward hooks), with the causal mask written
here for the decoder's self-attention.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import models
import probe
from models import speech, speech_data
from models.speech_features import FeatureExtractor, mel_filters

TOL = 1e-6


@pytest.fixture(scope="module")
def model():
    return models.load("speech")


# -- the data -----------------------------------------------------------------------------------------
def _rebuilt(s: speech_data.Sentence, spans=None) -> tuple[float, np.ndarray]:
    """(gain, residual): the bundled sounds placed at `spans`, scaled by least squares, taken away."""
    sounds = speech_data.word_sounds()
    placed = np.zeros(len(s.audio), np.float64)
    for w, (a, b) in zip(s.words, spans or s.spans, strict=True):
        placed[a:b] = sounds[w]
    gain = float(placed @ s.audio / (placed @ placed))
    return gain, s.audio - gain * placed


def test_word_boundaries_are_where_the_sounds_were_placed():
    for seed in (0, 7, 900_003):
        s = speech_data.sentence(seed)
        gain, residual = _rebuilt(s)
        assert 0.6 <= gain <= 1.0
        assert float(residual.std()) < speech_data.NOISE * 1.05  # white noise, nothing else
        # one sample off and the words no longer cancel: the spans are exact to the sample
        _, off = _rebuilt(s, [(a + 1, b + 1) for a, b in s.spans])
        assert float(off.std()) > 5 * speech_data.NOISE
        rate = speech_data.SAMPLE_RATE
        starts = [a for a, _ in s.spans]
        ends = [b for _, b in s.spans]
        assert 0.10 * rate <= starts[0] <= 0.40 * rate
        for end, nxt in zip(ends, starts[1:], strict=False):
            assert 0.05 * rate <= nxt - end <= 0.35 * rate
        assert 0.10 * rate <= len(s.audio) - ends[-1] <= 0.30 * rate
        assert s.times[0] == (starts[0] / rate, ends[0] / rate) and s.text == " ".join(s.words)
        assert 3 <= len(s.words) <= 6 and set(s.words) <= set(speech_data.WORDS)


def test_sentences_are_deterministic_and_test_seeds_are_held_out():
    a, b = speech_data.sentence(42), speech_data.sentence(42)
    assert a.words == b.words and a.spans == b.spans and np.array_equal(a.audio, b.audio)
    assert speech_data.sentence(43).text != a.text or speech_data.sentence(43).spans != a.spans
    steps, batch = 2000, 32  # the shipped recipe's
    last = speech_data.train_seed(steps, batch - 1)
    assert last < min(speech_data.TEST_SEEDS) and len(set(speech_data.TEST_SEEDS)) == 60


def test_espeak_synthesis_is_deterministic_and_matches_the_bundle():
    from safetensors import safe_open

    one, two = speech_data.synthesize("seven"), speech_data.synthesize("seven")
    assert np.array_equal(one, two) and one.dtype == np.float32
    assert abs(one[0]) > speech_data.TRIM and abs(one[-1]) > speech_data.TRIM  # trimmed to audible
    bundled = speech_data.word_sounds()["seven"]
    with safe_open(str(speech_data.BUNDLE), framework="np") as f:
        made_with = f.metadata()["espeak"].strip('"')
    if made_with == speech_data.espeak_version():
        assert len(one) == len(bundled) and float(np.abs(one - bundled).max()) <= 1 / 32767
    else:  # another espeak-ng release speaks a little differently
        assert abs(len(one) - len(bundled)) < 0.25 * len(bundled)


# -- the front end --------------------------------------------------------------------------------------
def test_mel_filters_match_transformers():
    from transformers.audio_utils import mel_filter_bank

    want = mel_filter_bank(201, 40, 0.0, 8000.0, 16_000, norm="slaney", mel_scale="htk")  # [201, 40]
    torch.testing.assert_close(mel_filters(16_000, 400, 40), torch.tensor(want.T, dtype=torch.float32))


def test_log_mel_matches_transformers_spectrogram():
    from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

    s = speech_data.sentence(5)
    fe = FeatureExtractor()
    got = fe(s.audio, sampling_rate=16_000)["input_features"][0]
    filters = mel_filter_bank(201, 40, 0.0, 8000.0, 16_000, norm="slaney", mel_scale="htk")
    spec = spectrogram(
        s.audio.astype(np.float64),
        window_function(400, "hann"),
        400,
        160,
        power=2.0,
        mel_filters=filters,
        log_mel="log10",
        dtype=np.float64,
    )[:, :-1]  # Whisper drops the last frame
    spec = np.maximum(spec, spec.max() - 8.0)
    want = torch.tensor((spec + 4.0) / 4.0, dtype=torch.float32)
    n = len(s.audio) // 160
    longest = fe(s.audio, sampling_rate=16_000, padding="longest")["input_features"][0]
    assert longest.shape == (40, n) == want.shape and got.shape == (40, 6 * 16_000 // 160)
    torch.testing.assert_close(longest, want, atol=2e-4, rtol=0)
    # zero-padded to 6 s (Whisper pads to 30 s): the audio's own frames unchanged but the last two,
    # whose windows reach into the padding; the padding's frames at the floor, 8 below the maximum
    torch.testing.assert_close(got[:, : n - 2], want[:, : n - 2], atol=2e-4, rtol=0)
    torch.testing.assert_close(got[:, n + 2 :], torch.full_like(got[:, n + 2 :], float(want.max()) - 2.0))
    both = fe([s.audio, speech_data.sentence(6).audio])["input_features"]
    torch.testing.assert_close(both[0], got, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="audio at 22050 Hz; this feature extractor takes 16000 Hz"):
        fe(s.audio, sampling_rate=22_050)


# -- the model ------------------------------------------------------------------------------------------
def test_forward_shapes_and_wrong_inputs():
    m = speech.build().eval()
    enc = m.encoder
    assert enc.conv1.stride == (1,) and enc.conv2.stride == (2,) and enc.conv2.kernel_size == (3,)
    with torch.no_grad():
        assert enc(torch.randn(2, 40, 101)).shape == (2, 51, 64)
        assert m(torch.randn(2, 40, 100), torch.ones(2, 5, dtype=torch.long)).shape == (2, 5, 27)
    with pytest.raises(ValueError, match=r"input_features of \[2, 80, 100\]; it takes \[batch, 40, frames\]"):
        m(torch.randn(2, 80, 100), torch.ones(2, 3, dtype=torch.long))
    size = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    assert models.checkpoint_bytes("speech") == size < 2_000_000


def test_the_shipped_checkpoint_transcribes_held_out_sentences(model):
    assert not model.training and model.name == "speech" and model.is_encoder_decoder
    assert model.train_info["steps"] == model.train_info["recipe"]["steps"] == 2000
    test = speech_data.test_set()[:8]
    said = model.transcribe([s.audio for s in test])
    assert sum(a == s.text for a, s in zip(said, test, strict=True)) >= 7
    assert model.tokenizer.decode_words([1, *model.tokenizer.encode("red cat"), 2]) == "red cat"


def test_training_is_deterministic():
    tiny = speech.Config(d_model=16, n_head=2, n_enc_layer=1, n_dec_layer=1, d_ff=32)
    first, stats = speech.train(tiny, steps=2, batch_size=3, warmup=1)
    second, _ = speech.train(tiny, steps=2, batch_size=3, warmup=1)
    assert stats.steps == 2 and len(stats.losses) == 2
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name]), name


# -- probe sees a speech model ------------------------------------------------------------------------------
def _weights_by_hook(model, feats, ids):
    """{(stack, layer, kind): [B, heads, T, S]} recomputed here from each attention module's
    query and key projections (hooks), softmax(q k^T / sqrt(d_head)), causal for the decoder's
    self-attention."""
    seen = {}
    handles = []
    for stack in ("encoder", "decoder"):
        for i, layer in enumerate(getattr(model, stack).layers):
            for kind in ("self_attn", "cross_attn"):
                attn = getattr(layer, kind, None)
                if attn is None:
                    continue
                for proj in ("query", "key"):
                    handles.append(
                        getattr(attn, proj).register_forward_hook(
                            lambda m, a, out, k=(stack, i, kind, proj): seen.__setitem__(k, out.detach())
                        )
                    )
    try:
        with torch.no_grad():
            model(feats, ids)
    finally:
        for h in handles:
            h.remove()
    H = model.config.n_head
    out = {}
    for stack, i, kind, proj in seen:
        if proj != "query":
            continue
        q, k = seen[(stack, i, kind, "query")], seen[(stack, i, kind, "key")]
        B, T, C = q.shape
        S = k.shape[1]
        q = q.view(B, T, H, C // H).transpose(1, 2)
        k = k.view(B, S, H, C // H).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(C // H)
        if stack == "decoder" and kind == "self_attn":
            scores = scores.masked_fill(torch.ones(T, S, dtype=torch.bool).triu(1), float("-inf"))
        out[(stack, i, "cross" if kind == "cross_attn" else "self")] = torch.softmax(scores, -1)
    return out


def test_capture_is_exact_encoder_decoder_and_cross(model):
    test = speech_data.test_set()[:2]
    feats = model.processor([s.audio for s in test])["input_features"]
    rows = [[1, *model.tokenizer.encode(s.text)] for s in test]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    cache = probe.capture(model, {"input_features": feats, "decoder_input_ids": ids})
    want = _weights_by_hook(model, feats, ids)
    assert cache.stacks == ["encoder", "decoder"] and len(want) == 9
    for (stack, layer, kind), w in want.items():
        got = cache.pattern(stack, layer, kind) if kind == "cross" else cache.pattern(stack, layer)
        torch.testing.assert_close(got, w, atol=TOL, rtol=0)
    assert cache.pattern("encoder", 0).shape[-1] == math.ceil(feats.shape[-1] / 2)


def test_capture_of_waveforms_through_the_models_processor(model):
    test = speech_data.test_set()[2:4]
    waves = [s.audio for s in test]
    greedy = probe.capture(model, waves, processor=model.processor, sampling_rate=16_000)
    assert greedy.metadata["target_source"] == "greedy"
    assert greedy.metadata["target_tokens"] == [["<s>", *s.words] for s in test]
    given = probe.capture(
        model, waves, processor=model.processor, sampling_rate=16_000, target=[s.text for s in test]
    )
    assert given.metadata["target_tokens"] == greedy.metadata["target_tokens"]
    frames = given.metadata["stacks"]["encoder"]["positions"]["frames"]
    # 160 samples per feature frame, the second convolution's stride 2: 20 ms per position
    assert frames["hop"] == 0.02 and frames["audio"] == [math.ceil(len(w) // 160 / 2) for w in waves]
    feats = model.processor(waves)["input_features"]
    rows = [[1, *model.tokenizer.encode(s.text)] for s in test]
    ids = torch.tensor([r + [0] * (max(map(len, rows)) - len(r)) for r in rows])
    for (stack, layer, kind), w in _weights_by_hook(model, feats, ids).items():
        got = given.pattern(stack, layer, kind) if kind == "cross" else given.pattern(stack, layer)
        torch.testing.assert_close(got, w, atol=TOL, rtol=0)
    # the word timestamps read the decoder's words, not its start token
    ts = probe.word_timestamps(given, heads=[(1, 0)])
    assert [r["word"] for r in ts.words.rows] == [w for s in test for w in s.words]


def test_the_benchmarks_numbers_against_a_loop_written_here(model):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "speech_timestamps.py"
    spec = importlib.util.spec_from_file_location("speech_timestamps", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    test = speech_data.test_set()[:3]
    cache = bench.capture(model, test)
    ts = probe.word_timestamps(cache, heads=[(1, 1)], gold=bench.gold(test))
    got = bench.split(ts)
    # oracle: every word's start and end against the generator's spans, in ms, by a loop here
    starts, ends, later = [], [], []
    rows = iter(ts.words.rows)
    for s in test:
        for k, (a, b) in enumerate(s.times):
            r = next(rows)
            starts.append(abs(r["start"] - a) * 1000)
            ends.append(abs(r["end"] - b) * 1000)
            if k > 0:
                later.append(starts[-1])
    both = starts + ends
    assert got["all"]["boundaries"] == len(both) == 2 * sum(len(s.words) for s in test)
    assert got["all"]["mean_error_ms"] == pytest.approx(sum(both) / len(both), abs=0.05)
    assert got["all"]["within_50ms"] == round(sum(e <= 50 for e in both) / len(both), 3)
    assert got["ends"]["within_100ms"] == round(sum(e <= 100 for e in ends) / len(ends), 3)
    assert got["starts after the first word"]["mean_error_ms"] == pytest.approx(
        sum(later) / len(later), abs=0.05
    )
