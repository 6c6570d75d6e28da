"""Sound inputs: a Whisper-shaped model and wav2vec2/HuBERT with random weights captured from
waveforms, sound files and keyword dicts, checked against eager ``output_attentions``; each
encoder position's time span against the feature extractor's arithmetic written here; resampling;
the transcript as decoder inputs; bad inputs (one line each, no file left behind)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
tf = pytest.importorskip("transformers")
sf = pytest.importorskip("soundfile")
pytest.importorskip("scipy")

from hf_fixtures import bpe_tokenizer  # noqa: E402

import probe  # noqa: E402

RATE = 16000
MEL_HOP = 160
MELS = 16
MAX_SOURCE = 50  # encoder positions: 2 * 50 = 100 mel frames = 1 s at 16 kHz


def _wave(seconds: float, freq: float = 440.0, rate: int = RATE, seed: int = 0) -> np.ndarray:
    t = np.arange(int(round(seconds * rate))) / rate
    noise = np.random.default_rng(seed).normal(scale=0.05, size=t.shape)
    return (0.5 * np.sin(2 * np.pi * freq * t) + noise).astype(np.float32)


def _whisper(vocab: int = 320, start: int = 0, attn: str = "eager"):
    cfg = tf.WhisperConfig(
        vocab_size=vocab,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=MELS,
        max_source_positions=MAX_SOURCE,
        max_target_positions=32,
        pad_token_id=start,
        bos_token_id=start,
        eos_token_id=start,
        decoder_start_token_id=start,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    return tf.WhisperForConditionalGeneration(cfg).eval()


def _mel_extractor():
    return tf.WhisperFeatureExtractor(
        feature_size=MELS, sampling_rate=RATE, hop_length=MEL_HOP, chunk_length=1, n_fft=400
    )


def _w2v(family: str = "wav2vec2", attn: str = "eager"):
    config_cls, model_cls = {
        "wav2vec2": (tf.Wav2Vec2Config, tf.Wav2Vec2Model),
        "hubert": (tf.HubertConfig, tf.HubertModel),
    }[family]
    cfg = config_cls(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(16, 16, 16),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        attn_implementation=attn,
    )
    torch.manual_seed(1)
    return model_cls(cfg).eval()


def _raw_extractor():
    return tf.Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=RATE, padding_value=0.0, do_normalize=True, return_attention_mask=True
    )


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return bpe_tokenizer(tmp_path_factory.mktemp("tok"), vocab=300)


# --- Whisper-shaped ------------------------------------------------------------------------------


def test_whisper_waveform_with_transcript_matches_eager(tok):
    model = _whisper(start=tok.eos_token_id)
    fe = _mel_extractor()
    wave = _wave(0.6)
    cache = probe.capture(model, wave, sampling_rate=RATE, processor=fe, tokenizer=tok, target="the model")
    meta = cache.metadata
    labels = tok("the model").input_ids
    assert meta["target_ids"] == [[tok.eos_token_id, *labels]]
    assert meta["target_source"] == "given"
    feats = fe(wave, sampling_rate=RATE, return_tensors="pt").input_features
    with torch.no_grad():
        out = model(
            input_features=feats,
            decoder_input_ids=torch.tensor(meta["target_ids"]),
            output_attentions=True,
        )
    for layer in range(2):
        torch.testing.assert_close(
            cache.pattern("encoder", layer), out.encoder_attentions[layer], rtol=0, atol=0
        )
        torch.testing.assert_close(
            cache.pattern("decoder", layer), out.decoder_attentions[layer], rtol=0, atol=0
        )
        cross = cache.pattern("decoder", layer, "cross")
        torch.testing.assert_close(cross, out.cross_attentions[layer], rtol=0, atol=0)
    # frames: the mel hop (160 samples at 16 kHz) times conv2's stride 2, from 0 s
    frames = meta["stacks"]["encoder"]["positions"]["frames"]
    assert frames["hop"] == pytest.approx(2 * MEL_HOP / RATE)
    assert frames["count"] == MAX_SOURCE and frames["stride"] == 2
    assert frames["convolutions"] == ["model.encoder.conv1", "model.encoder.conv2"]
    # 0.6 s = 9600 samples = 60 mel frames, through conv1 (k3 s1 p1) and conv2 (k3 s2 p1): 30
    assert frames["audio"] == [(60 + 2 - 3) // 2 + 1]
    assert meta["tokens"][0][23] == "0.46 s"
    assert meta["stacks"]["encoder"]["positions"]["kinds"] == ["frame"] * MAX_SOURCE


def test_whisper_sdpa_matches_its_eager_twin_and_align_reads_it(tok):
    model = _whisper(start=tok.eos_token_id, attn="sdpa")
    twin = _whisper(start=tok.eos_token_id, attn="eager")
    feats = _mel_extractor()(_wave(1.0), sampling_rate=RATE, return_tensors="pt").input_features
    ids = torch.tensor([[tok.eos_token_id, *tok("one two three").input_ids]])
    cache = probe.capture(model, {"input_features": feats, "decoder_input_ids": ids}, tokenizer=tok)
    with torch.no_grad():
        out = twin(input_features=feats, decoder_input_ids=ids, output_attentions=True)
    for layer in range(2):
        torch.testing.assert_close(cache.pattern("decoder", layer, "cross"), out.cross_attentions[layer])
    tokens = cache.metadata["target_tokens"][0]
    assert tokens[0] == "<|endoftext|>" and "".join(tokens[1:]) == "one two three"
    # without a processor the mel hop is unknown: positions are numbered frames
    assert cache.metadata["tokens"][0][:2] == ["frame 0", "frame 1"]
    al = probe.align(cache)  # the decoder's tokens are known now: no "no target tokens"
    assert [w for w in al.target[0].words] == ["one", "two", "three"]
    assert len(al.source[0].words) == MAX_SOURCE
    with pytest.raises(probe.ProbeError, match="no time in seconds"):
        probe.word_timestamps(cache)
    with_fe = probe.capture(
        model, {"input_features": feats, "decoder_input_ids": ids}, tokenizer=tok, processor=_mel_extractor()
    )
    wt = probe.word_timestamps(with_fe, refine="none")  # Whisper's raw recipe: whole frames
    assert wt.words.column("word") == ["one", "two", "three"]
    starts, ends = wt.words.column("start"), wt.words.column("end")
    assert starts[0] == 0.0 and all(a <= b for a, b in zip(starts, ends, strict=True))
    assert all(round(s / 0.02, 6).is_integer() for s in starts + ends)  # whole frames


def test_whisper_greedy_transcript_when_no_target():
    model = _whisper()
    cache = probe.capture(model, _wave(0.5), sampling_rate=RATE, processor=_mel_extractor())
    meta = cache.metadata
    assert meta["target_source"] == "greedy"
    assert meta["target_ids"][0][0] == 0 and len(meta["target_ids"][0]) >= 1


def test_resampled_to_the_processors_rate(tmp_path, tok):
    from scipy.signal import resample_poly

    model = _whisper(start=tok.eos_token_id)
    fe = _mel_extractor()
    wave8k = _wave(0.5, rate=8000)
    cache = probe.capture(model, wave8k, sampling_rate=8000, processor=fe, tokenizer=tok, target="one")
    want = fe(resample_poly(wave8k, 2, 1).astype(np.float32), sampling_rate=RATE, return_tensors="pt")
    ids = torch.tensor(cache.metadata["target_ids"])
    with torch.no_grad():
        out = model(input_features=want.input_features, decoder_input_ids=ids, output_attentions=True)
    torch.testing.assert_close(cache.pattern("encoder", 0), out.encoder_attentions[0], rtol=0, atol=0)
    assert cache.metadata["audio_samples"] == [8000]
    # the same from a file at 8 kHz
    path = tmp_path / "a.wav"
    sf.write(path, wave8k, 8000, subtype="FLOAT")
    from_file = probe.capture(model, str(path), processor=fe, tokenizer=tok, target="one")
    torch.testing.assert_close(from_file.pattern("encoder", 0), out.encoder_attentions[0], rtol=0, atol=0)
    assert from_file.metadata["audio"] == ["a.wav"]


# --- wav2vec2 / HuBERT ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["wav2vec2", "hubert"])
def test_raw_waveform_models_match_eager_and_frames(family):
    model = _w2v(family)
    fe = _raw_extractor()
    waves = [_wave(0.1, seed=1), _wave(0.0725, freq=220, seed=2)]
    cache = probe.capture(model, waves, sampling_rate=RATE, processor=fe)
    batch = fe(waves, sampling_rate=RATE, return_tensors="pt", padding="longest")
    with torch.no_grad():
        out = model(**batch, output_attentions=True)
    for layer in range(2):
        torch.testing.assert_close(cache.pattern("encoder", layer), out.attentions[layer], rtol=0, atol=0)
    frames = cache.metadata["stacks"]["encoder"]["positions"]["frames"]
    # conv strides 5 * 2 * 2 = 20 samples per position; kernels 10, 3, 3 without padding
    assert frames["stride"] == 20 and frames["hop"] == pytest.approx(20 / RATE)
    assert frames["receptive_field"] == [0, 10 + 2 * 5 + 2 * 10]

    def out_len(n):
        for k, s in ((10, 5), (3, 2), (3, 2)):
            n = (n - k) // s + 1
        return n

    assert frames["count"] == out_len(1600) == out.attentions[0].shape[-1]
    assert frames["audio"] == [out_len(1600), out_len(1160)]
    assert cache.metadata["tokens"][0][:4] == ["0.00000 s", "0.00125 s", "0.00250 s", "0.00375 s"]


@pytest.mark.slow  # about 24 s on two cores: CI's slow job runs it (the default pytest keeps to ~15 min)
def test_raw_waveform_without_processor_and_from_a_file(tmp_path):
    model = _w2v("wav2vec2", attn="sdpa")
    twin = _w2v("wav2vec2")
    wave = _wave(0.1)
    path = tmp_path / "one.flac"
    sf.write(path, wave, RATE)
    read, _ = sf.read(path, dtype="float32")
    cache = probe.capture(model, str(path), sampling_rate=RATE)
    with torch.no_grad():
        out = twin(input_values=torch.from_numpy(read)[None], output_attentions=True)
    torch.testing.assert_close(cache.pattern("encoder", 1), out.attentions[1])
    assert "unnormalised" in cache.metadata["audio_note"]
    stats = probe.head_stats(model, {"input_values": torch.from_numpy(read)[None]}, progress=False)
    assert len(stats.table) == 2 * 4


def test_trace_names_frames():
    model = _w2v("hubert")
    x = torch.from_numpy(_wave(0.1))[None]
    with probe.trace(model, metadata={"sampling_rate": RATE}) as t:
        model(input_values=x)
    frames = t.cache.metadata["stacks"]["encoder"]["positions"]["frames"]
    assert frames["hop"] == pytest.approx(20 / RATE)
    assert t.cache.metadata["tokens"][0][1] == "0.00125 s"


# --- bad inputs ----------------------------------------------------------------------------------


def test_bad_audio_inputs(tmp_path):
    model = _whisper()
    fe = _mel_extractor()
    w2v = _w2v()
    mels80 = tf.WhisperFeatureExtractor(
        feature_size=80, sampling_rate=RATE, hop_length=MEL_HOP, chunk_length=1
    )
    long = tf.WhisperFeatureExtractor(
        feature_size=MELS, sampling_rate=RATE, hop_length=MEL_HOP, chunk_length=2
    )
    feats200 = long(_wave(0.1), sampling_rate=RATE, return_tensors="pt").input_features  # 200 frames
    ids = torch.tensor([[0, 5, 6]])
    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, np.float32), RATE)
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"not a sound file at all")
    cases = [
        (lambda: probe.capture(model, _wave(0.1), processor=fe), "give sampling_rate="),
        (lambda: probe.capture(model, _wave(0.1), sampling_rate=0, processor=fe), "positive integer"),
        (lambda: probe.capture(model, str(empty), processor=fe), "holds no samples"),
        (lambda: probe.capture(model, str(junk), processor=fe), "cannot read"),
        (lambda: probe.capture(model, str(tmp_path / "none.wav"), processor=fe), "no such file"),
        (lambda: probe.capture(model, np.zeros(0, np.float32), sampling_rate=RATE, processor=fe), "empty"),
        (lambda: probe.capture(model, _wave(0.1), sampling_rate=RATE), "give processor="),
        (lambda: probe.capture(model, "hello", sampling_rate=RATE), "sampling_rate= is for sound"),
        (
            lambda: probe.capture(w2v, _wave(0.1), sampling_rate=RATE, processor=fe),
            "does not take; give the processor",
        ),
        (
            lambda: probe.capture(model, _wave(0.1), sampling_rate=RATE, processor=_raw_extractor()),
            "does not take",
        ),
        (lambda: probe.capture(model, _wave(0.1), sampling_rate=RATE, processor=mels80), "80 channels"),
        (
            lambda: probe.capture(model, {"input_features": feats200, "decoder_input_ids": ids}),
            "refused these inputs",
        ),
        (lambda: probe.capture(model, _wave(0.1), sampling_rate=RATE, processor=fe, target="x"), "tokenizer"),
        (lambda: probe.capture(w2v, _wave(0.1), sampling_rate=RATE, target="x"), "not an encoder-decoder"),
    ]
    wave8k = tmp_path / "low.wav"
    sf.write(wave8k, _wave(0.1, rate=8000), 8000)
    cases.append((lambda: probe.capture(w2v, str(wave8k), sampling_rate=RATE), "does not resample"))
    for run, match in cases:
        out = tmp_path / "never.safetensors"
        with pytest.raises(probe.ProbeError, match=match) as e:
            run()
        assert "\n" not in str(e.value)
        assert not out.exists()
    # a file output refused before anything is written
    with pytest.raises(probe.ProbeError):
        probe.capture(model, str(junk), processor=fe, out=tmp_path / "run.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.wav", "junk.wav", "low.wav"]


# --- the command line ----------------------------------------------------------------------------


def test_cli_capture_and_report_audio(tmp_path, tok, capsys):
    from probe.cli import main

    model = _whisper(start=tok.eos_token_id)
    folder = tmp_path / "whisper"
    model.save_pretrained(folder)
    _mel_extractor().save_pretrained(folder)
    tok.save_pretrained(folder)
    wave = _wave(0.5)
    sf.write(tmp_path / "talk.wav", wave, RATE, subtype="FLOAT")
    out = tmp_path / "talk.safetensors"
    args = ["capture", "--hf", str(folder), "--audio", str(tmp_path / "talk.wav")]
    assert main([*args, "--target", "one two", "-o", str(out)]) == 0
    cache = probe.load(out)
    feats = _mel_extractor()(wave, sampling_rate=RATE, return_tensors="pt").input_features
    ids = torch.tensor(cache.metadata["target_ids"])
    with torch.no_grad():
        want = model(input_features=feats, decoder_input_ids=ids, output_attentions=True)
    torch.testing.assert_close(cache.pattern("decoder", 1, "cross"), want.cross_attentions[1])
    assert cache.metadata["audio"] == ["talk.wav"] and cache.metadata["tokens"][0][1] == "0.02 s"
    # refused in one line, exit 2, before any model loads or file is written
    capsys.readouterr()
    bad = tmp_path / "bad.safetensors"
    assert main([*args, "some text", "-o", str(bad)]) == 2
    assert "--audio takes no TEXT" in capsys.readouterr().err
    assert main(["capture", "--hf", str(folder), "--audio", str(tmp_path / "none.wav"), "-o", str(bad)]) == 2
    assert "no such file" in capsys.readouterr().err
    assert not bad.exists()
    report = tmp_path / "report"
    assert main(["report", *args[1:], "--target", "one two", "-o", str(report)]) == 0
    assert (report / "index.html").is_file()


def test_keep_stats_of_sound_matches_the_whole_capture():
    model = _w2v("hubert", attn="sdpa")
    wave = _wave(0.1)
    stats = probe.capture(model, wave, sampling_rate=RATE, keep="stats")
    full = probe.capture(model, wave, sampling_rate=RATE)
    frames = stats.metadata["stacks"]["encoder"]["positions"]["frames"]
    assert frames == full.metadata["stacks"]["encoder"]["positions"]["frames"]
    a = probe.head_stats(stats, progress=False).table.column("entropy")
    b = probe.head_stats(full, progress=False, rollout=False).table.column("entropy")
    assert np.allclose(a, b, atol=1e-4)


def test_trace_of_whisper_records_the_transcript(tok):
    model = _whisper(start=tok.eos_token_id)
    feats = _mel_extractor()(_wave(0.3), sampling_rate=RATE, return_tensors="pt").input_features
    ids = torch.tensor([[tok.eos_token_id, *tok("one two").input_ids]])
    with probe.trace(model, metadata={"sampling_rate": RATE, "feature_hop": MEL_HOP}) as t:
        model(input_features=feats, decoder_input_ids=ids)
    meta = t.cache.metadata
    assert meta["target_ids"] == ids.tolist() and meta["tokens"][0][23] == "0.46 s"
    wt = probe.word_timestamps(t.cache, heads=[(1, 0), (1, 3)])
    # no tokenizer inside a trace: each text token is spelled by its id, a word of its own
    assert wt.words.column("word") == [str(i) for i in ids[0, 1:].tolist()] and wt.chosen == [(1, 0), (1, 3)]
