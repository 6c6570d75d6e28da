"""Corpus runs of sound files (issue 56: a speech model's corpus, shown in ``probe serve``): a folder
of sound files through the zoo speech model's feature extractor, a file that is no sound recorded
and skipped, the store's spectrograms, the explorer's pages, the command line.

Oracles: the attention weights recomputed from each attention module's query and key projections
(forward hooks, ``test_models_speech._weights_by_hook``) on the file's features made here, with
the transcript the capture decoded; the files and their order written here.
"""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_models_speech import _weights_by_hook

import models
import probe
from models import speech_data

sf = pytest.importorskip("soundfile")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def speech():
    return models.load("speech")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """Three spoken sentences (16 kHz WAV and FLAC), a WAV file that is no sound, and a text file."""
    d = tmp_path_factory.mktemp("sounds")
    for i, s in enumerate(speech_data.test_set()[:3]):
        sf.write(d / f"s{i}.{'flac' if i == 2 else 'wav'}", s.audio, 16_000)
    (d / "a_bad.wav").write_bytes(b"RIFF but not a sound")  # first by name: item 0
    (d / "notes.txt").write_text("not a sound file: left out")
    return d


@pytest.fixture(scope="module")
def run(speech, folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run"
    return probe.run_corpus(speech, folder, out, batch_size=1, shard_size=2, keep="all", progress=False)


def test_each_sound_s_patterns_are_the_model_s_own_weights(speech, folder, run):
    assert [e["audio"] for e in run.texts] == ["a_bad.wav", "s0.wav", "s1.wav", "s2.flac"]
    assert list(run.errors) == [0]
    assert "a_bad.wav" in run.errors[0] and "\n" not in run.errors[0]
    assert run.config["inputs"] == "audio" and run.manifest["n_ok"] == 3
    assert "sounds:    4 (3 captured, 1 failed)" in run.summary()
    for i in (1, 2, 3):
        cache, row = run.cache_of(i)
        path = folder / run.texts[i]["audio"]
        audio, rate = sf.read(path, dtype="float32")
        assert rate == 16_000
        feats = speech.processor([audio])["input_features"]
        ids = torch.tensor([cache.metadata["target_ids"][row]])
        for (stack, layer, kind), w in _weights_by_hook(speech, feats, ids).items():
            got = cache.pattern(stack, layer, kind) if kind == "cross" else cache.pattern(stack, layer)
            torch.testing.assert_close(got[row : row + 1], w, atol=1e-6, rtol=0)


def test_the_store_keeps_each_sound_s_spectrogram_and_the_explorer_shows_it(run):
    pytest.importorskip("duckdb")
    pytest.importorskip("starlette")
    from PIL import Image
    from starlette.testclient import TestClient

    from probe.explore.app import create_app
    from probe.explore.data import Explorer

    rows = run.query("select text, source, n_tokens, picture, error from texts order by text").rows
    assert [r["source"] for r in rows] == ["a_bad.wav", "s0.wav", "s1.wav", "s2.flac"]
    assert rows[0]["picture"] is None and rows[0]["error"]
    for r in rows[1:]:
        with Image.open(io.BytesIO(base64.b64decode(r["picture"]))) as img:
            assert max(img.size) <= 480  # time along the width, scaled down
        cache, row = run.cache_of(r["text"])
        assert r["n_tokens"] == cache.pattern("encoder", 0).shape[-1]  # a token per encoder position
    n_heads = run.query("select count(*) as n from heads where text = 1").rows[0]["n"]
    assert n_heads == 3 * 4 + 3 * 4 * 2  # encoder self, decoder self and cross: 3 layers x 4 heads
    ex = Explorer(run.path)
    client = TestClient(create_app(ex))
    page = client.get("/text/2?stat=first")
    assert page.status_code == 200 and 'class="picture spectrogram"' in page.text
    assert f"base64,{rows[2]['picture']}" in page.text
    page = client.get("/head/encoder/self/0/1?stat=first")
    assert page.status_code == 200 and page.text.count('class="thumb spectrogram"') == 6  # top and bottom
    assert all(name in page.text for name in ("s0.wav", "s1.wav", "s2.flac"))
    ex.close()


def test_probe_corpus_audio_on_the_command_line(folder, tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "probe", "corpus", "--model", "speech", "--audio", str(folder)]
    r = subprocess.run([*cmd, "-o", str(tmp_path / "run"), "-q"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "sounds:    4 (3 captured, 1 failed)" in r.stdout
    # a text model, and sounds with texts: one line each, exit 2, nothing written
    for extra, why in (
        (["--model", "minigpt", "--audio", str(folder)], "--audio needs a speech model"),
        (["--model", "speech", "--audio", str(folder), "--texts", "t.txt"], "one of them"),
    ):
        out = tmp_path / "refused"
        r = subprocess.run(
            [sys.executable, "-m", "probe", "corpus", *extra, "-o", str(out)],
            capture_output=True,
            text=True,
            env=env,
        )
        assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


def test_a_folder_of_pictures_and_sounds_is_not_taken_for_sound(folder, tmp_path):
    from probe.corpus.sounds import sound_inputs

    assert sound_inputs(folder) and sound_inputs([folder / "s0.wav"]) and not sound_inputs(["a text"])
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    sf.write(mixed / "s.wav", np.zeros(1600, np.float32), 16_000)
    (mixed / "p.png").write_bytes(b"")
    assert not sound_inputs(mixed)
