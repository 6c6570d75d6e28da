"""The spectrogram the model heard, kept in the cache for the report to draw under the attention.

An audio capture stores, per input, a picture of its input: for a model of ``input_features``
(Whisper's log-mel frames) the features themselves, laid out ``[mel, frames]``; for a model of
raw ``input_values`` (wav2vec2, HuBERT) the log power of the waveform's short-time Fourier
transform (25 ms windows every 10 ms). Each is scaled to 8 bits between its 1st percentile and its
largest value, low frequencies at the bottom, and kept as a base64 PNG in
``metadata["spectrogram_png"]``, with ``spectrogram_hop`` (seconds per column, None when the
sampling rate is not known) and ``spectrogram_kind``. The report draws it; the one number read
from it is where the sound is speech, which :func:`probe.word_timestamps` refines word edges by
(relative levels only: :mod:`probe.analysis.alignment.sound`); every other number reads the patterns.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

WINDOW_S, HOP_S = 0.025, 0.010  # the STFT of a raw waveform: 25 ms windows every 10 ms
MAX_COLUMNS = 6000  # longer inputs keep every n-th column (the report draws at most this wide)


def _png(img: Tensor) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img.numpy()).save(buf, format="PNG", optimize=True)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _to_bytes(spec: Tensor) -> Tensor:
    """``[bins, columns]`` float to uint8, 1st percentile to the largest value, low bins at the bottom."""
    flat = spec.flatten()
    flat = flat[torch.isfinite(flat)]
    if flat.numel() == 0:
        return torch.zeros(spec.shape, dtype=torch.uint8)
    sample = flat[torch.linspace(0, flat.numel() - 1, min(flat.numel(), 100_000)).long()]
    lo, hi = torch.quantile(sample, 0.01), flat.max()
    scaled = ((spec - lo) / (hi - lo).clamp(min=1e-12)).nan_to_num(0.0).clamp(0, 1)
    return (scaled * 255).round().to(torch.uint8).flip(0)


def spectrograms(kwargs: Mapping, mel_counts: set[int], rate: int | None, hop: int | None) -> dict[str, Any]:
    """The metadata entries above for the audio in ``kwargs`` (empty when it holds none that can be
    drawn). ``mel_counts``: the feature widths the model's config declares (to tell ``[batch, mel,
    frames]`` from ``[batch, frames, mel]``); ``rate``: samples per second; ``hop``: samples per
    feature frame."""
    x = kwargs.get("input_features")
    if isinstance(x, Tensor) and x.dim() == 3 and x.is_floating_point():
        x = x.detach().float().cpu()
        if x.shape[2] in mel_counts and x.shape[1] not in mel_counts:
            x = x.transpose(1, 2)  # a conformer's [batch, frames, mel]
        kind = "input features"
        col_s = hop / rate if hop and rate else None
    else:
        x = kwargs.get("input_values")
        if not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point():
            return {}
        r = rate or 16000
        n_fft = max(8, round(WINDOW_S * r))
        step = max(1, round(HOP_S * r))
        wave = x.detach().float().cpu()
        if wave.shape[1] < n_fft:
            return {}
        window = torch.hann_window(n_fft)
        power = torch.stft(wave, n_fft, step, window=window, center=False, return_complex=True).abs() ** 2
        x = torch.log10(power + 1e-10)
        kind = "log power of the waveform (25 ms windows every 10 ms)"
        col_s = step / rate if rate else None
    every = -(-x.shape[2] // MAX_COLUMNS)
    if every > 1:
        x = x[:, :, ::every]
        col_s = col_s * every if col_s is not None else None
    return {
        "spectrogram_png": [_png(_to_bytes(s)) for s in x],
        "spectrogram_hop": col_s,
        "spectrogram_kind": kind,
    }


__all__ = ["spectrograms"]
