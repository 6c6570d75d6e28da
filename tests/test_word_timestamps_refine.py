"""The refinement of word timestamps (refine="attention+energy") on hand-made sound and attention
whose true word boundaries are known to the sample: tone bursts separated by silences (and a
pause inside one word, and two words with no pause between them), their log-mel features made by
the zoo speech model's front end and kept in the metadata as the capture keeps them, and
cross-attention with a bump over each word's frames. White noise and a babble of other bursts
are added at 20 and 10 dB, so digital silence cannot pass for the boundaries.

Oracles: the burst spans written here; the speech probability's steps computed here with numpy on
a hand-made spectrogram; the raw recipe's own result (refine="none") for what the refinement
keeps; the head choice on a constructed cache where a monotone, diagonal head reads the wrong words.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import probe
from models.speech_features import FeatureExtractor
from probe.analysis.alignment import refine as refine_mod
from probe.analysis.alignment import sound
from probe.analysis.alignment.dtw import row_starts
from probe.capture.inputs.spectrogram import spectrograms

RATE, MEL_HOP, HOP = 16_000, 160, 0.02  # 10 ms feature columns, 20 ms encoder frames
SECONDS = 2.5
# four words, the gaps between them 180, 350, 80 ms; the third word holds a 30 ms pause
WORDS = ["one", "two", "three", "four"]
SPANS = [(0.30, 0.62), (0.80, 1.05), (1.40, 1.70), (1.78, 2.20)]
INSIDE = (1.52, 1.55)  # the pause inside "three" (a stop's closure)
# the window of a feature column reaches 12.5 ms each side of its centre, and a boundary is put
# half a column (5 ms) from the first or last speech column: the boundaries are exact to 20 ms
TOL = 0.02


def _bursts(spans, seconds=SECONDS, f0=150.0, amp=0.4, rng=None) -> np.ndarray:
    """A buzz (harmonics of ``f0`` up to 4 kHz, like a voice) over each span, silence elsewhere."""
    t = np.arange(int(seconds * RATE)) / RATE
    x = np.zeros_like(t)
    for a, e in spans:
        m = (t >= a) & (t < e)
        phase = 0.0 if rng is None else rng.uniform(0, 2 * np.pi)
        x[m] = sum(np.sin(2 * np.pi * k * f0 * t[m] + phase) / k for k in range(1, int(4000 / f0)))
    return amp * x / max(np.abs(x).max(), 1e-12)


def _with_noise(x: np.ndarray, kind: str, snr_db: float, seed: int = 0):
    """``(x plus the noise, the noise's voiced spans)``: white noise (no spans), or a babble (four
    other voices, each a sentence of bursts and pauses, over a faint room noise), scaled so that the
    speech's power over its bursts stands ``snr_db`` above the noise's."""
    rng = np.random.default_rng(seed)
    voiced = []
    if kind == "white":
        noise = rng.normal(size=len(x))
    else:
        noise = 0.003 * rng.normal(size=len(x))  # a faint room noise under the voices
        for _ in range(4):
            at, spans = rng.uniform(-0.3, 0.1), []
            while at < SECONDS:
                spans.append((at, at + rng.uniform(0.15, 0.35)))
                at = spans[-1][1] + rng.uniform(0.05, 0.35)
            noise += _bursts(spans, f0=rng.uniform(90, 250), rng=rng)
            voiced += spans
    speech = np.concatenate([x[int(a * RATE) : int(e * RATE)] for a, e in SPANS])
    scale = np.sqrt(np.mean(speech**2) / 10 ** (snr_db / 10) / np.mean(noise**2))
    return x + scale * noise, voiced


def _meta_sound(x: np.ndarray) -> dict:
    """The spectrogram entries a capture keeps for ``x``: the zoo front end's log-mel features."""
    fe = FeatureExtractor(chunk_length=3)
    feats = fe(x.astype(np.float32), sampling_rate=RATE, padding="longest")["input_features"]
    return spectrograms({"input_features": feats}, {fe.feature_size}, RATE, MEL_HOP)


def _frames(a: float, e: float) -> tuple[int, int]:
    return int(round(a / HOP)), int(round(e / HOP))


def _cache(x: np.ndarray, heads: dict[tuple[int, int], list[tuple[float, float]]], seed: int = 0):
    """A cache of 2 decoder layers x 3 heads over ``x``: noise everywhere but ``heads``, where the
    row that predicts word k puts a bump on the frames of the k-th span given (the row after the
    last word, on the frames after the last span)."""
    S = int(np.ceil(len(x) / MEL_HOP / 2))
    tokens = [["<s>", *[f" {w}" for w in WORDS], "</s>"]]
    T = len(tokens[0])
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        p = torch.rand(1, 3, T, S, generator=g) + 0.5
        for (lay, h), spans in heads.items():
            if lay == layer:
                p[0, h] = 0.05 * torch.rand(T, S, generator=g)
                for r, (a, e) in enumerate(spans):
                    fa, fe = _frames(a, e)
                    p[0, h, r, fa:fe] = 1.0
                p[0, h, len(spans), _frames(*spans[-1])[1] :] = 1.0
        tensors[f"decoder.blocks.{layer}.cross_attn.pattern"] = p / p.sum(-1, keepdim=True)
    frames = {"hop": HOP, "offset": 0.0, "count": S, "stride": 2, "audio": [S]}
    meta = {
        "target_tokens": tokens,
        "target_special_tokens_mask": [[int(t in ("<s>", "</s>")) for t in tokens[0]]],
        "target_attention_mask": [[1] * T],
        "stacks": {
            "encoder": {"layers": 1, "chain": True, "positions": {"kinds": ["frame"] * S, "frames": frames}},
            "decoder": {"layers": 2, "chain": True},
        },
        **_meta_sound(x),
    }
    return probe.Cache(tensors, meta)


def _spans(wt) -> list[tuple[float, float]]:
    return list(zip(wt.words.column("start"), wt.words.column("end"), strict=True))


def _assert_near(got, want, tol=TOL):
    for (a, e), (wa, we) in zip(got, want, strict=True):
        assert abs(a - wa) <= tol + 1e-9 and abs(e - we) <= tol + 1e-9, (got, want)


def _sentence() -> np.ndarray:
    three = [(SPANS[2][0], INSIDE[0]), (INSIDE[1], SPANS[2][1])]
    return _bursts([SPANS[0], SPANS[1], *three, SPANS[3]])


@pytest.mark.parametrize("noise", [None, ("white", 20), ("white", 10), ("white", 0)])
def test_refined_words_start_and_end_where_their_sound_does(noise):
    x = _sentence()
    if noise is not None:
        x, _ = _with_noise(x, *noise)
    wt = probe.word_timestamps(_cache(x, {(1, 2): SPANS}), heads=[(1, 2)])
    assert wt.refine == "attention+energy" and not wt.notes
    _assert_near(_spans(wt), SPANS)  # the pause inside "three" stays inside it
    raw = list(zip(wt.words.column("raw_start"), wt.words.column("raw_end"), strict=True))
    assert raw[0][0] == 0.0 and all(raw[k][1] == raw[k + 1][0] for k in range(3))  # contiguous
    ends, starts = wt.words.column("end"), wt.words.column("start")
    assert all(ends[k] < starts[k + 1] for k in range(3))  # not contiguous across the pauses


@pytest.mark.parametrize("seed", range(5))
def test_in_babble_a_word_moves_off_its_edge_only_over_other_voices(seed):
    # other voices 20 dB down sound like speech: one that touches a word can lengthen it (the
    # sound cannot tell them apart), but a word never loses its own sound or takes a silence
    x, voiced = _with_noise(_sentence(), "babble", 20, seed)
    wt = probe.word_timestamps(_cache(x, {(1, 2): SPANS}), heads=[(1, 2)])
    for (a, e), (wa, we) in zip(_spans(wt), SPANS, strict=True):
        assert a <= wa + TOL and e >= we - TOL
        for lo, hi in ((a, wa - TOL), (we + TOL, e)):  # what the word took beyond its own sound
            t = np.arange(lo, hi, 0.005)
            assert all(any(v0 - TOL <= u <= v1 + TOL for v0, v1 in voiced) for u in t), (lo, hi)


def test_refine_none_gives_whispers_raw_recipe_back():
    cache = _cache(_sentence(), {(1, 2): SPANS})
    raw = probe.word_timestamps(cache, heads=[(1, 2)], refine="none")
    refined = probe.word_timestamps(cache, heads=[(1, 2)])
    assert raw.refine == "none" and "raw_start" not in raw.words.columns
    assert raw.words.column("start") == refined.words.column("raw_start")
    assert raw.words.column("end") == refined.words.column("raw_end")
    # the raw recipe, written here from the dynamic time warping (tested against a plain loop):
    # each word from its row's first frame on the path to the next row's
    w = cache.pattern("decoder", 1, "cross")[
        0, 2, :5, : cache.metadata["stacks"]["encoder"]["positions"]["frames"]["count"]
    ]
    firsts = row_starts(w[None].float(), 7)
    assert _spans(raw) == [(round(firsts[k] * HOP, 6), round(firsts[k + 1] * HOP, 6)) for k in range(4)]
    with pytest.raises(probe.ProbeError, match="refine='edges': use one of 'attention\\+energy', 'none'"):
        probe.word_timestamps(cache, refine="edges")


def test_the_attention_splits_speech_that_has_no_pause():
    # "two" and "three" said without a pause: one burst from 0.80 to 1.70 s; the attention of the
    # row that predicts "three" starts at 1.24 s, so that is where the sound is cut
    spans = [SPANS[0], (0.80, 1.24), (1.24, 1.70), SPANS[3]]
    x = _bursts([SPANS[0], (0.80, 1.70), SPANS[3]])
    wt = probe.word_timestamps(_cache(x, {(0, 1): spans}), heads=[(0, 1)])
    _assert_near(_spans(wt), spans)
    assert wt.words.column("end")[1] == wt.words.column("start")[2]


def test_without_gold_the_sound_rejects_a_monotone_head_on_the_wrong_words():
    # head (0, 1) reads each word's next word (its bumps march in order, monotone and diagonal);
    # head (1, 2) reads the right ones
    shifted = [SPANS[1], SPANS[2], SPANS[3], (2.2, 2.4)]
    cache = _cache(_sentence(), {(0, 1): shifted, (1, 2): SPANS})
    blind = probe.word_timestamps(cache, refine="none")  # no sound: the shape criterion alone
    assert blind.choice == "monotone" and sorted(blind.chosen) == [(0, 1), (1, 2)]
    wt = probe.word_timestamps(cache)
    assert wt.choice == "sound" and wt.chosen == [(1, 2)]
    errors = {(r["layer"], r["head"]): r["sound_error_ms"] for r in wt.heads.rows}
    # the right head's raw words still absorb the pauses; the shifted one's sit a word late
    assert 2 * errors[(1, 2)] < errors[(0, 1)]
    _assert_near(_spans(wt), SPANS)


def test_a_cache_without_its_sound_keeps_the_raw_times_with_a_note():
    cache = _cache(_sentence(), {(1, 2): SPANS})
    meta = {k: v for k, v in cache.metadata.items() if not k.startswith("spectrogram")}
    wt = probe.word_timestamps(probe.Cache(dict(cache.items()), meta), heads=[(1, 2)])
    assert wt.refine == "none" and "kept no spectrogram" in wt.notes[0]
    assert _spans(wt) == _spans(probe.word_timestamps(cache, heads=[(1, 2)], refine="none"))


def test_speech_probability_steps_by_hand():
    # 8 bands x 60 columns: noise around 0.2 (spread known), speech in columns 20-39 raising the
    # top two bands by 0.3 and the rest by 0.05
    rng = np.random.default_rng(1)
    x = 0.2 + 0.01 * rng.standard_normal((8, 60))
    x[6:, 20:40] += 0.3
    x[:6, 20:40] += 0.05
    level = np.sort(x, axis=0)[-2:].mean(0)  # the loudest quarter: 2 of 8 bands
    noise = level <= sound.otsu(level)
    assert noise.tolist() == [c < 20 or c >= 40 for c in range(60)]
    med = np.median(x[:, noise], axis=1, keepdims=True)
    spread = np.maximum(
        1.4826 * np.median(np.abs(x[:, noise] - med), axis=1, keepdims=True), 0.01 * np.ptp(x)
    )
    score = np.sort((x - med) / spread, axis=0)[-2:].mean(0)
    np.testing.assert_allclose(sound.speech_score(x), score)
    p = sound.speech_probability(x)
    np.testing.assert_allclose(p, 1 / (1 + np.exp(-(score - 2.0) / 0.5)))
    assert (p[20:40] > 0.99).all() and np.mean(p[noise] > 0.5) < 0.1
    assert sound.speech_probability(np.full((8, 60), 0.3)) is None  # nothing quieter to measure by


def test_otsu_splits_two_clusters():
    v = np.array([0.1, 0.12, 0.11, 0.13, 0.8, 0.82, 0.79])
    thr = sound.otsu(v)
    assert 0.13 <= thr < 0.79


def test_viterbi_against_every_path_by_brute_force():
    # 2 words over 7 columns: every assignment of the states in order, scored here
    rng = np.random.default_rng(3)
    word, pause = rng.normal(size=(2, 7)), rng.normal(size=7)
    log_skip = -1.5
    best, best_path = -np.inf, None
    for a, b, c, d in np.ndindex(*(8,) * 4):  # the first column of word 1, pause 1, word 2, pause 2
        if not (a < b <= c < d <= 7):  # the words hold a column at least; the pauses may be empty
            continue
        states = [0] * a + [1] * (b - a) + [2] * (c - b) + [3] * (d - c) + [4] * (7 - d)
        em = np.vstack([pause, word[0], pause, word[1], pause])
        score = sum(em[s, k] for k, s in enumerate(states)) + (log_skip if c == b else 0.0)
        if score > best + 1e-12:
            best, best_path = score, states
    assert refine_mod.viterbi(word, pause, log_skip).tolist() == best_path
