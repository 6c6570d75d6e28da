"""``probe generate``: the cache and report it writes, against minigpt's own decoding and weights
(a greedy loop and a seeded sampling loop over its logits, its heads' returned weights, written
here), and its one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from generation_caches import greedy, minigpt_weights

import models
import probe
from probe.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
PROMPT = "attention lets"


@pytest.fixture(scope="module")
def gpt():
    return models.load("minigpt")


def _sampled(model, ids: list[int], n: int, seed: int, temperature: float = 1.0) -> list[int]:
    """``n`` tokens drawn from minigpt's softmax of its logits / ``temperature``, with a generator
    seeded by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([seq]))
            probs = torch.softmax(logits[:, -1].float() / temperature, -1)
            seq.append(int(torch.multinomial(probs, 1, generator=gen)))
    return seq[len(ids) :]


def test_generate_writes_the_cache_and_the_report(gpt, tmp_path, capsys):
    out = tmp_path / "gen"
    assert (
        main(["generate", "--model", "minigpt", PROMPT, "--max-new-tokens", "12", "-o", str(out), "-q"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    ids = gpt.tokenizer.encode(PROMPT)
    new = greedy(gpt, ids, 12)
    text = gpt.tokenizer.decode(new)
    assert lines[0] == f"generated 12 tokens (greedy): {text}"
    assert lines[1].startswith(f"wrote {out / 'generation.safetensors'} (") and "index.html" in lines[1]
    cache = probe.load(out / "generation.safetensors")
    gen = cache.metadata["generation"]
    assert (gen["output_ids"], gen["output_text"], gen["prompt_length"]) == (new, text, len(ids))
    want = minigpt_weights(gpt, ids + new[:-1])
    for layer in (0, 1):
        got = cache.pattern("decoder", layer, batch=0).double()
        assert torch.allclose(got, want[layer], atol=1e-6)
    page = (out / "index.html").read_text(encoding="utf-8")
    assert 'id="sec-generation"' in page and "probe-genview" in page


def test_seed_samples_reproducibly(gpt, tmp_path, capsys):
    args = ["generate", "--model", "minigpt", PROMPT, "-n", "10", "--seed", "3", "-q", "--no-report"]
    assert main([*args, "-o", str(tmp_path / "a")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    want = gpt.tokenizer.decode(_sampled(gpt, gpt.tokenizer.encode(PROMPT), 10, 3))
    assert first == f"generated 10 tokens (sampled, seed 3, temperature 1): {want}"
    assert not (tmp_path / "a" / "index.html").exists()
    cache = probe.load(tmp_path / "a" / "generation.safetensors")
    assert (cache.metadata["generation"]["strategy"], cache.metadata["generation"]["seed"]) == ("sample", 3)


def test_temperature_samples_from_the_flattened_softmax(gpt, tmp_path, capsys):
    # minigpt is sure of every next token after this prompt: at temperature 1 each seed samples its
    # greedy output; at 2 the draws are those of softmax(logits / 2), and differ from it
    ids = gpt.tokenizer.encode(PROMPT)
    args = ["generate", "--model", "minigpt", PROMPT, "-n", "10", "-q", "--no-report"]
    seed = next(s for s in range(100) if _sampled(gpt, ids, 10, s, 2.0) != greedy(gpt, ids, 10))
    assert main([*args, "--seed", str(seed), "--temperature", "2", "-o", str(tmp_path / "t")]) == 0
    want = _sampled(gpt, ids, 10, seed, temperature=2.0)
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"generated 10 tokens (sampled, seed {seed}, temperature 2): {gpt.tokenizer.decode(want)}"
    gen = probe.load(tmp_path / "t" / "generation.safetensors").metadata["generation"]
    assert (gen["output_ids"], gen["strategy"], gen["seed"]) == (want, "sample", seed)
    assert gen["temperature"] == 2.0
    # a temperature alone samples too, unseeded; the line says it cannot be repeated
    assert main([*args, "--temperature", "1.5", "-o", str(tmp_path / "u")]) == 0
    assert "(sampled, no seed: not reproducible, temperature 1.5): " in capsys.readouterr().out


def test_keep_rows_holds_every_generated_row_exactly(gpt, tmp_path, capsys):
    out = tmp_path / "rows"
    assert (
        main(
            [
                "generate",
                "--model",
                "minigpt",
                PROMPT,
                "-n",
                "8",
                "--keep",
                "rows",
                "-o",
                str(out),
                "-q",
                "--no-report",
            ]
        )
        == 0
    )
    cache = probe.load(out / "generation.safetensors")
    assert cache.partial and not any(k.endswith(".pattern") for k in cache.keys())
    ids = gpt.tokenizer.encode(PROMPT)
    new = greedy(gpt, ids, 8)
    want = minigpt_weights(gpt, ids + new[:-1])
    P = len(ids)
    lb = probe.lookback(cache)
    for t in (1, 7):
        row = want[1][2, P - 1 + t]
        ctx, mine = float(row[:P].mean()), float(row[P : P + t].mean())
        assert float(lb.ratio[1, 2, t]) == pytest.approx(ctx / (ctx + mine), abs=1e-6)


def test_the_default_length_fits_a_zoo_models_context(gpt, tmp_path, capsys):
    # minigpt reads 32 positions: a prompt of 14 leaves room for 19 new tokens (T = P + N - 1)
    assert main(["generate", "--model", "minigpt", PROMPT, "-o", str(tmp_path), "-q", "--no-report"]) == 0
    cache = probe.load(tmp_path / "generation.safetensors")
    want = greedy(gpt, gpt.tokenizer.encode(PROMPT), 19)
    assert cache.metadata["generation"]["output_ids"] == want
    assert capsys.readouterr().out.startswith(f"generated 19 tokens (greedy): {gpt.tokenizer.decode(want)}")


def test_keep_stats_and_topk_reach_probe_generate(tmp_path, capsys):
    for keep, kept in (("stats", "stats"), ("topk:3", {"topk": 3})):
        out = tmp_path / keep.replace(":", "")
        argv = ["generate", "--model", "minigpt", PROMPT, "-n", "4", "--keep", keep, "-o", str(out), "-q"]
        assert main([*argv, "--no-report"]) == 0
        assert probe.load(out / "generation.safetensors").kept == kept


@pytest.mark.parametrize(
    "args, message",
    [
        (["a", "b"], "give one PROMPT"),
        ([], "nothing to generate from"),
        ([PROMPT, "-n", "0"], "--max-new-tokens must be at least 1"),
        ([PROMPT, "-n", "40"], "minigpt reads at most 32 tokens"),
        ([PROMPT, "--keep", "rows:last"], "--keep rows:last: row indices must be integers"),
        ([PROMPT, "--model", "nope"], "unknown model 'nope'"),
        ([PROMPT, "--temperature", "0"], "--temperature must be above 0"),
    ],
)
def test_errors_are_one_line_exit_2(args, message, tmp_path, capsys):
    argv = ["generate", *args, "-o", str(tmp_path / "x"), "-q"]
    if "--model" not in args:
        argv[1:1] = ["--model", "minigpt"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("probe: error: ") and message in err and "\n" not in err
    assert not (tmp_path / "x" / "generation.safetensors").exists()


def test_an_output_that_is_a_file_is_refused_before_the_model_runs(tmp_path, capsys):
    f = tmp_path / "taken"
    f.write_text("")
    assert main(["generate", "--model", "minigpt", PROMPT, "-o", str(f)]) == 2
    assert "probe: error: " in capsys.readouterr().err


def test_help_and_exit_codes_of_the_console_command():
    r = subprocess.run([sys.executable, "-m", "probe", "generate", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "usage: probe generate" in r.stdout and "--max-new-tokens" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "probe", "generate", "--model", "minigpt", "a", "b"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stdout == ""
