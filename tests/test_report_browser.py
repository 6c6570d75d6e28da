"""The report in a real browser: Debian's headless Chromium driven by Playwright (never skipped).

Oracles: the cache's own tensors (weights), the strings the tests put in (tokens), and pixels.
"""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import report_caches as rc

import probe
from probe.report.browser import browser, hover_cell, open_report, screenshot

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ALLOWED = ("file:", "data:", "blob:")


@pytest.fixture(scope="module")
def chromium():
    with browser() as b:
        yield b


@pytest.fixture(scope="module")
def minigpt_report(tmp_path_factory):
    import models

    cache = probe.capture(models.load("minigpt"), "attention lets tokens read.")
    tutorial = probe.plot.seed_caches(["minigpt"])  # the tutorial's own figures need its text
    return cache, probe.report(cache, tmp_path_factory.mktemp("minigpt"), progress=False, tutorial=tutorial)


def _clean(log):
    assert log.errors == [] and [m for m in log.console if m[0] in ("error", "warning")] == []
    assert [u for u in log.requests if not u.startswith(ALLOWED)] == []
    assert log.dialogs == []


def _weight(readout: str) -> float:
    return float(re.search(r"weight ([0-9.]+)", readout).group(1))


def test_report_loads_offline_and_hover_shows_the_cached_weight(chromium, minigpt_report):
    cache, path = minigpt_report
    page, log = open_report(chromium, path)
    scale = page.evaluate("probe.views[0].scale")
    for q, k in [(0, 0), (5, 2), (26, 13), (26, 26)]:
        readout = hover_cell(page, 0, q, k)
        want = cache.pattern("decoder", 0, head=0, batch=0)[q, k].item()
        assert f"query {q} " in readout and f"key {k} " in readout
        assert abs(_weight(readout) - want) <= 0.5 / scale + 1e-6, (q, k, readout)
        tip = page.locator(".probe-tooltip").first
        assert tip.is_visible() and f"{_weight(readout):.6f}" in tip.text_content()
    # keyboard: arrows move the cell, ] / PgDn change head / layer; the readout follows the cache
    page.locator(".probe-matrix").first.focus()
    page.keyboard.press("ArrowUp")
    page.keyboard.press("ArrowLeft")
    page.keyboard.press("]")
    page.keyboard.press("PageDown")
    readout = page.locator(".probe-readout").first.text_content()
    assert readout.startswith("Layer 1, Head 1: query 25 ")
    want = cache.pattern("decoder", 1, head=1, batch=0)[25, 25].item()
    assert abs(_weight(readout) - want) <= 0.5 / scale + 1e-6
    # hovering a key token in the strip shows its column
    page.locator(".probe-attn .tokens-k .tok").nth(3).hover()
    assert page.locator(".probe-readout").first.get_attribute("data-k") == "3"
    _clean(log)
    page.close()


def test_download_buttons_give_pngs_of_the_views(chromium, minigpt_report, tmp_path):
    from PIL import Image

    _, path = minigpt_report
    page, log = open_report(chromium, path)
    sizes = {}
    for button in ("btn-png-head", "btn-png-overview"):
        with page.expect_download() as dl:
            page.locator(f".probe-attn .{button}").first.click()
        out = tmp_path / dl.value.suggested_filename
        dl.value.save_as(out)
        assert out.suffix == ".png"
        sizes[button] = Image.open(out).size
    z = 768 // 27  # the explorer's export: 27 x 27 cells scaled to at most 768 px, plus a title band
    assert sizes["btn-png-head"] == (27 * z, 27 * z + 24)
    assert sizes["btn-png-overview"] == tuple(
        page.evaluate(
            "(() => { const c = document.querySelector('.probe-overview'); return [c.width, c.height]; })()"
        )
    )
    _clean(log)
    page.close()


def test_hostile_tokens_stay_text_and_run_nothing(chromium, tmp_path):
    path = probe.report(rc.hostile(), tmp_path, progress=False)
    page, log = open_report(chromium, path)
    hover_cell(page, 0, 1, 1)
    assert page.locator("img[src=x]").count() == 0
    # every script element is one of the report's own: JSON data blocks, or static code from the
    # templates; no token became (or broke out of) a script
    scripts = page.evaluate(
        "Array.from(document.querySelectorAll('script')).map(s => [s.type, s.textContent])"
    )
    assert [t for t, _ in scripts].count("application/json") >= 1
    assert all("alert(1)" not in text for t, text in scripts if t != "application/json")
    strip = page.locator("#sec-summary .probe-tokens .tok")
    assert strip.nth(1).text_content() == rc.HOSTILE and strip.nth(3).text_content() == rc.SCRIPT_END
    assert rc.HOSTILE in page.locator(".probe-tooltip").first.text_content()
    assert page.locator(".probe-model-name").text_content() == rc.HOSTILE
    _clean(log)  # includes: no dialog opened
    page.close()


def test_chinese_tokens_appear_with_real_glyphs(chromium, tmp_path):
    from hf_fixtures import minilm

    model, tok, _ = minilm()
    cache = probe.capture(model, "注意力 attention", tokenizer=tok)
    assert "力" in cache.tokens[0]
    path = probe.report([cache, rc.chinese()], tmp_path, progress=False)
    page, log = open_report(chromium, path)
    strips = page.locator("#sec-summary .probe-tokens").all_text_contents()
    assert "力" in strips[0] and "".join(rc.CHINESE) in strips[1]
    page.select_option(".probe-attn .sel-set", "1")
    page.wait_for_function("() => probe.views[0].set.qTokens[0] === '注意'")
    assert page.locator(".probe-attn .tokens-q .tok").first.text_content() == "注意"
    # a glyph, not the missing-glyph box: 力 and 机 draw differently, and differ from a private-use char
    shots = {}
    for ch in ("力", "机", "\ue000"):
        page.evaluate(
            "ch => { const s = document.createElement('span'); s.id = 'glyph'; s.className = 'tok';"
            " s.style.fontSize = '40px'; s.textContent = ch; document.body.prepend(s); }",
            ch,
        )
        shots[ch] = page.locator("#glyph").screenshot()
        page.evaluate("document.getElementById('glyph').remove()")
    assert len({shots[c] for c in shots}) == 3
    _clean(log)
    page.close()


def test_the_pages_chinese_is_drawn_from_its_embedded_font(chromium, minigpt_report):
    # the page carries the glyphs of its own CJK characters (the font probe ships), so the
    # tutorial caption reads right on a machine with no CJK font, offline
    _, path = minigpt_report
    page, log = open_report(chromium, path)
    faces = page.evaluate(
        "async () => { await document.fonts.load('16px \"Probe CJK Fallback\"', '被读取的位置');"
        " return [...document.fonts].filter(f => f.family.replaceAll('\"', '') === 'Probe CJK Fallback')"
        ".map(f => f.status); }"
    )
    assert faces == ["loaded"]
    shots = {}
    for ch in ("被", "读", "\ue000"):  # two glyphs and a private-use char (a box in any font)
        page.evaluate(
            "ch => { const s = document.createElement('span'); s.id = 'glyph';"
            " s.style.font = '40px \"Probe CJK Fallback\"'; s.textContent = ch; document.body.prepend(s); }",
            ch,
        )
        shots[ch] = page.locator("#glyph").screenshot()
        page.evaluate("document.getElementById('glyph').remove()")
    assert len(set(shots.values())) == 3
    _clean(log)
    page.close()


def test_screenshot_is_not_blank(chromium, minigpt_report, tmp_path):
    from PIL import Image

    _, path = minigpt_report
    out = screenshot(path, tmp_path / "shot.png", b=chromium)
    img = np.asarray(Image.open(io.BytesIO(out.read_bytes())).convert("RGB"))
    assert img.shape == (900, 1200, 3)
    colours = len(np.unique(img.reshape(-1, 3), axis=0))
    assert colours > 200 and img.std() > 20  # text, heatmap colours, not one flat colour


def test_long_text_explorer_stays_exact_and_overview_degrades(chromium, tmp_path):
    cache = rc.synthetic([f"t{i}" for i in range(2048)], n_layers=3, n_heads=2)  # 4 heads fit
    path = probe.report(cache, tmp_path, progress=False)
    page, log = open_report(chromium, path)
    readout = hover_cell(page, 0, 1500, 700)
    want = cache.pattern("decoder", 0, head=0, batch=0)[1500, 700].item()
    assert abs(_weight(readout) - want) <= 0.5 / 255 + 1e-6
    page.select_option(".probe-attn .sel-layer", "2")
    page.select_option(".probe-attn .sel-head", "1")
    assert page.locator(".explorer-note").first.is_visible()
    assert "max weight" in hover_cell(page, 0, 10, 5)
    _clean(log)
    page.close()


def test_cross_attention_view_is_rectangular_and_exact(chromium, tmp_path):
    cache = rc.encoder_decoder()
    page, log = open_report(chromium, probe.report(cache, tmp_path, progress=False))
    assert page.evaluate("[probe.views[1].set.nq, probe.views[1].set.nk]") == [5, 4]
    readout = hover_cell(page, 1, 4, 3)  # view 1: the cross-attention section's explorer
    assert "\u201cbeer\u201d \u2192 key 3 \u201cbier\u201d" in readout
    want = cache.pattern("decoder", 0, "cross", head=0, batch=0)[4, 3].item()
    assert abs(_weight(readout) - want) <= 0.5 / page.evaluate("probe.views[1].scale") + 1e-6
    # the square-root colour scale repaints without changing the numbers
    before = page.locator(".probe-matrix").nth(1).screenshot()
    page.select_option("#sec-cross_attention .sel-gamma", "0.5")
    assert page.locator(".probe-matrix").nth(1).screenshot() != before
    assert _weight(hover_cell(page, 1, 4, 3)) == _weight(readout)
    _clean(log)
    page.close()


def test_every_figure_has_a_download_link_to_its_own_png(chromium, minigpt_report, tmp_path):
    from PIL import Image

    _, path = minigpt_report
    page, log = open_report(chromium, path)
    # each visible figure: a "Download PNG" link in its figure (or its map switcher) giving its own bytes
    pairs = page.evaluate(
        """Array.from(document.images).filter(i => !i.hidden).map(i => {
             const box = i.closest('figure') || i.parentElement.parentElement;
             const a = box.querySelector('a.probe-download');
             const sec = i.closest('section').dataset.section;
             return [sec, i.src === (a && a.href), i.naturalWidth, i.naturalHeight];
           })"""
    )
    # (the causal audit draws no heatmap when every mass is exactly 0, as here: it says so in words)
    assert {p[0] for p in pairs} >= {"seeds", "residual_norms", "focus", "residual"}
    assert all(p[1] for p in pairs), [p for p in pairs if not p[1]]
    # the focus section's map switcher: the link follows the chosen map, and downloads it
    sel = page.locator("#sec-focus .probe-focus-select").first
    sel.select_option("2")
    group = sel.get_attribute("data-target")
    shown = page.locator(f"#{group} img").nth(2)
    link = page.locator(f"#{group}-png")
    assert link.get_attribute("href") == shown.get_attribute("src")
    with page.expect_download() as dl:
        link.click()
    out = tmp_path / dl.value.suggested_filename
    dl.value.save_as(out)
    assert Image.open(out).size == tuple(shown.evaluate("i => [i.naturalWidth, i.naturalHeight]"))
    _clean(log)
    page.close()


# -- the explorer's colour scale, its highlight and its labels ----------------------------------------
def _viridis(w: float) -> np.ndarray:
    """The colour of weight ``w`` on the report's scale: matplotlib's viridis (the oracle)."""
    import matplotlib

    return np.asarray(matplotlib.colormaps["viridis"](w)[:3]) * 255


def _pixel(page, x: float, y: float) -> np.ndarray:
    from PIL import Image

    shot = page.screenshot(clip={"x": x, "y": y, "width": 1, "height": 1})
    return np.asarray(Image.open(io.BytesIO(shot)).convert("RGB"), dtype=float)[0, 0]


def test_explorer_colour_scale_is_the_cells_colours_and_the_highlight_keeps_them(chromium, minigpt_report):
    cache, path = minigpt_report
    page, log = open_report(chromium, path)
    bar = page.locator(".probe-attn .probe-scale .probe-colorbar").nth(1)  # the explorer's
    assert bar.is_visible()
    bar.scroll_into_view_if_needed()
    assert page.locator(".probe-attn .probe-colorbar-label").nth(1).text_content() == (
        "attention weight, linear scale"
    )
    box = bar.bounding_box()
    left, right = box["x"] + 6, box["x"] + box["width"] - 6
    for w in (0.0, 0.3, 0.7, 0.98):
        x = left + w * (right - left)
        got = _pixel(page, x, box["y"] + 5)
        assert np.abs(got - _viridis((x - left + 0.5) / (right - left))).max() <= 4, (w, got)
    # hover a cell: its row and its column are outlined, and every cell keeps its weight's colour
    q, k = 12, 5
    hover_cell(page, 0, q, k)
    cv = page.locator(".probe-attn .probe-matrix").first.bounding_box()
    nq = nk = len(cache.tokens[0])
    zx, zy = cv["width"] / nk, cv["height"] / nq
    w = cache.pattern("decoder", 0, head=0, batch=0)
    for qq, kk in [(q, 0), (q, 3), (20, k), (q, k), (2, 1)]:  # in the row, in the column, the cell, outside
        got = _pixel(page, cv["x"] + (kk + 0.5) * zx, cv["y"] + (qq + 0.5) * zy)
        want = _viridis(float(w[qq, kk]))
        assert np.abs(got - want).max() <= 4, ((qq, kk), got, want)
    # the square-root scale: the same bar, ticks moved; a cell's colour is viridis(sqrt(weight))
    page.select_option("#sec-attention .sel-gamma", "0.5")
    assert "square-root scale" in page.locator(".probe-attn .probe-colorbar-label").nth(1).text_content()
    rgb = page.evaluate("probe.views[0].colourOf(0.25)")
    assert np.abs(np.asarray(rgb) - _viridis(0.5)).max() <= 2
    _clean(log)
    page.close()


def test_explorer_key_labels_fit_and_cjk_stands_upright(chromium, tmp_path):
    long = ["internationalization", "a", "注意力机制", "词元", "b"]
    page, log = open_report(chromium, probe.report(rc.synthetic(long), tmp_path, progress=False))
    labels = page.evaluate(
        """Array.from(document.querySelectorAll('.probe-attn .axis-k')).map(e => {
             const st = getComputedStyle(e);
             const fits = e.scrollHeight <= e.clientHeight + 1, across = e.scrollWidth <= e.clientWidth + 1;
             return [e.textContent, e.title, fits, across, st.writingMode, st.textOrientation, st.transform];
           })"""
    )
    assert [t for t, *_ in labels[:5]] == ["internation…", "a", "注意力机制", "词元", "b"]
    assert labels[0][1] == "internationalization"  # the full token on hover
    assert all(fits_h and fits_w for _, _, fits_h, fits_w, *_ in labels), labels
    # vertical writing, not a rotation: CJK characters stay upright, Latin runs top to bottom
    assert {(mode, orient, transform) for *_, mode, orient, transform in labels} == {
        ("vertical-rl", "mixed", "none")
    }
    rows = page.evaluate(
        "Array.from(document.querySelectorAll('.probe-attn .axis-q'))"
        ".map(e => e.scrollWidth <= e.clientWidth + 1)"
    )
    assert rows and all(rows)
    _clean(log)
    page.close()


def test_a_long_text_opens_collapsed_and_expands_on_demand(chromium, tmp_path):
    # a keep="stats" cache of a long input: the summary shows the first 40 and last 10 tokens and
    # the count, not a wall of chips before the first figure; all of them one click away
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (1, 300), generator=torch.Generator().manual_seed(1))
    cache = probe.capture(tf.LlamaForCausalLM(cfg).eval(), ids, keep="stats")
    page, log = open_report(chromium, probe.report(cache, tmp_path, progress=False))
    want = [str(i) for i in ids[0].tolist()]
    shown = page.locator("#sec-summary .probe-elided")
    assert shown.locator(".tok").all_text_contents() == want[:40] + want[-10:]
    assert "… 250 more …" in shown.text_content()
    every = page.locator("#sec-summary .probe-all-tokens .tok")
    assert every.count() == 300 and not every.first.is_visible()
    page.click("#sec-summary .probe-all-tokens summary")
    assert every.first.is_visible() and every.all_text_contents() == want
    _clean(log)
    page.close()


def test_an_image_report_shows_the_maps_on_the_picture(chromium, tmp_path):
    import numpy as np
    import torch
    import transformers as tf

    cfg = tf.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=(32, 48),
        patch_size=8,
    )
    torch.manual_seed(0)
    vit = tf.ViTModel(cfg).eval()
    pictures = [np.random.default_rng(i).integers(0, 256, (40, 60, 3), dtype=np.uint8) for i in range(2)]
    processor = tf.ViTImageProcessor(size={"height": 32, "width": 48})
    cache = probe.capture(vit, pictures, processor=processor)
    page, log = open_report(chromium, probe.report(cache, tmp_path, progress=False))
    section = page.locator("#sec-images")
    assert section.locator("h3").all_text_contents() == ["image 0", "image 1"]
    images = section.locator("figure img")
    # per picture: layer by layer with rollout, and the last layer's heads; distance against depth
    assert images.count() == 5
    sizes = page.evaluate("[...document.querySelectorAll('#sec-images figure img')].map(i => i.naturalWidth)")
    assert all(w > 100 for w in sizes)
    # each picture's hover view shows the picture the model saw (the cache's own PNG)
    shown = page.evaluate("[...document.querySelectorAll('#sec-images .probe-pic-img')].map(i => i.src)")
    assert shown == ["data:image/png;base64," + png for png in cache.metadata["image_png"]]
    page.wait_for_function("() => document.documentElement.dataset.probeImagesReady === '1'")
    _clean(log)
    page.close()
