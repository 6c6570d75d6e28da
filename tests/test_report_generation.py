"""The report's generation section: the rows it embeds, and the page in Chromium.

Oracles: minigpt's own head weights and the aligner's own returned cross-attention (the models'
code, not probe), the embedded blocks decoded here (base64, zlib, the byte layout read with
numpy), and the strings the tests put in.
"""

from __future__ import annotations

import base64
import json
import re
import zlib

import numpy as np
import pytest
import torch
from generation_caches import aligner_generation, llava_pair, minigpt_generation, minigpt_weights

import models
import probe
from probe.report.browser import browser, open_report
from probe.report.context import ReportContext
from probe.report.html import discover, render

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ALLOWED = ("file:", "data:", "blob:")


def _report(cache, folder):
    """The generation section alone, as a page (``folder/index.html``); the whole report of a
    generation is written by tests/test_cli_generate.py."""
    text = render(ReportContext(caches=[cache]), [x for x in discover() if x.name == "generation"])
    out = folder / "index.html"
    out.write_text(text, encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def gpt():
    return models.load("minigpt")


@pytest.fixture(scope="module")
def minigpt_page(gpt, tmp_path_factory):
    cache, ids, new = minigpt_generation(gpt)
    path = _report(cache, tmp_path_factory.mktemp("gen"))
    return cache, ids, new, minigpt_weights(gpt, ids + new[:-1]), path


@pytest.fixture(scope="module")
def aligner_page(tmp_path_factory):
    model = models.load("aligner")
    cache, read = aligner_generation(model)
    src = torch.tensor([cache.metadata["ids"][0]])
    with torch.no_grad():
        cross = [w[0].double() for w in model(src, torch.tensor([read]))[3]]  # the model's own
    return cache, cross, _report(cache, tmp_path_factory.mktemp("gen2"))


@pytest.fixture(scope="module")
def chromium():
    with browser() as b:
        yield b


def _views(page: str) -> list[dict]:
    section = page.split('id="sec-generation"')[1]
    found = re.findall(r'<script type="application/json" class="probe-data">(.*?)</script>', section)
    return [json.loads(t) for t in found]


def _decode(b64: str, n_rows: int, n_keys: int) -> np.ndarray:
    raw = zlib.decompress(base64.b64decode(b64))
    assert len(raw) == 8 * n_rows + n_rows * n_keys
    mx = np.frombuffer(raw[: 4 * n_rows], dtype="<f4").astype(float)
    q = np.frombuffer(raw[8 * n_rows :], dtype=np.uint8).reshape(n_rows, n_keys)
    return q / 255.0 * mx[:, None], mx


def _check(b64: str, want: torch.Tensor) -> None:
    got, mx = _decode(b64, *want.shape)
    want = want.numpy()
    np.testing.assert_allclose(mx, want.max(1), rtol=1e-6, atol=1e-7)
    assert (np.abs(got - want) <= want.max(1, keepdims=True) / 510 + 1e-6).all()


def test_self_view_embeds_the_rows_that_wrote_each_token(minigpt_page):
    cache, ids, new, weights, path = minigpt_page
    P, N = len(ids), len(new)
    page = path.read_text(encoding="utf-8")
    (d,) = _views(page)
    assert d["kind"] == "self" and d["mapped"] == list(range(N)) and d["nHeads"] == 4
    assert d["keys"] == [probe.report.labels.display(t, None) for t in cache.metadata["tokens"][0]]
    assert d["reach"] == [P + t for t in range(N)] and d["nPrompt"] == P
    assert d["outKey"] == [P + t for t in range(N - 1)] + [-1]
    for e in d["layers"]:
        w = weights[e["layer"]][:, P - 1 : P - 1 + N]  # [H, N, T]: the writing rows
        _check(e["mean"], w.mean(0))
        for h, block in enumerate(e["heads"]):
            _check(block, w[h])
        # the readout's ratios: per head, then the mean of the heads' ratios
        r = e["ratio"]
        assert r[0][0] is None and len(r) == 5
        t, h = 4, 2
        ctx, out = float(w[h, t, :P].mean()), float(w[h, t, P : P + t].mean())
        assert r[h][t] == pytest.approx(ctx / (ctx + out), abs=1e-4)
    text = re.sub(r"<[^>]+>", "", page.split('id="sec-generation"')[1])
    assert "attention lets" + cache.metadata["generation"]["output_text"] in text


def test_cross_view_is_the_alignment_as_written(aligner_page):
    cache, cross, path = aligner_page
    views = _views(path.read_text(encoding="utf-8"))
    assert [v["kind"] for v in views] == ["self", "cross"]
    d = views[1]
    assert d["keys"] == cache.metadata["tokens"][0] and d["out"][-1] == "E"
    for e in d["layers"]:
        _check(e["mean"], cross[e["layer"]].mean(0))  # rows 0..N-1 wrote tokens 0..N-1 (prompt: S)
        for h, block in enumerate(e["heads"] or []):
            _check(block, cross[e["layer"]][h])


def _clean(log):
    assert log.errors == [] and [m for m in log.console if m[0] in ("error", "warning")] == []
    assert [u for u in log.requests if not u.startswith(ALLOWED)] == []


def _ready(page):
    page.wait_for_function("() => document.documentElement.dataset.probeGenReady === '1'")


def test_hovering_a_generated_token_shows_what_it_read(chromium, minigpt_page):
    cache, ids, new, weights, path = minigpt_page
    P = len(ids)
    page, log = open_report(chromium, path)
    _ready(page)
    view = page.locator(".probe-genview").first
    readout = view.locator(".probe-readout")
    assert view.get_attribute("data-step") == str(len(new) - 1)  # starts at the last token
    for t in (3, 7):
        view.locator(f'.tok[data-t="{t}"]').hover()
        page.wait_for_function(f"() => document.querySelector('.probe-genview').dataset.step === '{t}'")
        text = readout.text_content()
        assert f"(generated token {t})" in text and text.startswith("Layer 1, mean over heads")
        row = weights[1][:, P - 1 + t].mean(0)
        top = int(row.argmax())
        m = re.search(r"read most: \u201c(.*?)\u201d ([0-9.]+)", text)
        assert m.group(1) == probe.report.labels.display(cache.metadata["tokens"][0][top], None)
        assert float(m.group(2)) == pytest.approx(float(row[top]), abs=float(row.max()) / 510 + 1e-4)
        # what it could not read (later tokens) is dimmed, what it read is shaded
        chips = view.locator(".probe-gen-keys .tok")
        assert "unread" in chips.nth(P + t).get_attribute("class")
        assert "unread" not in (chips.nth(P + t - 1).get_attribute("class") or "")
        assert chips.nth(top).evaluate("e => e.style.background") != ""
    # keys: ] moves to head 1, PgUp to layer 0, the arrow to the next token
    page.mouse.move(0, 0)  # the keyboard alone from here (a hovered chip would take the view back)
    view.locator('.tok[data-t="7"]').focus()
    page.keyboard.press("]")
    page.keyboard.press("]")
    page.keyboard.press("PageUp")
    page.keyboard.press("ArrowRight")
    page.wait_for_function(
        "() => (d => d.step === '8' && d.layer === '0' && d.head === '1')"
        "(document.querySelector('.probe-genview').dataset)"
    )
    assert readout.text_content().startswith("Layer 0, head 1:")
    _clean(log)
    page.close()


def test_chinese_text_and_the_cross_view_in_the_browser(chromium, aligner_page, gpt, tmp_path):
    cache, _, path = aligner_page
    page, log = open_report(chromium, path)
    _ready(page)
    cross = page.locator('.probe-genview[data-kind="cross"]')
    cross.locator('.probe-gen-out .tok[data-t="2"]').hover()
    page.wait_for_function(
        "() => document.querySelector('.probe-genview[data-kind=cross]').dataset.step === '2'"
    )
    assert "of the source:" in cross.locator(".probe-readout").text_content()
    _clean(log)
    page.close()
    # a prompt and output in Chinese: the chips and the text show them as given
    zh, _, _ = minigpt_generation(gpt)
    zh.metadata["tokens"][0][:3] = ["注", "意", "力"]
    zh.metadata["generation"]["prompt_text"] = "注意力 lets"
    page, log = open_report(chromium, _report(zh, tmp_path))
    _ready(page)
    chips = page.locator(".probe-genview .probe-gen-keys .tok")
    assert [chips.nth(i).text_content() for i in range(3)] == ["注", "意", "力"]
    assert "注意力 lets" in page.locator(".probe-gen-text").first.text_content()
    _clean(log)
    page.close()


def test_a_stats_generation_shows_its_text_and_a_one_line_note(gpt, tmp_path):
    cache, _, _ = minigpt_generation(gpt, keep="stats")
    page = _report(cache, tmp_path).read_text(encoding="utf-8")
    section = page.split('id="sec-generation"')[1].split("</section>")[0]
    assert '<p class="probe-note">this generation cache kept each head' in section
    assert cache.metadata["generation"]["output_text"] in section  # the text is still shown


@pytest.mark.slow  # a LLaVA-shaped model generating beside its eager twin: seconds each
def test_a_picture_in_the_prompt_adds_the_share_on_its_image_tokens(tmp_path):
    """A LLaVA-shaped generation: the rows embedded are eager generate's own per-step rows."""
    model, eager, inputs = llava_pair()
    g = probe.generate(model, inputs, max_new_tokens=4, min_new_tokens=4)
    with torch.no_grad():
        out = eager.generate(
            **inputs, max_new_tokens=4, min_new_tokens=4, output_attentions=True, return_dict_in_generate=True
        )
    page = _report(g.cache, tmp_path).read_text(encoding="utf-8")
    assert "and on the prompt&#39;s image tokens" in page or "and on the prompt's image tokens" in page
    (d,) = _views(page)
    for e in d["layers"]:
        rows = [out.attentions[t][e["layer"]][0, :, -1].double() for t in range(4)]  # [H, keys so far]
        want = torch.zeros(4, 4, 24, dtype=torch.float64)
        for t, r in enumerate(rows):
            want[:, t, : r.shape[-1]] = r
        _check(e["mean"], want.mean(0))


def test_rows_and_topk_generations_embed_what_they_kept(gpt, tmp_path):
    ids = gpt.tokenizer.encode("attention lets")
    g = probe.generate(gpt, "attention lets", max_new_tokens=8, keep="rows")
    new = g.new_ids[0].tolist()
    weights = minigpt_weights(gpt, ids + new[:-1])
    P = len(ids)
    (d,) = _views(_report(g.cache, tmp_path).read_text(encoding="utf-8"))
    assert d["unknownAsZero"] is False
    for e in d["layers"]:
        _check(e["mean"], weights[e["layer"]][:, P - 1 : P - 1 + 8].mean(0))
    top = probe.generate(gpt, "attention lets", max_new_tokens=8, keep={"topk": 4})
    (d,) = _views(_report(top.cache, tmp_path).read_text(encoding="utf-8"))
    assert d["unknownAsZero"] is True  # the other keys of a row are not kept: drawn as 0, said so
