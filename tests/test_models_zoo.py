"""models: the registry, load, checkpoints and the training CLI."""

import pytest
import torch

import models
from models import checkpoint, fused_decoder
from models.train import main as train_main


def test_names_list_the_zoo():
    assert models.names() == [
        "single_head",
        "minigpt",
        "fused_decoder",
        "translator",
        "aligner",
        "vit_zoo",
        "speech",
        "induction",
        "smollm2",
    ]


def test_unknown_name_is_an_error_listing_the_zoo():
    with pytest.raises(ValueError, match="unknown model 'gpt2'.*minigpt"):
        models.load("gpt2")


def test_a_dash_stands_for_an_underscore_as_on_the_command_line():
    assert models.module("vit-zoo") is models.module("vit_zoo")
    a, b = models.load("single-head"), models.load("single_head")
    assert type(a) is type(b) and all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert models.checkpoint_path("vit-zoo") == models.checkpoint_path("vit_zoo")
    with pytest.raises(ValueError, match="unknown model 'vit-zo'"):  # named as the caller spelled it
        models.load("vit-zo")


@pytest.mark.parametrize(
    "name, context_length", [("single_head", 8), ("minigpt", 32), ("fused_decoder", None)]
)
def test_shipped_models_carry_the_common_attributes(name, context_length):
    model = models.load(name)
    assert not model.training
    assert model.name == name and model.is_encoder_decoder is False
    assert model.context_length == context_length
    for attr in ("encode", "decode", "tokenize", "pad_id", "vocab_size"):
        assert hasattr(model.tokenizer, attr)


@pytest.mark.parametrize("name", models.SHIPPED)
def test_shipped_checkpoints_record_config_and_training(name):
    path = checkpoint.shipped_path(name)
    assert models.checkpoint_path(name) == path and path.exists()
    meta = checkpoint.read_metadata(path)
    assert meta["model"] == name and meta["format"] == checkpoint.FORMAT
    assert meta["config"] == vars(models.module(name).Config())  # today's defaults
    assert {"final_loss", "steps", "train_seconds", "recipe"} <= meta.keys()


def test_translator_is_not_shipped():
    assert not checkpoint.shipped_path("translator").exists()


def test_missing_checkpoint_is_trained_into_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PROBE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(checkpoint, "SHIPPED_DIR", tmp_path / "nothing-shipped")
    model = models.load("fused_decoder")
    path = tmp_path / "models" / "fused_decoder.safetensors"
    assert models.checkpoint_path("fused_decoder") == path and path.exists()
    assert capsys.readouterr().err.count("probe: first use of fused_decoder") == 1
    assert model.train_info["steps"] == checkpoint.read_metadata(path)["steps"]


def test_a_damaged_cache_entry_is_retrained(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PROBE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(checkpoint, "SHIPPED_DIR", tmp_path / "nothing-shipped")
    path = tmp_path / "models" / "fused_decoder.safetensors"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a safetensors file")
    model = models.load("fused_decoder")
    assert "unusable" in capsys.readouterr().err
    assert model.predict("314") and checkpoint.read_metadata(path)["model"] == "fused_decoder"


def test_train_cli_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as done:
        train_main(["--help"])
    assert done.value.code == 0
    assert "--out PATH" in capsys.readouterr().out


@pytest.mark.slow
def test_train_cli_writes_what_the_recipe_computes(tmp_path, capsys):
    out = tmp_path / "fd.safetensors"
    assert train_main(["fused_decoder", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "epoch 20 | loss" in printed and "final loss" in printed and str(out) in printed
    saved, meta = checkpoint.read(out)
    fresh, stats = fused_decoder.train()  # the same recipe, run again in this process
    assert meta["final_loss"] == stats.final_loss and meta["steps"] == stats.steps
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(saved[name], tensor), name
