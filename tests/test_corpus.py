"""Corpus runs: statistics against independent captures, resume after SIGKILL, torchrun ranks, CLI."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import probe
from models import load as load_model
from probe.analysis.focus.accumulator import FocusAccumulator

ROOT = Path(__file__).resolve().parents[1]
LETTERS = "acdefghiklmnoprstuw"  # inside minigpt's vocabulary


def _texts(n: int = 16, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [
            "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 5))
        ]
        out.append(" ".join(words))
    out[5] = "bad b text"  # 'b' is outside the vocabulary: recorded, not fatal
    out[11] = "t" * 40  # longer than minigpt's 32 positions
    return out


TEXTS = _texts()
RUN = dict(batch_size=4, shard_size=4, keep="all")

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import probe, probe.corpus.shards as shards
    from models import load
    die = os.environ.get("DIE_RANK")
    delay = float(os.environ.get("SHARD_DELAY", "0"))
    if delay:  # stretch each shard so that a kill at a random time lands inside the run
        import time
        real_shard = shards.run_shard
        def slow(*a, **k):
            time.sleep(delay)
            return real_shard(*a, **k)
        shards.run_shard = slow
    if die is not None and os.environ.get("RANK", "0") == die:
        real, calls = shards.run_shard, []
        def dying(*a, **k):
            calls.append(1)
            if len(calls) == 2:  # after one finished shard: die like an OOM kill, no cleanup
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)
        shards.run_shard = dying
    probe.run_corpus(load("minigpt"), sys.argv[1], sys.argv[2], batch_size=4, shard_size=4, keep="all",
                     progress=False)
    """
)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "texts.txt").write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    (d / "run.py").write_text(SCRIPT, encoding="utf-8")
    probe.run_corpus(load_model("minigpt"), d / "texts.txt", d / "ref", progress=False, **RUN)
    return d


def _stats(path: Path) -> dict:
    return json.loads((path / "stats.json").read_text())


def _assert_same_stats(a: FocusAccumulator, b: FocusAccumulator, tol: float = 1e-6) -> None:
    assert a.n_texts == b.n_texts
    assert set(a.stats) == set(b.stats)
    for name in a.stats:
        sa, sb = a.stats[name], b.stats[name]
        assert torch.equal(sa.count, sb.count)
        torch.testing.assert_close(sa.mean, sb.mean, atol=tol, rtol=0, equal_nan=True)
        torch.testing.assert_close(sa.std, sb.std, atol=tol, rtol=0, equal_nan=True)


def test_statistics_equal_independent_captures(work):
    model = load_model("minigpt")
    oracle = FocusAccumulator()
    for i, t in enumerate(TEXTS):
        if i in (5, 11):
            with pytest.raises(probe.ProbeError):
                probe.capture(model, t)
            continue
        oracle.add(probe.capture(model, t))  # one text, no padding, no batching
    got = FocusAccumulator.from_dict(_stats(work / "ref"))
    _assert_same_stats(got, oracle)
    corpus = probe.open_corpus(work / "ref")
    assert set(corpus.errors) == {5, 11} and "2 failed" in corpus._repr_html_()
    assert "vocabulary" in corpus.errors[5] and "32" in corpus.errors[11]
    # every text is in the row the manifest names
    for i in (0, 7, 15):
        cache, row = corpus.cache_of(i)
        assert cache.metadata["texts"][row] == TEXTS[i]
    # open_corpus feeds head_stats lazily: same numbers as the run's merged statistics
    direct = probe.head_stats(corpus, progress=False)
    merged = corpus.head_stats()
    for col in ("entropy", "entropy_std", "confidence"):
        a, b = direct.table.column(col), merged.table.column(col)
        assert a == pytest.approx(b, abs=1e-6, nan_ok=True)
    assert probe.check_causal(next(iter(corpus))).ok


def _wait_for_shards(out: Path, n: int, proc: subprocess.Popen, deadline: float) -> float:
    while time.time() < deadline and proc.poll() is None and len(list((out / "shards").glob("*.json"))) < n:
        time.sleep(0.01)
    return time.time()


def test_kill_at_random_point_then_resume_is_identical(work):
    out = work / "killed"
    rng = random.Random(os.getpid())
    env = {**_env(), "SHARD_DELAY": "0.2"}
    proc = subprocess.Popen([sys.executable, work / "run.py", work / "texts.txt", out], env=env)
    deadline = time.time() + 120
    t1 = _wait_for_shards(out, 1, proc, deadline)
    t2 = _wait_for_shards(out, 2, proc, deadline)
    # two of the four shards remain, each about (t2 - t1) long: the kill lands somewhere inside them
    time.sleep(rng.uniform(0, 1.5 * (t2 - t1)))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # the manifest is written last (atomically): it exists only if the run had finished before the kill
    finished = (out / "manifest.json").exists()
    if not finished:
        with pytest.raises(probe.ProbeError, match="unfinished|rerun"):
            probe.open_corpus(out)
    probe.run_corpus(load_model("minigpt"), work / "texts.txt", out, progress=False, **RUN)
    assert (out / "manifest.json").read_text() == (work / "ref" / "manifest.json").read_text()
    assert _stats(out) == _stats(work / "ref")
    assert (out / "head_stats.csv").read_text() == (work / "ref" / "head_stats.csv").read_text()


def test_other_configuration_is_refused(work):
    with pytest.raises(probe.ProbeError, match="different corpus run.*batch_size"):
        probe.run_corpus(load_model("minigpt"), work / "texts.txt", work / "ref", batch_size=2, shard_size=4)


def _torchrun(work: Path, out: Path, **env) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(work / "run.py"), str(work / "texts.txt"), str(out)]
    return subprocess.run(cmd, env={**_env(), "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True)


@pytest.mark.slow
def test_torchrun_two_ranks_equal_one_process_and_resume_after_a_rank_dies(work):
    out = work / "ranks"
    r = _torchrun(work, out)
    assert r.returncode == 0, r.stderr[-2000:]
    _assert_same_stats(
        FocusAccumulator.from_dict(_stats(out)), FocusAccumulator.from_dict(_stats(work / "ref"))
    )
    assert (out / "manifest.json").read_text() == (work / "ref" / "manifest.json").read_text()

    out = work / "rank_killed"
    r = _torchrun(work, out, DIE_RANK="1")
    assert r.returncode != 0 and not (out / "manifest.json").exists()
    assert (out / "shards" / "00001.json").exists()  # rank 1 finished shard 1 before it died
    r = _torchrun(work, out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "manifest.json").read_text() == (work / "ref" / "manifest.json").read_text()
    # equal within float noise: torchrun sets one thread per rank, which changes reduction order
    _assert_same_stats(
        FocusAccumulator.from_dict(_stats(out)), FocusAccumulator.from_dict(_stats(work / "ref"))
    )


@pytest.mark.slow  # about 16 s on two cores: CI's slow job runs it (the default pytest keeps to ~15 min)
def test_cli_corpus_and_info(work, tmp_path):
    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "probe", *map(str, args)], env=_env(), capture_output=True, text=True
        )

    (tmp_path / "t.txt").write_text("\n".join(TEXTS[:6]) + "\n", encoding="utf-8")
    r = cli("corpus", "--model", "minigpt", "--texts", tmp_path / "t.txt", "-o", tmp_path / "c", "-q")
    assert r.returncode == 0, r.stderr
    assert "6 (5 captured, 1 failed)" in r.stdout and "text 5:" in r.stdout
    # statistics only: no cache files, and the statistics of the 5 texts captured one by one
    assert not list((tmp_path / "c" / "shards").glob("*/*.safetensors"))
    model, oracle = load_model("minigpt"), FocusAccumulator()
    for t in TEXTS[:5]:
        oracle.add(probe.capture(model, t))
    _assert_same_stats(FocusAccumulator.from_dict(_stats(tmp_path / "c")), oracle)
    r = cli("info", tmp_path / "c")
    assert r.returncode == 0 and "corpus run" in r.stdout
    r = cli(
        "corpus", "--model", "minigpt", "--texts", work / "texts.txt", "-o", tmp_path / "c", "--keep", "all"
    )
    assert r.returncode == 2 and "different corpus run" in r.stderr and "Traceback" not in r.stderr
    r = cli("corpus", "--model", "minigpt", "--texts", tmp_path / "nope.txt", "-o", tmp_path / "d")
    assert r.returncode == 2 and "no such file" in r.stderr
    r = cli("info", tmp_path)
    assert r.returncode == 2 and "is a directory" in r.stderr


def test_selected_heads_are_kept(tmp_path):
    texts = ["the cat sat", "fish are here", "a rat"]
    model = load_model("minigpt")
    keep = {"layers": [1], "heads": [0, 2]}
    c = probe.run_corpus(model, texts, tmp_path / "f32", keep=keep, progress=False)
    half = probe.run_corpus(model, texts, tmp_path / "f16", keep=keep, dtype="half", progress=False)
    full = probe.capture(model, texts[1])  # one text alone: the oracle
    n = len(full.metadata["tokens"][0])
    want = full["decoder.blocks.1.self_attn.pattern"][0, [0, 2]]
    for corpus, dtype, tol in ((c, torch.float32, 1e-6), (half, torch.float16, 2**-11 + 1e-6)):
        cache, row = corpus.cache_of(1)
        assert cache.keys() == ["decoder.blocks.1.self_attn.pattern"]
        got = cache["decoder.blocks.1.self_attn.pattern"]
        assert got.dtype == dtype and cache.metadata["dtype"] == str(dtype).replace("torch.", "")
        # float16 keeps 11 significant bits: within half a unit in the last place of values <= 1
        torch.testing.assert_close(got[row, :, :n, :n].float(), want, atol=tol, rtol=0)
    # statistics are computed before the cast: the same numbers whatever is stored
    assert _stats(tmp_path / "f16") == _stats(tmp_path / "f32")
    assert json.loads((tmp_path / "f16" / "config.json").read_text())["dtype"] == "float16"
    assert "stored as float16" in half.summary()
    with pytest.raises(probe.ProbeError, match="different corpus run.*dtype"):
        probe.run_corpus(model, texts, tmp_path / "f16", keep=keep, progress=False)
    with pytest.raises(probe.ProbeError, match="not supported"):
        probe.run_corpus(model, texts, tmp_path / "x", keep=keep, dtype="int8", progress=False)


def test_cli_keep_patterns_stores_every_pattern_and_no_residual(tmp_path):
    from probe.cli import main

    (tmp_path / "t.txt").write_text("the cat sat\na rat\n", encoding="utf-8")
    assert (
        main(
            ["corpus", "--model", "minigpt", "--texts", str(tmp_path / "t.txt"), "-o", str(tmp_path / "c")]
            + ["--keep", "patterns", "-q"]
        )
        == 0
    )
    cache, row = probe.open_corpus(tmp_path / "c").cache_of(1)
    full = probe.capture(load_model("minigpt"), "a rat")  # the oracle: every key a capture holds
    assert cache.keys() == [k for k in full.keys() if k.endswith(".pattern")]
    n = len(full.metadata["tokens"][0])
    for k in cache.keys():
        torch.testing.assert_close(cache[k][row, :, :n, :n], full[k][0], atol=1e-6, rtol=0)


# -- 1,000 texts: interrupted at a random point (SIGKILL, then Ctrl-C), resumed, identical -------------

BIG = dict(batch_size="4", shard_size="100")  # 10 shards of ~0.8 s each on one thread


def _big_texts() -> list[str]:
    texts = _texts(1000, seed=1)
    texts[437] = "a bad text"  # 'b' is outside minigpt's vocabulary
    texts[902] = "s" * 33  # one position too many
    return texts


def _cli_corpus(texts: Path, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "probe", "corpus", "--model", "minigpt", "--texts", str(texts)]
    cmd += ["-o", str(out), "--batch-size", BIG["batch_size"], "--shard-size", BIG["shard_size"]]
    return cmd + ["--layers", "1", "--heads", "0", "2", "--dtype", "float16", "-q"]


def _files(out: Path) -> dict[str, object]:
    """Every file of a run: bytes, or for a cache file its tensors and metadata (safetensors writes
    the metadata map in no fixed order, so equal caches need not be equal bytes)."""
    from safetensors import safe_open

    got: dict[str, object] = {}
    for p in sorted(out.rglob("*")):
        if p.suffix == ".safetensors":
            with safe_open(p, "pt") as f:
                got[str(p.relative_to(out))] = (f.metadata(), {k: f.get_tensor(k) for k in f.keys()})
        elif p.is_file():
            got[str(p.relative_to(out))] = p.read_bytes()
    return got


def _assert_same_files(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name, x in a.items():
        y = b[name]
        if isinstance(x, bytes):
            assert x == y, name
        else:
            assert x[0] == y[0] and list(x[1]) == list(y[1]), name
            assert all(torch.equal(x[1][k], y[1][k]) for k in x[1]), name


def _interrupt(cmd: list[str], out: Path, sig: int, rng: random.Random, env: dict) -> subprocess.Popen:
    """Start ``cmd`` and send ``sig`` at a random time inside the run: once shards k, k + 1 and
    k + 2 of its 10 are written (k random in 1..6), after a random fraction of the shorter of the
    last two shards' times (shards holding a failing text are slower: they capture texts one by
    one). Two shards or more remain, so the signal lands inside the run, not after it, unless
    other work on the machine slowed the earlier shards more than the later ones: a run that
    finished before the signal is started again from nothing and signalled as soon as its shard
    k + 2 is written (at most three times)."""
    seen = []
    for _ in range(3):
        k = rng.randint(1, 6)
        start = time.time()
        # SIGINT back to its default in the child: started from a background job (`.ci/run &`, a
        # script's `cmd &`), pytest has it ignored, the child would inherit that and never see Ctrl-C
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        deadline = time.time() + 120
        t = [_wait_for_shards(out, n, proc, deadline) for n in (k, k + 1, k + 2)]
        # again after a run that finished first: at once (two shards or more are still to run)
        pause = rng.uniform(0, min(t[1] - t[0], t[2] - t[1])) if not seen else 0.0
        time.sleep(pause)
        proc.send_signal(sig)
        proc.wait(timeout=60)
        if proc.returncode != 0:
            return proc
        done = len(list((out / "shards").glob("*.json")))
        seen.append(
            f"k={k} shards at {[round(x - start, 2) for x in t]} s, pause {pause:.2f} s, {done} records"
        )
        shutil.rmtree(out)
    raise AssertionError(
        f"the run finished before the signal three times: {seen}; {proc.stderr.read()[-500:]}"
    )


@pytest.mark.slow
def test_thousand_texts_interrupted_and_resumed_are_identical(tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(_big_texts()) + "\n", encoding="utf-8")
    # one thread everywhere: each process computes its shards in the same order of float operations
    env = {**_env(), "OMP_NUM_THREADS": "1"}
    ref = tmp_path / "ref"
    r = subprocess.run(_cli_corpus(texts, ref), env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "1,000 (996 captured, 4 failed)" in r.stdout, r.stdout
    want = _files(ref)
    manifest = json.loads(want["manifest.json"])
    assert want["stats.json"] and want["head_stats.csv"]
    stored = want["shards/00003/b000.safetensors"][1]["decoder.blocks.1.self_attn.pattern"]
    assert stored.dtype == torch.float16  # --dtype float16
    assert [i for i, e in enumerate(manifest["texts"]) if "error" in e] == [5, 11, 437, 902]
    rng = random.Random(os.getpid())

    # SIGKILL (an OOM kill: no cleanup at all), then the same command
    out = tmp_path / "killed"
    proc = _interrupt(_cli_corpus(texts, out), out, signal.SIGKILL, rng, env)
    assert proc.returncode == -signal.SIGKILL
    done = len(list((out / "shards").glob("*.json")))  # all 10 when killed in the examples pass
    assert 1 <= done <= 10 and not (out / "manifest.json").exists()
    # what a kill inside an atomic write leaves (rarely hit by chance): temp files the resume removes
    (out / "shards" / ".00009.json.x1.tmp").write_text("{")
    (out / "shards" / "00009").mkdir(exist_ok=True)
    (out / "shards" / "00009" / ".tmpAb12Cd").write_bytes(b"\0" * 64)  # safetensors' own temp file
    (out / ".manifest.json.x2.tmp").write_text("{")
    r = subprocess.run(_cli_corpus(texts, out), env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    _assert_same_files(_files(out), want)  # manifest, stats.json, head_stats.csv, shard records, caches

    # Ctrl-C: the run stops cleanly (exit 130, one line, no traceback, no temporary file), then resumes
    out = tmp_path / "interrupted"
    proc = _interrupt(_cli_corpus(texts, out), out, signal.SIGINT, rng, env)
    stderr = proc.stderr.read()
    assert proc.returncode == 130, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == "probe: interrupted" and "Traceback" not in stderr
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    assert not (out / "manifest.json").exists()
    r = subprocess.run(_cli_corpus(texts, out), env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    _assert_same_files(_files(out), want)


def test_a_datasets_dataset_is_read_by_column(work, tmp_path):
    datasets = pytest.importorskip("datasets")  # installed with the dev extra (transformer-lens needs it)
    ds = datasets.Dataset.from_dict({"text": TEXTS, "label": list(range(len(TEXTS)))})
    probe.run_corpus(load_model("minigpt"), ds, tmp_path / "ds", progress=False, **RUN)
    assert (tmp_path / "ds" / "manifest.json").read_text() == (work / "ref" / "manifest.json").read_text()
    assert _stats(tmp_path / "ds") == _stats(work / "ref")
    with pytest.raises(probe.ProbeError, match="no column 'body'.*field="):
        probe.run_corpus(load_model("minigpt"), ds, tmp_path / "bad", field="body", progress=False)


@pytest.mark.parametrize(
    "keep, what",
    [({"layers": [99]}, "layers"), ({"layers": [1, 99]}, "layers"), ({"heads": [1, 99]}, "heads")],
)
def test_a_selection_the_model_lacks_is_refused_and_leaves_no_run(tmp_path, keep, what):
    model = load_model("minigpt")
    # the oracle: the model's own module tree (2 blocks of 4 heads), not probe's metadata
    n_layers, n_heads = len(model.blocks), len(model.blocks[0].attn.heads)
    n = n_layers if what == "layers" else n_heads
    out = tmp_path / "run"
    with pytest.raises(probe.ProbeError, match=rf"{what}.*; choose indices from 0-{n - 1}$"):
        probe.run_corpus(model, ["the cat sat"], out, keep=keep, progress=False)
    assert not out.exists()  # no config.json left to block the corrected command
    fixed = {k: [i for i in v if i < n] or [0] for k, v in keep.items()}
    cache, _ = probe.run_corpus(model, ["the cat sat"], out, keep=fixed, progress=False).cache_of(0)
    layers = fixed.get("layers", range(n_layers))
    assert cache.keys() == [f"decoder.blocks.{i}.self_attn.pattern" for i in layers]
    assert {cache.shape(k)[1] for k in cache.keys()} == {len(fixed.get("heads", range(n_heads)))}


@pytest.mark.parametrize("keep", [{"layers": []}, {"heads": []}])
def test_an_empty_selection_is_refused_like_capture(tmp_path, keep):
    with pytest.raises(probe.ProbeError, match=r"=\[\] selects no (layer|head); give indices"):
        probe.run_corpus(load_model("minigpt"), ["the cat sat"], tmp_path / "run", keep=keep, progress=False)
    assert not (tmp_path / "run").exists()


# -- a run in which every text failed -----------------------------------------------------------------
BAD = ["bad b text", "t" * 40, "b"]  # 'b' is outside minigpt's vocabulary; 40 > its 32 positions


def test_a_run_with_every_text_failed_raises_and_keeps_its_manifest(tmp_path):
    from probe.corpus import CorpusFailed

    model = load_model("minigpt")
    for t in BAD:  # the oracle: each text alone is refused by capture itself
        with pytest.raises(probe.ProbeError):
            probe.capture(model, t)
    with pytest.raises(CorpusFailed, match=r"^no text captured: all 3 texts failed \(text 0: ") as e:
        probe.run_corpus(model, BAD, tmp_path / "run", batch_size=2, shard_size=2, progress=False)
    assert isinstance(e.value, probe.ProbeError) and "\n" not in str(e.value)
    assert sorted(e.value.corpus.errors) == [0, 1, 2]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert (manifest["n_ok"], manifest["n_failed"]) == (0, 3)
    # rerunning the finished run says the same; one good text among them makes it a normal run
    with pytest.raises(CorpusFailed):
        probe.run_corpus(model, BAD, tmp_path / "run", batch_size=2, shard_size=2, progress=False)
    ok = probe.run_corpus(model, [*BAD, "a cat"], tmp_path / "mixed", progress=False)
    assert sorted(ok.errors) == [0, 1, 2] and ok.manifest["n_ok"] == 1


def test_cli_corpus_with_every_text_failed_exits_2_with_one_line(tmp_path):
    (tmp_path / "t.txt").write_text("\n".join(BAD) + "\n", encoding="utf-8")
    r = subprocess.run(
        [sys.executable, "-m", "probe", "corpus", "--model", "minigpt", "--texts", tmp_path / "t.txt",
         "-o", tmp_path / "c", "-q"],
        env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("probe: error: no text captured: all 3 texts failed (text 0: ")
    assert line.endswith(f"each error is in {tmp_path / 'c' / 'manifest.json'}")
