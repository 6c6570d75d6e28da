"""probe.export: a cache as BertViz and CircuitsVis take it, checked by opening it with the real
packages (the ``interop`` extra) and, for CircuitsVis's offline page, in headless Chromium.

Oracles: the cache's own tensors and token metadata (what the model computed), never the export.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import report_caches as rc
import torch

import models
import probe
from probe.export import bertviz_html, bertviz_inputs, circuitsvis_html, circuitsvis_inputs, params_json

bertviz = pytest.importorskip("bertviz")  # installed by the dev extra; skipped only outside it
circuitsvis_attention = pytest.importorskip("circuitsvis.attention")

TEXTS = ["attention lets tokens read.", "tokens read."]  # the second is padded


@pytest.fixture(scope="module")
def gpt():
    return probe.capture(models.load("minigpt"), TEXTS)


@pytest.fixture(scope="module")
def translator_like():
    return rc.encoder_decoder()  # nn.Transformer traced: encoder, decoder and cross-attention


def _real(cache, b: int) -> int:
    return sum(cache.metadata["attention_mask"][b])


def test_bertviz_inputs_are_the_cached_weights_of_one_text(gpt):
    n = _real(gpt, 1)
    kw = gpt.to_bertviz(batch=1)
    assert set(kw) == {"attention", "tokens"} and kw["tokens"] == gpt.tokens[1]
    assert isinstance(kw["attention"], tuple) and len(kw["attention"]) == 2  # one per layer
    for layer, a in enumerate(kw["attention"]):
        assert a.shape == (1, 4, n, n) and a.dtype == torch.float32
        assert torch.equal(a[0], gpt.pattern("decoder", layer, batch=1)[:, :n, :n])  # padding left out
    assert kw.keys() == bertviz_inputs(gpt, 1).keys()


def test_bertviz_opens_them_and_its_page_holds_the_data(gpt):
    kw = bertviz_inputs(gpt, 0)
    for view in (bertviz.head_view, bertviz.model_view):
        html = view(**kw, html_action="return").data
        params = params_json(html, "const params = ")
        (data,) = params["attention"]
        assert data["left_text"] == data["right_text"] == gpt.tokens[0]
        got = torch.tensor(data["attn"])  # [layer, head, q, k], as BertViz will draw it
        want = torch.stack([gpt.pattern("decoder", i, batch=0) for i in (0, 1)])
        assert torch.equal(got, want)
    page = bertviz_html(gpt, view="model")
    assert page.startswith("<!DOCTYPE html>") and "cdnjs.cloudflare.com" in page  # BertViz's own loader
    assert torch.equal(torch.tensor(params_json(page, "const params = ")["attention"][0]["attn"]), want)


def test_bertviz_encoder_decoder_has_encoder_decoder_and_cross(translator_like):
    c = translator_like
    kw = c.to_bertviz()
    assert kw["encoder_tokens"] == rc.SOURCE and kw["decoder_tokens"] == rc.TARGET
    assert [t.shape for t in kw["cross_attention"]] == [(1, 2, 5, 4)] * 2
    assert torch.equal(kw["encoder_attention"][1], c.pattern("encoder", 1))  # [1, heads, q, k]
    assert torch.equal(kw["decoder_attention"][0], c.pattern("decoder", 0))
    assert torch.equal(kw["cross_attention"][1], c.pattern("decoder", 1, "cross"))
    params = params_json(bertviz.head_view(**kw, html_action="return").data, "const params = ")
    names = [d["name"] for d in params["attention"]]
    assert names == ["Encoder", "Decoder", "Cross"]
    cross = params["attention"][2]
    assert cross["left_text"] == rc.TARGET and cross["right_text"] == rc.SOURCE
    assert torch.equal(
        torch.tensor(cross["attn"]), torch.stack([c.pattern("decoder", i, "cross")[0] for i in (0, 1)])
    )


def test_bertviz_refuses_a_layer_or_head_subset_it_would_misnumber():
    gpt = models.load("minigpt")
    with pytest.raises(probe.ProbeError, match=r"BertViz numbers layers by position.*layers \[1\]"):
        bertviz_inputs(probe.capture(gpt, "attention", layers=[1]))
    with pytest.raises(probe.ProbeError, match=r"BertViz numbers heads by position.*heads \[2, 3\]"):
        bertviz_inputs(probe.capture(gpt, "attention", heads=[2, 3]))
    # CircuitsVis names every head, so the subset is fine there
    kw = circuitsvis_inputs(probe.capture(gpt, "attention", layers=[1], heads=[2, 3]))
    assert kw["attention_head_names"] == ["L1H2", "L1H3"]


def test_circuitsvis_inputs_and_its_rendered_props(gpt):
    n = _real(gpt, 1)
    kw = gpt.to_circuitsvis(batch=1)
    assert kw["tokens"] == gpt.tokens[1]
    assert kw["attention_head_names"] == [f"L{i}H{h}" for i in (0, 1) for h in range(4)]
    want = torch.cat([gpt.pattern("decoder", i, batch=1)[:, :n, :n] for i in (0, 1)])
    assert torch.equal(kw["attention"], want)
    props = params_json(
        circuitsvis_attention.attention_heads(**kw).local_src, "CircuitsVis.AttentionHeads,\n"
    )
    assert props["tokens"] == gpt.tokens[1] and props["attentionHeadNames"] == kw["attention_head_names"]
    assert torch.equal(torch.tensor(props["attention"]), want)
    one = circuitsvis_inputs(gpt, layers=[1])
    assert torch.equal(
        one["attention"], gpt.pattern("decoder", 1, batch=0)[:, : _real(gpt, 0), : _real(gpt, 0)]
    )
    with pytest.raises(probe.ProbeError, match=r"layers \[7\] are not in this cache's decoder stack"):
        circuitsvis_inputs(gpt, layers=[7])


def test_circuitsvis_shows_an_encoder_decoders_self_attention_stacks(translator_like):
    enc = circuitsvis_inputs(translator_like, stack="encoder")
    assert enc["tokens"] == rc.SOURCE and enc["attention"].shape == (4, 4, 4)
    dec = circuitsvis_inputs(translator_like)  # the decoder by default
    assert dec["tokens"] == rc.TARGET and dec["attention"].shape == (4, 5, 5)


def test_hostile_tokens_stay_data_in_both_pages():
    cache = rc.hostile()
    for page, marker in (
        (bertviz_html(cache), "const params = "),
        (circuitsvis_html(cache), "CircuitsVis.AttentionHeads,\n"),
    ):
        # the data line holds no "<" at all, so no token can close the script or open markup
        start = page.index(marker) + len(marker)
        assert "<" not in page[start : page.index("\n", start + 1)]
        assert rc.HOSTILE not in page and rc.SCRIPT_END not in page
        props = params_json(page, marker)
        tokens = props["tokens"] if "tokens" in props else props["attention"][0]["left_text"]
        assert rc.HOSTILE in tokens and rc.SCRIPT_END in tokens  # still the tokens, once parsed


def test_circuitsvis_page_renders_offline_in_a_browser(gpt, tmp_path):
    from probe.report.browser import browser

    path = tmp_path / "heads.html"
    path.write_text(circuitsvis_html(gpt), encoding="utf-8")
    with browser() as b:
        page = b.new_page()
        requests, errors = [], []
        page.on("request", lambda r: requests.append(r.url))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(path.resolve().as_uri())
        page.wait_for_function("() => document.body.innerText.includes('L1H3')", timeout=60_000)
        text = page.evaluate("document.body.innerText")
        page.close()
    assert errors == [] and [u for u in requests if not u.startswith("file:")] == []
    assert all(f"L{i}H{h}" in text for i in (0, 1) for h in range(4))


def _probe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "probe", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_cli_export(gpt, tmp_path):
    gpt.save(tmp_path / "run.safetensors")
    r = _probe("export", "run.safetensors", "--bertviz", "bv.html", "--circuitsvis", "cv.html", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "wrote bv.html" in r.stdout and "loads its scripts from the internet" in r.stdout
    assert "wrote cv.html" in r.stdout and "works offline" in r.stdout
    page = (tmp_path / "cv.html").read_text(encoding="utf-8")
    props = params_json(page, "CircuitsVis.AttentionHeads,\n")
    assert torch.equal(torch.tensor(props["attention"][:4]), gpt.pattern("decoder", 0, batch=0))
    r = _probe("export", "run.safetensors", "--bertviz", "bv.txt", cwd=tmp_path)
    assert r.returncode == 2 and "give an .html file name" in r.stderr and not (tmp_path / "bv.txt").exists()
    r = _probe("export", "run.safetensors", cwd=tmp_path)
    assert r.returncode == 2 and "nothing to export" in r.stderr
