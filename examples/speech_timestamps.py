"""When was each word said? The zoo's speech model on a sentence whose word timings are known.

``models.speech_data`` joins words spoken one by one by espeak-ng with silences of known length, so
every word's true start and end is known to the sample. This script captures the zoo's Whisper-
shaped ``speech`` model on one held-out sentence through its own processor (the way a Hugging Face
Whisper processor is called), lets it transcribe greedily, reads the word timestamps from its
cross-attention with ``probe.word_timestamps`` and prints them against the gold timings, twice:
refined (the default: each word's edges where its speech starts and ends, from the spectrogram the
capture kept and the attention) and Whisper's raw recipe (``refine="none"``: per-head
normalisation, median filter, dynamic time warping; contiguous words). ``--noise`` mixes white
noise in first (SNR in dB against the speech's level).

    python examples/speech_timestamps.py               # a few seconds on 2 cores
    python examples/speech_timestamps.py --seed 900007 --noise 20

``benchmarks/speech_timestamps.py`` measures the same on 60 held-out sentences, clean and in noise.
"""

from __future__ import annotations

import argparse

import numpy as np

import models
import probe
from models import speech_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=speech_data.TEST_SEEDS[5], help="which generated sentence")
    ap.add_argument("--noise", type=float, metavar="SNR_DB", help="add white noise at this SNR (dB)")
    args = ap.parse_args()

    asr = models.load("speech")
    s = speech_data.sentence(args.seed)
    audio = s.audio
    if args.noise is not None:
        speech = np.concatenate([audio[a:b] for a, b in s.spans])
        noise = np.random.default_rng(args.seed).normal(size=len(audio))
        audio = (audio + noise * np.sqrt(np.mean(speech**2) / 10 ** (args.noise / 10))).astype(np.float32)
    print(f"said: {s.text!r} ({s.seconds:.2f} s)")
    cache = probe.capture(asr, audio, processor=asr.processor, sampling_rate=speech_data.SAMPLE_RATE)
    heard = " ".join(cache.metadata["target_tokens"][0][1:])
    print(f"heard: {heard!r}")
    if heard != s.text:  # read the timings of what was said, not of what was misheard
        cache = probe.capture(
            asr, audio, processor=asr.processor, sampling_rate=speech_data.SAMPLE_RATE, target=s.text
        )
    gold = [list(zip(s.words, *zip(*s.times, strict=True), strict=True))]
    ts = probe.word_timestamps(cache)  # heads chosen without gold: against the spans the sound gives
    print(f"heads: {', '.join(f'L{layer} H{head}' for layer, head in ts.chosen)} ({ts.choice})")
    print(f"{'word':<8}{'refined':>14}{'raw':>14}{'gold':>14}")
    for r, (a, b) in zip(ts.words.rows, s.times, strict=True):
        print(
            f"{r['word']:<8}{r['start']:>8.2f}-{r['end']:.2f}{r['raw_start']:>8.2f}-{r['raw_end']:.2f}{a:>8.2f}-{b:.2f}"
        )
    scored = probe.word_timestamps(cache, heads=ts.chosen, gold=gold)
    for name, m in (("refined", scored.metrics), ("raw", scored.raw_metrics)):
        print(
            f"{name}: mean boundary error {m['mean_error_ms']:.0f} ms; within 20 / 50 / 100 ms: "
            f"{m['within_20ms']:.0%} / {m['within_50ms']:.0%} / {m['within_100ms']:.0%}"
        )


if __name__ == "__main__":
    main()
