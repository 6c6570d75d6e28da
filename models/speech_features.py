"""The speech model's front end: waveforms to Whisper-style log-mel features, and its processor.

`FeatureExtractor` does what Whisper's feature extractor does, at the zoo's size: a 400-sample
(25 ms) Hann-windowed `torch.stft` every 160 samples (10 ms; centred, reflect-padded, the last frame
dropped, so a waveform of n samples gives n // 160 frames), the power spectrum times a triangular
mel filterbank computed here (`mel_filters`: `feature_size` filters evenly spaced on the HTK mel
scale from 0 Hz to 8 kHz, each scaled to unit area as Slaney's), then `log10` (floored at 1e-10),
floored at 8 below the waveform's own maximum and mapped by `(x + 4) / 4`.

`SpeechProcessor` is called like a Hugging Face `WhisperProcessor`:
`processor(audio, sampling_rate=16000, return_tensors="pt")` -> `{"input_features": [batch,
feature_size, frames]}`: every waveform zero-padded (silence) to `chunk_length` = 6 seconds, or to
the longest of the batch when that is longer, as Whisper pads to 30 s (`padding="longest"` pads to
the longest only: the training batches' padding; the model learned to end a transcript where
the padding's silence begins, so it needs it after the speech); `processor(text=...)` ->
`{"labels": ...}`; `processor.feature_extractor` carries `sampling_rate`, `hop_length`, `n_fft`,
`feature_size` and `chunk_length`, `processor.tokenizer` the model's words.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def hz_to_mel(f):
    """HTK's mel scale: 2595 log10(1 + f / 700)."""
    return 2595.0 * np.log10(1.0 + np.asarray(f, dtype=np.float64) / 700.0)


def mel_to_hz(m):
    """The inverse of `hz_to_mel`."""
    return 700.0 * (10.0 ** (np.asarray(m, dtype=np.float64) / 2595.0) - 1.0)


def mel_filters(sampling_rate: int, n_fft: int, n_mels: int, fmax: float | None = None) -> torch.Tensor:
    """Triangular mel filters ``[n_mels, n_fft // 2 + 1]``: filter i rises from mel point i to
    i + 1 and falls to i + 2 (``n_mels + 2`` points evenly spaced in mel from 0 to ``fmax``,
    default half the sampling rate), scaled by ``2 / (f[i + 2] - f[i])`` (Slaney's unit area)."""
    fmax = sampling_rate / 2 if fmax is None else fmax
    bins = np.linspace(0, sampling_rate / 2, n_fft // 2 + 1)
    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(fmax), n_mels + 2))
    weights = np.zeros((n_mels, len(bins)))
    for i in range(n_mels):
        lo, mid, hi = edges[i], edges[i + 1], edges[i + 2]
        rise = (bins - lo) / (mid - lo)
        fall = (hi - bins) / (hi - mid)
        weights[i] = np.maximum(0.0, np.minimum(rise, fall)) * 2.0 / (hi - lo)
    return torch.tensor(weights, dtype=torch.float32)


class FeatureExtractor:
    """Waveforms (16 kHz, float) to log-mel ``input_features`` ``[batch, feature_size, frames]``."""

    def __init__(
        self,
        sampling_rate: int = 16_000,
        n_fft: int = 400,
        hop_length: int = 160,
        feature_size: int = 40,
        chunk_length: int = 6,
    ):
        self.sampling_rate = sampling_rate
        self.chunk_length = chunk_length
        self.n_samples = chunk_length * sampling_rate
        self.n_fft = n_fft
        self.hop_length = hop_length
        self.feature_size = feature_size
        self.filters = mel_filters(sampling_rate, n_fft, feature_size)
        self.window = torch.hann_window(n_fft)

    def __repr__(self) -> str:
        return (
            f"FeatureExtractor(sampling_rate={self.sampling_rate}, n_fft={self.n_fft}, hop_length="
            f"{self.hop_length}, feature_size={self.feature_size}, chunk_length={self.chunk_length})"
        )

    def log_mel(self, audio: torch.Tensor, lengths: list[int] | None = None) -> torch.Tensor:
        """``[batch, samples]`` float waveforms -> ``[batch, feature_size, samples // hop]``; each
        row floored at 8 below the maximum over its own first ``lengths[b] // hop`` frames."""
        spec = torch.stft(audio, self.n_fft, self.hop_length, window=self.window, return_complex=True)
        power = spec[..., :-1].abs() ** 2
        mel = self.filters @ power
        logs = torch.clamp(mel, min=1e-10).log10()
        lengths = [audio.shape[-1]] * audio.shape[0] if lengths is None else lengths
        top = torch.stack([logs[b, :, : max(1, n // self.hop_length)].max() for b, n in enumerate(lengths)])
        logs = torch.maximum(logs, (top - 8.0).view(-1, 1, 1))
        return (logs + 4.0) / 4.0

    def __call__(
        self,
        raw_speech,
        sampling_rate: int | None = None,
        return_tensors: str | None = "pt",
        padding: str = "max_length",
    ) -> dict:
        if sampling_rate is not None and sampling_rate != self.sampling_rate:
            raise ValueError(
                f"audio at {sampling_rate} Hz; this feature extractor takes {self.sampling_rate} Hz "
                "(resample it first)"
            )
        if return_tensors not in ("pt", None):
            raise ValueError(
                f"return_tensors={return_tensors!r}: this processor returns torch tensors ('pt')"
            )
        many = (
            isinstance(raw_speech, (list, tuple)) and len(raw_speech) > 0 and not np.isscalar(raw_speech[0])
        )
        items = [np.asarray(a, dtype=np.float32) for a in (raw_speech if many else [raw_speech])]
        if not items:
            raise ValueError("no audio given")
        for a in items:
            if a.ndim != 1:
                raise ValueError(f"a waveform is one channel of samples [samples], not {list(a.shape)}")
            if len(a) < self.n_fft:
                raise ValueError(f"a waveform of {len(a)} samples; at least {self.n_fft} are needed")
        if padding not in ("max_length", "longest"):
            raise ValueError(f"padding={padding!r}: 'max_length' (to chunk_length seconds) or 'longest'")
        longest = max(len(a) for a in items)
        if padding == "max_length":
            longest = max(longest, self.n_samples)
        batch = torch.zeros(len(items), longest)
        for b, a in enumerate(items):
            batch[b, : len(a)] = torch.from_numpy(a)
        return {"input_features": self.log_mel(batch, [len(a) for a in items])}


class SpeechProcessor:
    """The feature extractor and tokenizer together, called like ``WhisperProcessor``."""

    def __init__(self, feature_extractor: FeatureExtractor, tokenizer):
        self.feature_extractor = feature_extractor
        self.tokenizer = tokenizer

    def __repr__(self) -> str:
        return f"SpeechProcessor({self.feature_extractor!r}, {self.tokenizer!r})"

    def __call__(self, audio=None, sampling_rate: int | None = None, text=None, return_tensors="pt", **kw):
        if audio is None and text is None:
            raise ValueError("give audio= (waveforms at 16 kHz) and/or text= (transcripts)")
        out = {}
        if audio is not None:
            out.update(
                self.feature_extractor(
                    audio,
                    sampling_rate=sampling_rate,
                    return_tensors=return_tensors,
                    padding=kw.get("padding", "max_length"),
                )
            )
        if text is not None:
            texts = [text] if isinstance(text, str) else list(text)
            rows = [self.tokenizer.encode(t) + [self.tokenizer.eos_id] for t in texts]
            width = max(map(len, rows))
            labels = torch.full((len(rows), width), -100, dtype=torch.long)
            for b, r in enumerate(rows):
                labels[b, : len(r)] = torch.tensor(r)
            out["labels"] = labels
        return out

    def batch_decode(self, ids, skip_special_tokens: bool = True) -> list[str]:
        """Each row of ids as text (the special tokens left out when ``skip_special_tokens``)."""
        return [self.tokenizer.decode_words(r, skip_special_tokens) for r in ids]


def encoder_frames(n_features: int) -> int:
    """Encoder positions for ``n_features`` feature frames: the second convolution (kernel 3,
    stride 2, padding 1) halves them, rounding up."""
    return math.ceil(n_features / 2)
