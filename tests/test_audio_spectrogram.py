"""The spectrogram an audio capture keeps for the report (metadata["spectrogram_png"]): the input
features (or a raw waveform's STFT log power) the model heard, checked against the extractor's own
features and a numpy STFT written here: same shape, low frequencies at the bottom, and the 8-bit
picture in the order of the values it draws."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

tf = pytest.importorskip("transformers")
pytest.importorskip("soundfile")
pytest.importorskip("scipy")
from PIL import Image  # noqa: E402
from test_audio import MEL_HOP, RATE, _mel_extractor, _raw_extractor, _w2v, _wave, _whisper  # noqa: E402

import probe  # noqa: E402


def _decode(png: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(png))))


def _same_order(img: np.ndarray, values: np.ndarray) -> None:
    """The picture (low rows at the bottom) is a monotone image of ``values`` [bins, columns]:
    brighter pixels never hold clearly smaller values, and the largest value is white."""
    v = values[::-1].ravel().astype(np.float64)
    p = img.ravel().astype(np.int64)
    assert img.shape == values.shape
    assert p[np.argmax(v)] == 255
    order = np.argsort(v, kind="stable")
    spread = v.max() - np.quantile(v, 0.01)
    # sorted by value, the pixels may only fall by rounding (one level) where values tie within it
    steps = np.diff(p[order])
    assert steps.min() >= -1
    hi, lo = v > np.quantile(v, 0.9), v < np.quantile(v, 0.5) - 0.05 * spread
    assert p[hi].mean() > p[lo].mean()


def test_a_whisper_capture_keeps_the_features_it_heard():
    model, fe = _whisper(), _mel_extractor()
    wave = _wave(0.6, freq=300.0)
    cache = probe.capture(model, wave, sampling_rate=RATE, processor=fe)  # decoded greedily
    feats = fe(wave, sampling_rate=RATE, return_tensors="np")["input_features"][0]  # [mel, frames]
    (png,) = cache.metadata["spectrogram_png"]
    _same_order(_decode(png), feats)
    assert cache.metadata["spectrogram_hop"] == pytest.approx(MEL_HOP / RATE)
    assert cache.metadata["spectrogram_kind"] == "input features"


def test_a_wav2vec2_capture_keeps_the_waveforms_stft():
    model = _w2v()
    wave = _wave(0.5, freq=1000.0, seed=3)
    cache = probe.capture(model, wave, sampling_rate=RATE, processor=_raw_extractor())
    x = _raw_extractor()(wave, sampling_rate=RATE, return_tensors="np")["input_values"][0].astype(np.float64)
    n, hop = 400, 160  # 25 ms windows every 10 ms at 16 kHz
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)  # periodic Hann, as torch's
    frames = np.stack([x[i : i + n] * window for i in range(0, len(x) - n + 1, hop)])
    power = np.log10(np.abs(np.fft.rfft(frames, axis=1)) ** 2 + 1e-10).T  # [bins, columns]
    (png,) = cache.metadata["spectrogram_png"]
    img = _decode(png)
    _same_order(img, power)
    # a 1 kHz tone: the brightest row of the picture is the 1 kHz bin (counted from the bottom)
    assert img.shape[0] - 1 - int(np.argmax(img.astype(float).mean(1))) == round(1000 * n / RATE)
    assert cache.metadata["spectrogram_hop"] == pytest.approx(hop / RATE)


def test_a_keyword_dict_without_a_rate_keeps_a_picture_but_no_time_step():
    model = _whisper()
    feats = torch.randn(1, 16, 100)
    cache = probe.capture(model, {"input_features": feats, "decoder_input_ids": torch.tensor([[0, 1, 2]])})
    (png,) = cache.metadata["spectrogram_png"]
    _same_order(_decode(png), feats[0].numpy())
    assert cache.metadata["spectrogram_hop"] is None
