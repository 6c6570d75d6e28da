"""When was each word said? The zoo's speech model on a sentence whose word timings are known.

``models.speech_data`` joins words spoken one by one by espeak-ng with silences of known length, so
every word's true start and end is known to the sample. This script captures the zoo's Whisper-
shaped ``speech`` model on one held-out sentence through its own processor (the way a Hugging Face
Whisper processor is called), lets it transcribe greedily, reads the word timestamps from its
cross-attention (``probe.word_timestamps``: Whisper's recipe, per-head normalisation, median
filter, dynamic time warping, on the monotone heads it chooses itself) and prints them against the
gold timings.

    python examples/speech_timestamps.py               # a few seconds on 2 cores
    python examples/speech_timestamps.py --seed 900007

``benchmarks/speech_timestamps.py`` measures the same on 60 held-out sentences, per head.
"""

from __future__ import annotations

import argparse

import models
import probe
from models import speech_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=speech_data.TEST_SEEDS[5], help="which generated sentence")
    args = ap.parse_args()

    asr = models.load("speech")
    s = speech_data.sentence(args.seed)
    print(f"said: {s.text!r} ({s.seconds:.2f} s)")
    cache = probe.capture(asr, s.audio, processor=asr.processor, sampling_rate=speech_data.SAMPLE_RATE)
    heard = " ".join(cache.metadata["target_tokens"][0][1:])
    print(f"heard: {heard!r}")
    gold = [list(zip(s.words, *zip(*s.times, strict=True), strict=True))] if heard == s.text else None
    ts = probe.word_timestamps(cache)  # heads chosen without gold: the monotone, diagonal ones
    print(f"heads: {', '.join(f'L{layer} H{head}' for layer, head in ts.chosen)} ({ts.choice})")
    print(f"{'word':<8}{'start':>7}{'end':>7}{'gold':>15}")
    for r, (a, b) in zip(ts.words.rows, s.times, strict=False):
        print(f"{r['word']:<8}{r['start']:>7.2f}{r['end']:>7.2f}{a:>8.2f}-{b:.2f}")
    if gold is not None:
        scored = probe.word_timestamps(cache, heads=ts.chosen, gold=gold)
        m = scored.metrics
        print(
            f"mean boundary error {m['mean_error_ms']:.0f} ms; within 20 / 50 / 100 ms: "
            f"{m['within_20ms']:.0%} / {m['within_50ms']:.0%} / {m['within_100ms']:.0%}"
        )


if __name__ == "__main__":
    main()
