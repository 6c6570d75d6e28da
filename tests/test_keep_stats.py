"""``keep="stats"``: each head's statistics computed block by block while the model runs, plus the
residual norms, stored in the cache. The oracle of every statistic is the full-pattern path
``probe.head_stats(probe.capture(model, inputs))`` (itself tested by hand in test_focus.py and
test_long_context.py); the oracle of each residual norm is ``.norm(dim=-1)`` of the full
capture's residual tensor, computed here."""

from __future__ import annotations

import subprocess
import sys

import hf_fixtures as H
import pytest
import torch
from test_long_context import TARGETS, TEXTS, assert_same
from toys import ToyLM

import probe
from probe.errors import ProbeError


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return H.bpe_tokenizer(tmp_path_factory.mktemp("bpe"))


def check_cache(stats_cache, full_cache):
    """The statistics equal the full capture's; every residual norm is the norm of its tensor."""
    got = probe.head_stats(stats_cache, progress=False)
    want = probe.head_stats(full_cache, progress=False)
    assert_same(got, want)
    assert got.received.keys() == want.received.keys()
    for k in want.received:
        torch.testing.assert_close(got.received[k], want.received[k], atol=1e-6, rtol=0, equal_nan=True)
    assert got.rollout is None and "rollout" in got.not_computed
    resid = [k for k in full_cache.keys() if not k.endswith(".pattern")]
    assert resid and sorted(k for k in stats_cache.keys() if k.endswith(".norm")) == sorted(
        f"{k}.norm" for k in resid
    )
    for k in resid:
        oracle = full_cache[k].float().norm(dim=-1)
        torch.testing.assert_close(stats_cache[f"{k}.norm"], oracle, atol=1e-6, rtol=1e-6)
    assert not any(k.endswith(".pattern") for k in stats_cache.keys())
    return got


@pytest.mark.parametrize("kind,T,block", [("sdpa_causal", 50, 7), ("F.softmax", 9, 2), ("sdpa_gqa", 61, 64)])
def test_toy_decoders_match_the_full_capture(kind, T, block):
    torch.manual_seed(T)
    lm = ToyLM(kind, n_kv_heads=2 if kind == "sdpa_gqa" else None).eval()
    ids = torch.randint(0, 40, (2, T))
    cache = probe.capture(lm, ids, keep="stats", block=block)
    assert cache.kept == "stats" and cache.partial and cache.metadata["keep"] == "stats"
    check_cache(cache, probe.capture(lm, ids))


def test_padded_gqa_decoder_and_bidirectional_encoder(bpe):
    llama = H.llama(len(bpe))
    got = check_cache(
        probe.capture(llama, TEXTS, tokenizer=bpe, keep="stats", block=3),
        probe.capture(llama, TEXTS, tokenizer=bpe),
    )
    assert got.kv_groups
    model, tok, _ = H.minilm()
    got = check_cache(
        probe.capture(model, TEXTS, tokenizer=tok, keep="stats"), probe.capture(model, TEXTS, tokenizer=tok)
    )
    assert not any(r["causal"] for r in got.table)


def test_cross_attention(bpe):
    model = H.bart(len(bpe))
    cache = probe.capture(model, TEXTS, tokenizer=bpe, target=TARGETS, keep="stats", block=3)
    got = check_cache(cache, probe.capture(model, TEXTS, tokenizer=bpe, target=TARGETS))
    assert {r["kind"] for r in got.table} == {"self", "cross"}


def test_saved_file_reads_back_the_same_and_merges(tmp_path):
    torch.manual_seed(0)
    lm = ToyLM("sdpa_causal").eval()
    ids = torch.randint(0, 40, (2, 30))
    path = tmp_path / "s.safetensors"
    cache = probe.capture(lm, ids, keep="stats", out=path)
    assert cache.path is not None and path.exists()
    loaded = probe.load(path)
    assert loaded.kept == "stats"
    full = probe.capture(lm, ids)
    check_cache(loaded, full)
    # several stats caches (and full ones) merge: the mean over every text's values
    other = torch.randint(0, 40, (1, 30))
    merged = probe.head_stats([loaded, probe.capture(lm, other, keep="stats")], progress=False)
    oracle = probe.head_stats([full, probe.capture(lm, other)], progress=False)
    assert_same(merged, oracle)
    # what a safetensors reader sees: the documented keys, metadata keep="stats"
    import json

    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["probe"])
        assert meta["keep"] == "stats" and meta["stats"]["metrics"]
        e = f.get_tensor("decoder.blocks.0.self_attn.stat.entropy")
        assert e.shape == full.pattern("decoder", 0).shape[:2]


def test_pattern_readers_say_what_was_kept():
    lm = ToyLM("sdpa_causal").eval()
    cache = probe.capture(lm, torch.randint(0, 40, (1, 12)), keep="stats")
    with pytest.raises(ProbeError, match=r"keep='stats'.*probe.head_stats\(cache\)") as e:
        cache.pattern("decoder", 0)
    assert "\n" not in str(e.value)
    with pytest.raises(ProbeError, match="keep='stats'"):
        probe.check_causal(cache)


def test_bad_arguments():
    lm = ToyLM("sdpa_causal").eval()
    ids = torch.randint(0, 40, (1, 12))
    with pytest.raises(ProbeError, match="heads="):
        probe.capture(lm, ids, keep="stats", heads=[0])
    with pytest.raises(ProbeError, match="dtype="):
        probe.capture(lm, ids, keep="stats", dtype="float16")
    with pytest.raises(ProbeError, match="block"):
        probe.capture(lm, ids, keep="stats", block=0)
    with pytest.raises(ProbeError, match="block="):
        probe.capture(lm, ids, block=4)
    with pytest.raises(ProbeError, match="probe.capture"):
        with probe.trace(lm, keep="stats"):
            lm(ids)
    from probe.capture.engine.trace import capture as engine_capture

    with pytest.raises(ProbeError, match="top-level"):
        engine_capture(lm, ids, keep="stats")
    # a layer selection keeps those layers' statistics
    cache = probe.capture(lm, ids, keep="stats", layers=[1])
    s = probe.head_stats(cache, progress=False)
    assert {r["layer"] for r in s.table} == {1}


def test_cli_capture_keep_stats(tmp_path):
    out = tmp_path / "s.safetensors"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "probe",
            "capture",
            "--model",
            "minigpt",
            "attention lets tokens read.",
            "--keep",
            "stats",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    import models

    text = "attention lets tokens read."
    check_cache(probe.load(out), probe.capture(models.load("minigpt"), text))
    info = subprocess.run([sys.executable, "-m", "probe", "info", str(out)], capture_output=True, text=True)
    assert info.returncode == 0 and "statistics" in info.stdout


def test_corpus_keep_stats_streams_and_equals_the_pattern_path(tmp_path, monkeypatch):
    """``run_corpus(keep="stats")`` computes each batch's statistics block by block (no whole
    pattern is stored by any capture it runs), equal to the run that captures whole patterns
    (keep="all", the statistics from full patterns) on the same texts and batches."""
    import models
    from probe.capture.consumers import keep as full_keep

    texts = ["attention lets tokens read.", "hi there", "a cat sat", "tokens read the context", "one"]
    model = models.load("minigpt")
    stored = []
    real = full_keep.KeepPatterns.close

    def spy(self, attn):
        stored.append(1)
        return real(self, attn)

    monkeypatch.setattr(full_keep.KeepPatterns, "close", spy)
    streamed = probe.run_corpus(
        model, texts, tmp_path / "s", batch_size=2, shard_size=3, examples=False, progress=False
    )
    assert not stored  # the stats run never handed a pattern to the whole-pattern consumer
    # (the examples pass, left out here, captures its chosen texts again with whole patterns:
    # docs/explore.md)
    full = probe.run_corpus(
        model, texts, tmp_path / "f", batch_size=2, shard_size=3, keep="all", progress=False
    )
    assert stored
    assert_same(streamed.head_stats(), full.head_stats())
    # and the full run's statistics are those of its caches (the independent path)
    assert_same(full.head_stats(), probe.head_stats(probe.open_corpus(tmp_path / "f"), progress=False))


def _report_text(path) -> str:
    import html as _html
    import re

    raw = (
        (path / "index.html").read_text(encoding="utf-8")
        if path.is_dir()
        else path.read_text(encoding="utf-8")
    )
    return _html.unescape(re.sub(r"\s+", " ", raw))


def test_report_of_a_stats_cache_shows_the_statistics_and_says_what_was_not_kept(tmp_path):
    import models

    model = models.load("minigpt")
    texts = ["attention lets tokens read.", "hi there"]
    cache = probe.capture(model, texts, keep="stats")
    page = _report_text(probe.report(cache, tmp_path / "r", progress=False))
    assert (
        "This cache kept each head's statistics and the residual norms only, not whole attention patterns"
        in page
    )
    assert "Not kept: the attention weights themselves" in page
    assert "attention rollout" in page and "not computed: rollout" in page
    assert "sink profile" in page and "distance curves" in page
    assert "Heads: focus statistics and roles" in page
    # the statistics the page shows equal the full capture's
    want = probe.head_stats(probe.capture(model, texts), progress=False)
    got = probe.head_stats(cache, progress=False)
    assert_same(got, want)


def test_cli_report_keep_stats(tmp_path):
    out = tmp_path / "rep"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "probe",
            "report",
            "--model",
            "minigpt",
            "--keep",
            "stats",
            "attention lets tokens read.",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    page = _report_text(out)
    assert "each head's statistics and the residual norms only" in page and "Not kept" in page
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "probe",
            "report",
            "--model",
            "minigpt",
            "--keep",
            "stat",
            "x",
            "-o",
            str(tmp_path / "b"),
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--keep stat" in bad.stderr


def test_residual_readers_say_only_norms_were_kept():
    lm = ToyLM("sdpa_causal").eval()
    cache = probe.capture(lm, torch.randint(0, 40, (1, 12)), keep="stats")
    with pytest.raises(ProbeError, match=r"keep='stats'.*norm") as e:
        probe.residual(cache)
    assert "\n" not in str(e.value)


def test_report_residual_norms_of_a_stats_cache_equal_the_full_capture(tmp_path):
    """The report's residual-norm series of a keep="stats" cache (its per-position norms) equal
    the L2 norms computed here from the full capture's residual tensors, and the section shows."""
    from probe.report import figures

    torch.manual_seed(0)
    lm = ToyLM("sdpa_causal").eval()
    ids = torch.randint(0, 40, (2, 15))
    stats, full = probe.capture(lm, ids, keep="stats"), probe.capture(lm, ids)
    for b in range(2):
        got = figures.residual_norm_values(stats, "decoder", b)
        assert set(got) == {"resid_pre", "resid_post", "self_attn.delta", "mlp.delta"}
        for name, (layers, values) in got.items():
            for layer, v in zip(layers, values, strict=True):
                want = full[f"decoder.blocks.{layer}.{name}"][b].double().norm(dim=-1).mean().item()
                assert abs(v - want) <= 1e-6 * max(1.0, want), (name, layer, v, want)
    page = _report_text(probe.report(stats, tmp_path / "r", progress=False))
    assert "Residual stream norms" in page


def test_distance_curves_keep_every_layer_visible():
    # layers with equal curves lay on one another and L0 hid behind L1: each has its own hollow
    # marker and dash now, the markers shrinking with depth
    import models
    from probe.report.sections import kept

    cache = probe.capture(models.load("minigpt"), "attention lets tokens read.", keep="stats")

    class Ctx:
        figure = staticmethod(lambda fig, label: fig)

    lines = kept._distance_item(Ctx, 0, cache, "decoder", [0, 1], "decoder")["fig"].axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["L0", "L1"]
    assert len({(line.get_marker(), line.get_linestyle()) for line in lines}) == 2
    assert lines[0].get_markersize() > lines[1].get_markersize()
    assert all(line.get_fillstyle() == "none" for line in lines)
