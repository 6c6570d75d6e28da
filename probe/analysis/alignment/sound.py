"""Where the sound is speech: a voice-activity curve read from the spectrogram a capture keeps.

An audio capture keeps, per input, the picture of what the model heard (``metadata
["spectrogram_png"]``: a log spectrogram such as Whisper's log-mel features, 8 bits between its 1st
percentile and its largest value; ``spectrogram_hop`` seconds per column, column ``c`` standing for
the time ``c * hop``, its window's centre). :func:`spectrogram` reads it back over the columns that
hold the input's audio (the trailing columns of a padded window, every band at the picture's
floor, are left out). Its values are logarithms of power in an unknown unit, so everything here
compares them with each other:

1. each column's *level*: the mean of its loudest quarter of bands (a fricative's energy sits in
   a few high bands, a vowel's in many);
2. the *noise class*: the columns whose level is at most the threshold of Otsu's method (the
   split of the levels into two classes with the largest between-class variance), and at least
   the quietest :data:`NOISE_SHARE` of them (a few columns of near silence before a babble
   starts do not stand for the babble), so a recording with background noise measures its noise,
   and one in digital silence measures that;
3. per band, the noise's median and spread (1.4826 times the median absolute deviation: the
   standard deviation of Gaussian noise), the spread at least :data:`SPREAD_FLOOR` of the
   picture's range (digital silence has none);
4. each column's *score*: the mean, over its loudest quarter of bands, of how many spreads each
   stands above the noise's median (a z-score per band, so a weak fricative in quiet high bands
   counts as much as a vowel over loud low ones);
5. the probability that the column is speech: a logistic curve of the score, centred on
   :data:`THRESHOLD_Z` spreads, of slope :data:`SLOPE_Z`.

It assumes that part of each input is not speech (a pause, a lead-in: its quietest part stands
for the noise); on an input that is speech from end to end, its quietest speech does.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

import numpy as np

THRESHOLD_Z = 2.0  # a column is speech from this many noise spreads above the noise (p = 0.5)
SLOPE_Z = 0.5  # the logistic curve's scale, in spreads
TOP_SHARE = 0.25  # the loudest quarter of bands makes a column's level and score
SPREAD_FLOOR = 0.01  # a band's noise spread is at least this share of the picture's range
NOISE_SHARE = 0.2  # the noise class holds at least the quietest fifth of the columns
OTSU_BINS = 64


@dataclass
class Sound:
    """One input's spectrogram ``values`` ``[bands, columns]`` (0..1, low bands first) over its
    audio, ``hop`` seconds per column."""

    values: np.ndarray
    hop: float


def _decode(png: str) -> np.ndarray | None:
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(base64.b64decode(png, validate=True)))
        a = np.asarray(img.convert("L"), dtype=np.float64) / 255.0
    except (binascii.Error, UnidentifiedImageError, OSError, ValueError):
        return None
    return a[::-1]  # the picture has its low bands at the bottom


def spectrogram(meta: dict[str, Any], b: int, seconds: float) -> Sound | None:
    """Input ``b``'s spectrogram from the cache ``meta`` over its first ``seconds`` of audio, or
    None when the cache kept none (or none with a time step)."""
    pngs = meta.get("spectrogram_png") or []
    hop = meta.get("spectrogram_hop")
    if b >= len(pngs) or not hop or hop <= 0:
        return None
    x = _decode(pngs[b])
    if x is None or x.ndim != 2 or x.shape[1] == 0:
        return None
    x = x[:, : max(1, int(round(seconds / hop)))]
    loud = np.flatnonzero(x.max(0) > x.min())
    if loud.size == 0:
        return None
    return Sound(x[:, : loud[-1] + 1], float(hop))


def otsu(values: np.ndarray, bins: int = OTSU_BINS) -> float:
    """Otsu's threshold of ``values``: the histogram split with the largest between-class
    variance (values at most the threshold are the lower class)."""
    counts, edges = np.histogram(values, bins=bins)
    w = counts / max(1, counts.sum())
    centres = (edges[:-1] + edges[1:]) / 2
    w0 = np.cumsum(w)[:-1]
    m0 = np.cumsum(w * centres)[:-1]
    total = float((w * centres).sum())
    w1 = 1.0 - w0
    with np.errstate(divide="ignore", invalid="ignore"):
        between = np.where((w0 > 0) & (w1 > 0), (total * w0 - m0) ** 2 / (w0 * w1), -1.0)
    return float(edges[int(np.argmax(between)) + 1])


def _top_mean(x: np.ndarray) -> np.ndarray:
    k = max(1, int(np.ceil(x.shape[0] * TOP_SHARE)))
    return np.sort(x, axis=0)[-k:].mean(0)


def speech_score(values: np.ndarray) -> np.ndarray | None:
    """Steps 1-4 of the module docstring: each column's score in noise spreads, or None when the
    sound has no quieter part to measure the noise by (every column equally loud)."""
    level = _top_mean(values)
    if level.max() - level.min() <= 0:
        return None
    noise = level <= max(otsu(level), float(np.quantile(level, NOISE_SHARE)))
    if noise.sum() < 2 or noise.all():
        return None
    quiet = values[:, noise]
    median = np.median(quiet, axis=1, keepdims=True)
    spread = 1.4826 * np.median(np.abs(quiet - median), axis=1, keepdims=True)
    spread = np.maximum(spread, SPREAD_FLOOR * max(float(values.max() - values.min()), 1e-12))
    return _top_mean((values - median) / spread)


def speech_probability(values: np.ndarray) -> np.ndarray | None:
    """Per column of ``values`` ``[bands, columns]`` the probability that it is speech (the module
    docstring), or None as :func:`speech_score` says."""
    score = speech_score(values)
    if score is None:
        return None
    return 1.0 / (1.0 + np.exp(-(score - THRESHOLD_Z) / SLOPE_Z))


__all__ = [
    "NOISE_SHARE",
    "SLOPE_Z",
    "SPREAD_FLOOR",
    "THRESHOLD_Z",
    "TOP_SHARE",
    "Sound",
    "otsu",
    "speech_probability",
    "speech_score",
    "spectrogram",
]
