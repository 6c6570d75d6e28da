"""models.checkpoint: the cache location, atomic writes, metadata."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models import checkpoint
from models.checkpoint import TrainStats


def _stats():
    return TrainStats(final_loss=0.25, steps=3, seconds=1.5, recipe={"seed": 1, "lr": 0.1})


def test_cache_dir_follows_the_environment_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("PROBE_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert checkpoint.cache_dir() == tmp_path / "elsewhere"
    assert checkpoint.cached_path("translator") == tmp_path / "elsewhere/models/translator.safetensors"


def test_cache_dir_defaults_to_dot_cache_probe(monkeypatch, tmp_path):
    monkeypatch.delenv("PROBE_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert checkpoint.cache_dir() == tmp_path / ".cache" / "probe"


def test_save_writes_weights_and_json_metadata(tmp_path):
    model = torch.nn.Linear(3, 2)
    path = checkpoint.save(model, tmp_path / "a/b.safetensors", name="toy", config={"n": 3}, stats=_stats())
    tensors = load_file(path)
    assert torch.equal(tensors["weight"], model.weight.detach())
    meta = checkpoint.read_metadata(path)
    assert meta == {
        "format": checkpoint.FORMAT,
        "model": "toy",
        "config": {"n": 3},
        "recipe": {"seed": 1, "lr": 0.1},
        "final_loss": 0.25,
        "steps": 3,
        "train_seconds": 1.5,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind


def test_an_interrupted_save_keeps_the_old_checkpoint_and_no_partial_file(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    old = torch.nn.Linear(3, 2)
    checkpoint.save(old, path, name="toy", config={}, stats=_stats())

    def crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(torch.nn.Linear(3, 2), path, name="toy", config={}, stats=_stats())
    assert list(tmp_path.iterdir()) == [path]
    assert torch.equal(load_file(path)["weight"], old.weight.detach())
