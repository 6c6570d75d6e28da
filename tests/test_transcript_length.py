"""Audio longer than a speech model hears: one line that says how long it is, how much the model
hears and to shorten it (it said "pass target=", which cannot help), in Python and on the CLI,
with nothing left behind.

Oracle: the zoo speech model's own forward, which refuses features past its encoder's positions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import models
import probe
from probe.cli import main
from probe.errors import ProbeError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
RATE = 16_000


@pytest.fixture(scope="module")
def speech():
    return models.load("speech")


def _noise(seconds: float) -> np.ndarray:
    return (0.01 * np.random.default_rng(0).standard_normal(int(seconds * RATE))).astype(np.float32)


def test_audio_past_what_the_model_hears_is_one_line_saying_shorten_it(speech):
    sound = _noise(31)
    feats = speech.processor(sound, sampling_rate=RATE, return_tensors="pt")["input_features"]
    with pytest.raises(ValueError, match=r"at most 3000 \(30 s of audio\)"):  # the model's own limit
        speech(feats, torch.tensor([[1]]))
    for target in (None, "blue six"):  # greedy decoding, and a transcript given
        with pytest.raises(ProbeError) as e:
            probe.capture(speech, sound, processor=speech.processor, sampling_rate=RATE, target=target)
        msg = str(e.value)
        assert "\n" not in msg and "target=" not in msg, msg
        assert msg == (
            "the audio is 31.0 s long (3100 feature frames) but speech hears at most 30 s (3000 frames); "
            "shorten the audio (or cut it into pieces of at most 30 s)"
        )


def test_audio_past_what_the_model_hears_on_the_command_line(tmp_path, capsys):
    import soundfile  # the audio extra (the tests' set-up installs it)

    wav = tmp_path / "long.wav"
    soundfile.write(wav, _noise(31), RATE)
    out = tmp_path / "out"
    assert main(["report", "-m", "speech", "--audio", str(wav), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("probe: error: the audio is 31.0 s long") and err.count("\n") == 1, err
    assert "shorten the audio" in err and "Traceback" not in err
    assert not out.exists()
