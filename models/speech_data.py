"""Spoken sentences with every word's true start and end known to the sample, for the zoo's speech model.

Each word of a small vocabulary (`WORDS`: the ten digits, five colours, four animals, two sizes and
three verbs) is synthesized on its own by Debian's espeak-ng (`espeak-ng -v en-us -s 160 -p 50 -a
100 -w FILE WORD`: voice, speed, pitch and amplitude fixed), read as 16-bit mono at espeak's 22,050
Hz, resampled to 16 kHz by `scipy.signal.resample_poly` (up 320, down 441: a polyphase filter) and
trimmed to its audible part: from the first to the last sample whose magnitude exceeds `TRIM`
(0.005 of full scale). A sentence is words drawn at random and joined with silences of seeded
random length, so a word's span in the sentence is exactly where its trimmed sound was placed:

    lead silence   0.10-0.40 s    before the first word
    gaps           0.05-0.35 s    between words
    tail silence   0.10-0.30 s    after the last word
    words          3-6, drawn uniformly (with repeats) from WORDS
    gain           0.6-1.0        the whole sentence's loudness
    noise          white, std 0-0.003 (of full scale), over the whole sentence, silences included

all drawn by `numpy.random.default_rng(seed)`: `sentence(seed)` is the same sentence on every call.
The transcript is the words joined by spaces; `Sentence.spans` are the words' [start, end) samples
and `Sentence.times` the same in seconds.

Synthesizing 24 words takes espeak-ng about a second, and its output depends on its version, so the
word sounds are bundled: `models/checkpoints/speech_words.safetensors` (int16 at 16 kHz, ~0.3 MB,
made with espeak-ng 1.51 by `python -m models.speech_data`). `word_sounds()` reads the bundle (once
per process); `word_sounds("espeak")` synthesizes them now (espeak-ng must be installed: `apt-get
install espeak-ng`). Training sentences come from seeds `train_seed(step, i)`, the held-out test
set from `TEST_SEEDS` (far from every training seed).
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import tempfile
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16_000
ESPEAK_RATE = 22_050
VOICE, SPEED, PITCH, AMPLITUDE = "en-us", 160, 50, 100
TRIM = 0.005
WORDS = (
    "zero one two three four five six seven eight nine "
    "red green blue black white cat dog bird fish big small runs jumps sees"
).split()
LEAD, GAP, TAIL = (0.10, 0.40), (0.05, 0.35), (0.10, 0.30)  # seconds
N_WORDS = (3, 6)
GAIN = (0.6, 1.0)
NOISE = 0.003
BUNDLE = Path(__file__).parent / "checkpoints" / "speech_words.safetensors"
TEST_SEEDS = tuple(range(900_000, 900_060))  # the held-out sentences (60)


def train_seed(step: int, i: int) -> int:
    """The seed of the i-th sentence of training batch `step` (all below 900,000 for < 9,000 steps
    of up to 100 sentences: never a test seed)."""
    return step * 100 + i


@dataclass
class Sentence:
    """One spoken sentence: `audio` (float32 at 16 kHz), its `words` and their [start, end) sample
    `spans`; `seed` made it."""

    seed: int
    words: list[str]
    audio: np.ndarray
    spans: list[tuple[int, int]]

    @property
    def text(self) -> str:
        """The transcript: the words joined by single spaces."""
        return " ".join(self.words)

    @property
    def times(self) -> list[tuple[float, float]]:
        """Each word's (start, end) in seconds."""
        return [(a / SAMPLE_RATE, b / SAMPLE_RATE) for a, b in self.spans]

    @property
    def seconds(self) -> float:
        return len(self.audio) / SAMPLE_RATE


def espeak_version() -> str:
    """The first line of `espeak-ng --version`; a clear error when it is not installed."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise RuntimeError("espeak-ng is not installed; apt-get install espeak-ng (README, set-up 2)")
    out = subprocess.run([exe, "--version"], check=True, capture_output=True, text=True).stdout
    return out.strip().splitlines()[0].split("  Data at:")[0].strip()


def synthesize(word: str) -> np.ndarray:
    """`word` spoken by espeak-ng, resampled to 16 kHz and trimmed to its audible part (float32)."""
    from scipy.signal import resample_poly

    espeak_version()  # installed?
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "word.wav"
        cmd = ["espeak-ng", "-v", VOICE, "-s", str(SPEED), "-p", str(PITCH), "-a", str(AMPLITUDE)]
        subprocess.run([*cmd, "-w", str(path), word], check=True, capture_output=True)
        with wave.open(str(path)) as f:
            if (f.getframerate(), f.getnchannels(), f.getsampwidth()) != (ESPEAK_RATE, 1, 2):
                raise RuntimeError(
                    f"espeak-ng wrote {f.getframerate()} Hz, {f.getnchannels()} channel(s), "
                    f"{8 * f.getsampwidth()} bit; expected {ESPEAK_RATE} Hz mono 16 bit"
                )
            raw = np.frombuffer(f.readframes(f.getnframes()), dtype=np.int16)
    x = resample_poly(raw.astype(np.float64) / 32768, 320, 441)  # 22,050 * 320 / 441 = 16,000
    loud = np.flatnonzero(np.abs(x) > TRIM)
    if loud.size == 0:
        raise RuntimeError(f"espeak-ng produced silence for {word!r}")
    return x[loud[0] : loud[-1] + 1].astype(np.float32)


def build_bundle(path: str | Path = BUNDLE) -> Path:
    """Synthesize every word of `WORDS` and write them (int16 at 16 kHz) with the synthesis
    settings as metadata; returns the path."""
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for w in WORDS:
        x = np.clip(np.round(synthesize(w) * 32767), -32768, 32767).astype(np.int16)
        tensors[w] = torch.from_numpy(x)
    meta = {
        "espeak": espeak_version(),
        "voice": VOICE,
        "speed": SPEED,
        "pitch": PITCH,
        "amplitude": AMPLITUDE,
        "sample_rate": SAMPLE_RATE,
        "resample": "scipy.signal.resample_poly(x, 320, 441)",
        "trim": TRIM,
    }
    path = Path(path)
    save_file(tensors, str(path), metadata={k: json.dumps(v) for k, v in meta.items()})
    return path


@functools.lru_cache(maxsize=2)
def _bundled(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    got = load_file(path)
    missing = [w for w in WORDS if w not in got]
    if missing:
        raise RuntimeError(f"{path} lacks {missing}; rebuild it with python -m models.speech_data")
    return {w: got[w].astype(np.float32) / 32767 for w in WORDS}


def word_sounds(source: str = "bundle") -> dict[str, np.ndarray]:
    """Each word's trimmed sound (float32, 16 kHz): from the bundled file (`"bundle"`, what the
    shipped model was trained and tested on) or synthesized now by espeak-ng (`"espeak"`)."""
    if source == "bundle":
        return _bundled(str(BUNDLE))
    if source == "espeak":
        return {w: synthesize(w) for w in WORDS}
    raise ValueError(f"source={source!r}: 'bundle' or 'espeak'")


def sentence(seed: int, sounds: dict[str, np.ndarray] | None = None) -> Sentence:
    """The spoken sentence drawn by `seed` (see the module docstring for every random choice)."""
    sounds = word_sounds() if sounds is None else sounds
    rng = np.random.default_rng(seed)
    n = int(rng.integers(N_WORDS[0], N_WORDS[1] + 1))
    words = [WORDS[i] for i in rng.integers(0, len(WORDS), n)]

    def silence(lo_hi: tuple[float, float]) -> int:
        return int(rng.integers(round(lo_hi[0] * SAMPLE_RATE), round(lo_hi[1] * SAMPLE_RATE) + 1))

    pieces, spans, at = [], [], 0
    for i, w in enumerate(words):
        pause = silence(LEAD if i == 0 else GAP)
        pieces += [np.zeros(pause, np.float32), sounds[w]]
        spans.append((at + pause, at + pause + len(sounds[w])))
        at += pause + len(sounds[w])
    pieces.append(np.zeros(silence(TAIL), np.float32))
    audio = np.concatenate(pieces) * np.float32(rng.uniform(*GAIN))
    audio = audio + rng.normal(0.0, rng.uniform(0.0, NOISE), len(audio)).astype(np.float32)
    return Sentence(seed, words, audio.astype(np.float32), spans)


def test_set(sounds: dict[str, np.ndarray] | None = None) -> list[Sentence]:
    """The held-out sentences (`TEST_SEEDS`)."""
    return [sentence(s, sounds) for s in TEST_SEEDS]


if __name__ == "__main__":
    out = build_bundle()
    print(f"wrote {out} ({out.stat().st_size / 1e3:.0f} kB) with {espeak_version()}")
