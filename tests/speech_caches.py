"""The speech zoo model's capture of two held-out sentences, shared by the audio report tests."""

from __future__ import annotations

import models
import probe
from models import speech_data


def two_sentences():
    """``(model, sentences, cache)``: the zoo's speech model captured on the first two held-out
    sentences, their transcripts as the decoder's inputs."""
    model = models.load("speech")
    sents = speech_data.test_set()[:2]
    cache = probe.capture(
        model,
        [s.audio for s in sents],
        processor=model.processor,
        sampling_rate=16_000,
        target=[s.text for s in sents],
    )
    return model, sents, cache
