"""The ``probe`` command line, run as a user would (a subprocess), errors included."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import probe


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "probe", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_help_on_every_command():
    for args in ([], ["capture"], ["info"], ["models"]):
        r = run(*args, "--help")
        assert r.returncode == 0, r.stderr
        assert "usage: probe" in r.stdout


def test_models_lists_the_zoo():
    r = run("models")
    assert r.returncode == 0
    names = [line.split()[0] for line in r.stdout.splitlines()]
    assert names == [
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


def test_capture_then_info(tmp_path):
    out = tmp_path / "run.safetensors"
    r = run("capture", "--model", "minigpt", "attention lets tokens", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert out.exists() and "wrote" in r.stdout
    cache = probe.load(out)
    gpt_ids = cache.metadata["ids"][0]
    assert len(gpt_ids) == len("attention lets tokens")
    r = run("info", str(out))
    assert r.returncode == 0, r.stderr
    assert "minigpt" in r.stdout
    assert "decoder.blocks.1.self_attn.pattern" in r.stdout
    assert "[1, 4, 21, 21]" in r.stdout
    assert "a | t | t | e" in r.stdout


def test_capture_translator_with_target_and_filters(tmp_path):
    out = tmp_path / "tr.safetensors"
    r = run(
        "capture",
        "-m",
        "translator",
        "ich mochte ein bier",
        "--target",
        "S i want a beer",
        "-o",
        str(out),
        "--layers",
        "0,5",
        "--heads",
        "0",
        "--dtype",
        "float16",
    )
    assert r.returncode == 0, r.stderr
    cache = probe.load(out)
    assert cache.n_layers("encoder") == 2 and cache.n_layers("decoder") == 2
    assert "decoder.blocks.5.self_attn.pattern" in cache  # keys keep the model's layer numbers
    assert "decoder.blocks.1.self_attn.pattern" not in cache
    p = cache.pattern("decoder", 5, "cross")
    assert p.shape == (1, 1, 5, 4) and p.dtype == torch.float16


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["capture", "-m", "gpt5", "hi", "-o", "x.safetensors"], "unknown model 'gpt5'"),
        (["capture", "-m", "minigpt", "", "-o", "x.safetensors"], "empty text"),
        (["capture", "-m", "minigpt", "HELLO", "-o", "x.safetensors"], "'H', 'E', 'L', 'O'"),
        (["capture", "-m", "minigpt", "a" * 40, "-o", "x.safetensors"], "at most 32"),
        (["capture", "-m", "translator", "ich will bier", "-o", "x.safetensors"], "will"),
        (["capture", "-m", "minigpt", "at", "-o", "x.txt"], "should end in .safetensors"),
        (["capture", "-m", "minigpt", "at", "-o", "x.safetensors", "--layers", "9"], "selects no layer"),
        (["info", "missing.safetensors"], "no such file"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_no_file(tmp_path, args, message):
    r = run(*args, cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_info_on_bad_files(tmp_path):
    (tmp_path / "text.safetensors").write_text("not a cache")
    r = run("info", str(tmp_path / "text.safetensors"))
    assert r.returncode == 2 and "not a safetensors file" in r.stderr and "Traceback" not in r.stderr
    r = run("capture", "--layers", "x,y", "at", "-o", "a.safetensors", cwd=tmp_path)
    assert r.returncode == 2 and "comma-separated integers" in r.stderr


def test_capture_from_a_hugging_face_folder(tmp_path):
    from hf_fixtures import minilm_dir

    out = tmp_path / "bert.safetensors"
    r = run("capture", "--hf", str(minilm_dir()), "tokenization is fun", "-o", str(out))
    assert r.returncode == 0, r.stderr
    import probe

    cache = probe.load(out)
    assert cache.tokens == [["[CLS]", "token", "##ization", "is", "fun", "[SEP]"]]
    assert cache.pattern("encoder", 5).shape == (1, 12, 6, 6)


def test_hf_folder_errors_are_one_line(tmp_path):
    r = run("capture", "--hf", str(tmp_path), "x", "-o", str(tmp_path / "a.safetensors"))
    assert r.returncode == 2 and "no config.json" in r.stderr and "Traceback" not in r.stderr
    r = run(
        "capture", "--hf", str(tmp_path), "--model", "minigpt", "x", "-o", str(tmp_path / "a.safetensors")
    )
    assert r.returncode == 2 and "not allowed with" in r.stderr


COMMANDS = (
    "capture",
    "info",
    "corpus",
    "check",
    "report",
    "export",
    "stats",
    "models",
    "residual",
    "lens",
    "budget",
    "align",
    "diff",
    "ablate",
    "patch",
)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_examples_one_per_line(command):
    r = run(command, "--help")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "examples:" in lines, r.stdout
    examples = lines[lines.index("examples:") + 1 :]
    # every example is its own line, starting with the command (none run into a paragraph)
    assert examples and all(line.startswith(("  probe ", "  torchrun ")) for line in examples)
    assert all(line.count("probe ") == 1 for line in examples)


def test_an_unknown_flag_shows_the_commands_usage():
    r = run("report", "--model", "minigpt", "--bogus", "text")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("usage: probe report ")
    assert "probe report: error: unrecognized arguments: --bogus" in r.stderr


def test_info_on_a_file_that_is_no_cache_says_what_it_is(tmp_path):
    source = tmp_path / "some.py"
    source.write_text('"""A Python file."""\nprint("hello")\n')
    r = run("info", str(source))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "not a probe cache: not a safetensors file (it looks like a text file)" in r.stderr
    assert "header length" not in r.stderr
    model = tmp_path / "model.pt"
    torch.save({"w": torch.zeros(2)}, model)
    assert "a zip archive, e.g. a torch.save .pt or .bin file" in run("info", str(model)).stderr


@pytest.mark.slow  # about 17 s on two cores: CI's slow job runs it (the default pytest keeps to ~15 min)
def test_stats_lines_fit_the_width(tmp_path):
    import json

    path = tmp_path / "run.safetensors"
    assert run("capture", "--model", "minigpt", "attention lets tokens", "-o", str(path)).returncode == 0
    every = list(json.loads(run("stats", str(path), "--json").stdout)["rows"][0])
    r = run("stats", str(path), "--columns", "all", "--width", "80")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    # the blocks' headers hold every column, each block led by layer and head
    headers = [lines[i - 1].split() for i, line in enumerate(lines) if line.startswith("-----")]
    assert len(headers) > 1 and all(h[:4] == ["stack", "layer", "head", "kind"] for h in headers)
    assert {c for h in headers for c in h} == set(every)
    # by default: the main columns and a pointer to the rest
    r = run("stats", str(path), "--width", "200")
    assert "layer" in r.stdout and "dup_matches" not in r.stdout and "--columns all" in r.stdout
