"""The picture section's hover views: the maps the page embeds, and the page in Chromium.

Oracles: HF eager ``output_attentions`` with the same weights (the maps computed here from them),
the embedded blocks decoded here (base64, zlib, the byte layout read with numpy), matplotlib's
inferno colours for the pixels the page draws, and the strings the tests put in.
"""

from __future__ import annotations

import base64
import io
import json
import re
import zlib

import numpy as np
import pytest
import torch
from test_images import SMALL, _eager, _llava, _pair, _vit

import probe
from probe.report.browser import browser, open_report
from probe.report.context import ReportContext
from probe.report.html import discover, render
from probe.report.sections import _image_hover as hv
from probe.report.sections import images

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
LM = "model.language_model.layers"
IDS = [1, 5] + [95] * 16 + [7] + [95] * 16 + [8, 9]  # two pictures of 4 x 4 image tokens in one text


@pytest.fixture(scope="module")
def vit():
    """A ViT with a non-square 4 x 6 grid, two pictures; eager's weights ``[layer][b, h, q, k]``."""
    model, eager = _vit()
    x = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(1))
    return probe.capture(model, {"pixel_values": x}), [w.double() for w in _eager(eager, pixel_values=x)]


@pytest.fixture(scope="module")
def llava():
    """A LLaVA-shaped model on one text holding two pictures; the language model's eager weights."""
    model, eager = _llava()
    ids = torch.tensor([IDS])
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    inputs = {"input_ids": ids, "pixel_values": pixels, "attention_mask": torch.ones_like(ids)}
    cache = probe.capture(model, inputs)
    with torch.no_grad():
        want = eager(**inputs, output_attentions=True).attentions
        tower = eager.model.vision_tower(pixels, output_attentions=True).attentions
    return cache, [w.double() for w in want], [w.double() for w in tower]


def _decode(b64: str, n_queries: int, n_patches: int):
    """A block as the page reads it: ``[max f32 x Q][sum f32 x Q][u8 x Q x P]``."""
    raw = zlib.decompress(base64.b64decode(b64))
    assert len(raw) == 8 * n_queries + n_queries * n_patches
    mx = np.frombuffer(raw[: 4 * n_queries], dtype="<f4").astype(float)
    total = np.frombuffer(raw[4 * n_queries : 8 * n_queries], dtype="<f4").astype(float)
    q = np.frombuffer(raw[8 * n_queries :], dtype=np.uint8).reshape(n_queries, n_patches)
    return q, mx, total


def _check_block(b64: str, want: torch.Tensor) -> None:
    """The block holds ``want`` ``[Q, P]``: each weight within its map's max / 510, max and sum as floats."""
    want = want.numpy()
    q, mx, total = _decode(b64, *want.shape)
    np.testing.assert_allclose(mx, want.max(1), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(total, want.sum(1), rtol=1e-6, atol=1e-7)
    err = np.abs(q / 255.0 * mx[:, None] - want)
    assert (err <= want.max(1, keepdims=True) / 510 + 1e-6).all(), err.max()
    # each map on its own scale: its largest weight the top step (a map of zeros stays zeros)
    assert (q.max(1) == np.where(want.max(1) > 0, 255, 0)).all()


def _render(cache, out) -> str:
    """The picture section alone, as a page (``out``: its index.html); returns the page's text."""
    text = render(ReportContext(caches=[cache]), [x for x in discover() if x.name == "images"])
    out.write_text(text, encoding="utf-8")
    return text


def _views(page: str) -> list[dict]:
    """Every hover view's data, as the page embeds it (JSON, its <, >, & escaped)."""
    found = re.findall(r'<script type="application/json" class="probe-data">(.*?)</script>', page)
    return [json.loads(t) for t in found]


@pytest.fixture(scope="module")
def vit_page(vit, tmp_path_factory):
    out = tmp_path_factory.mktemp("vit") / "index.html"
    _render(vit[0], out)
    return out


@pytest.fixture(scope="module")
def llava_page(llava, tmp_path_factory):
    """The LLaVA page with three of its words in Chinese (tokens 0, 1 and 35)."""
    tokens = llava[0].metadata["tokens"][0]
    kept = list(tokens)
    tokens[0], tokens[1], tokens[35] = "注意", "力", "机"
    out = tmp_path_factory.mktemp("llava") / "index.html"
    try:
        _render(llava[0], out)
        return out
    finally:
        tokens[:] = kept


def test_patch_maps_are_the_eager_weights_quantised(vit, vit_page):
    cache, want = vit
    vit_page = vit_page.read_text(encoding="utf-8")
    assert re.findall(r"<h3>([^<]*)</h3>", vit_page) == ["picture 0", "picture 1"]
    views = _views(vit_page)
    assert len(views) == 2 and "Embedded:" not in vit_page  # every layer and head fits
    for b, d in enumerate(views):
        assert (d["kind"], d["rows"], d["cols"], d["patch"], d["image"]) == ("patch", 4, 6, [8, 8], [32, 48])
        # the queries: [CLS] (a chip beside the picture), then the 24 patches: the sequence itself
        assert d["positions"] == list(range(25)) and d["nPrefix"] == 1 and d["labels"] == ["[CLS]"]
        assert d["nHeads"] == 4
        assert [e["layer"] for e in d["layers"]] == [0, 1]
        for e in d["layers"]:
            w = want[e["layer"]][b][:, :, 1:]  # [head, query, patch key]: the [CLS] column left out
            _check_block(e["mean"], w.mean(0))
            assert len(e["heads"]) == 4
            for h in range(4):
                _check_block(e["heads"][h], w[h])
        # and probe.attention_map's maps, patch by patch
        q, mx, _ = _decode(d["layers"][1]["mean"], 25, 24)
        for i, query in [(0, "cls"), (1, (0, 0)), (24, (3, 5)), (14, (2, 1))]:
            got = q[i] / 255.0 * mx[i]
            m = probe.attention_map(cache, 1, query=query, batch=b).double().reshape(-1).numpy()
            assert np.abs(got - m).max() <= m.max() / 510 + 1e-6
    assert re.search(r"256 steps of its own largest weight .*32-bit floats; [0-9.]+ MB of maps", vit_page)


def test_word_maps_are_the_eager_weights_quantised(llava, llava_page):
    cache, want, tower = llava
    llava_page = llava_page.read_text(encoding="utf-8")
    # the vision tower's pictures get patch views (and figures); the text one word view per picture
    assert re.findall(r"<h3>([^<]*)</h3>", llava_page) == [
        "picture 0",
        "picture 1",
        "What the words read: picture 0",
        "What the words read: picture 1",
    ]
    views = _views(llava_page)
    for b in range(2):  # the tower's batch is the pictures, not the texts
        _check_block(views[b]["layers"][1]["mean"], tower[1][b][:, :, 1:].mean(0))
    text = [0, 1, 18, 35, 36]  # the real text positions (the rest: two runs of 16 image tokens)
    for image, (d, offset) in enumerate(zip(views[2:], (2, 19), strict=True)):
        assert d["kind"] == "text" and d["positions"] == text and (d["rows"], d["cols"]) == (4, 4)
        assert d["labels"] == ["注意", "力", "7", "机", "9"]
        for e in d["layers"]:
            w = want[e["layer"]][0][:, text, offset : offset + 16]  # [head, text query, this picture]
            _check_block(e["mean"], w.mean(0))
            for h in range(4):
                _check_block(e["heads"][h], w[h])
        q, mx, _ = _decode(d["layers"][0]["mean"], 5, 16)
        m = probe.attention_map(cache, 0, query=36, stack=LM, image=image).double().reshape(-1).numpy()
        assert np.abs(q[4] / 255.0 * mx[4] - m).max() <= m.max() / 510 + 1e-6


def test_registers_are_queries_beside_the_picture():
    import transformers as tf

    cfg = tf.Dinov2WithRegistersConfig(**SMALL, image_size=28, patch_size=14, num_register_tokens=2)
    model, eager = _pair(tf.Dinov2WithRegistersModel, cfg)
    x = torch.randn(1, 3, 28, 42, generator=torch.Generator().manual_seed(5))  # 2 x 3 patches
    cache = probe.capture(model, {"pixel_values": x})
    v = hv.patch_view(cache, "encoder", cache.metadata["stacks"]["encoder"]["positions"], 0, "x")
    assert v.labels == ["[CLS]", "reg 0", "reg 1"] and v.queries == list(range(9))
    assert [(c["t"], c["q"]) for c in v.chips] == [("[CLS]", 0), ("reg 0", 1), ("reg 1", 2)]
    hv.plan([v])
    d = hv.view_data(v)
    assert d["nPrefix"] == 3 and (d["rows"], d["cols"]) == (2, 3)
    for e, w in zip(d["layers"], _eager(eager, pixel_values=x), strict=True):
        _check_block(e["mean"], w[0].double()[:, :, 3:].mean(0))  # every query over the 6 patches
        for h in range(4):
            _check_block(e["heads"][h], w[0].double()[h, :, 3:])


def test_the_budget_keeps_the_last_layer_and_spreads_the_rest(vit):
    cache, _ = vit
    pos = cache.metadata["stacks"]["encoder"]["positions"]
    v = hv.patch_view(cache, "encoder", pos, 0, "x")
    v.layers = list(range(12))  # as if the model had 12 layers: the plan reads only shapes
    per = 25 * 24  # [CLS] and 24 patches over 24 patches
    hv.plan([v], cells=4 * per)
    assert v.mean_layers == [0, 4, 7, 11] and v.head_layers == []
    v.mean_layers, v.head_layers = [], []
    hv.plan([v], cells=per)
    assert v.mean_layers == [11]
    v.mean_layers, v.head_layers = [], []
    hv.plan([v], cells=12 * per + 2 * 4 * per + per)  # every mean, then two layers of heads
    assert v.mean_layers == list(range(12)) and v.head_layers == [11, 10]
    # a stack whose stages have grids of their own (Swin): only the layers on the picture's grid
    staged = {**pos, "layer_grids": {"0": pos["grid"], "1": {**pos["grid"], "rows": 2, "cols": 3}}}
    assert hv.patch_view(cache, "encoder", staged, 0, "x").layers == [0]
    # two views share the budget: each its half of the means, then heads from the last layer down
    a, b = (hv.patch_view(cache, "encoder", pos, i, str(i)) for i in range(2))
    hv.plan([a, b], cells=2 * 2 * per + 4 * per)
    assert a.mean_layers == b.mean_layers == [0, 1] and (a.head_layers, b.head_layers) == ([1], [])


def test_a_long_text_maps_its_last_words(llava, monkeypatch):
    cache, want, _ = llava
    monkeypatch.setattr(hv, "MAX_WORDS", 3)
    views = hv.text_views(cache, LM, cache.metadata["stacks"][LM]["positions"], 1, [])
    assert [v.queries for v in views] == [[18, 35, 36]] * 2 and views[0].words_left_out == 2
    # every word is shown beside the picture; the first two are not mapped
    assert [(c["t"], c["q"]) for c in views[0].chips] == [
        ("1", None),
        ("5", None),
        ("[picture 0]", None),
        ("7", 0),
        ("[picture 1]", None),
        ("8", 1),
        ("9", 2),
    ]
    hv.plan(views)
    _check_block(hv.view_data(views[1])["layers"][1]["mean"], want[1][0][:, [18, 35, 36], 19:35].mean(0))
    assert images._layers_note(views[0]) == "the last 3 words' maps (the 2 before them are shown only)"


def test_a_page_over_budget_says_what_it_holds(monkeypatch, tmp_path):
    model, eager = _vit()
    x = torch.randn(1, 3, 32, 48, generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(hv, "MAP_CELLS", 25 * 24)  # one layer's head-mean maps
    page = _render(probe.capture(model, {"pixel_values": x}), tmp_path / "index.html")
    (d,) = _views(page)
    assert [e["layer"] for e in d["layers"]] == [1] and d["layers"][0]["heads"] is None
    _check_block(d["layers"][0]["mean"], _eager(eager, pixel_values=x)[1][0].double()[:, :, 1:].mean(0))
    assert (
        "Embedded: the maps of layers 1 of 2 are embedded (the page&#39;s budget); single heads for no "
        "layer (the rest: the mean over heads only)." in page
    )


# -- in Chromium ------------------------------------------------------------------------------------------
def _inferno() -> np.ndarray:
    import matplotlib

    return (matplotlib.colormaps["inferno"](np.linspace(0, 1, 256))[:, :3] * 255).round()


INFERNO = _inferno()


@pytest.fixture(scope="module")
def chromium():
    with browser() as b:
        yield b


def _open(chromium, path):
    page, log = open_report(chromium, path)
    page.wait_for_function("() => document.documentElement.dataset.probeImagesReady === '1'")
    return page, log


def _clean(log):
    assert log.errors == [] and [m for m in log.console if m[0] in ("error", "warning")] == []
    assert [u for u in log.requests if not u.startswith(("file:", "data:"))] == []


def _wait(page, view: int, query: int, layer: int, head: str = "mean"):
    page.wait_for_function(
        "([v, q, l, h]) => { const d = probe.imageViews[v].root.dataset;"
        " return d.query === String(q) && d.layer === String(l) && d.head === h; }",
        arg=[view, query, layer, head],
    )


def _drawn(page, view: int) -> np.ndarray:
    """The overlay's pixels as the page drew them: ``[rows * cols, 3]``."""
    from PIL import Image

    uri = page.evaluate("v => probe.imageViews[v].canvas.toDataURL('image/png')", view)
    img = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB")
    return np.asarray(img, dtype=float).reshape(-1, 3)


def _check_drawn(page, view: int, want: torch.Tensor) -> None:
    """Each patch's colour is inferno at its weight over the map's largest (one rounding step either way)."""
    drawn, want = _drawn(page, view), want.reshape(-1).numpy()
    steps = want / want.max() * 255 if want.max() > 0 else want * 0  # a map of zeros: the bottom colour
    for k, (got, x) in enumerate(zip(drawn, steps, strict=True)):
        near = [INFERNO[int(v)] for v in {int(np.floor(x)), min(255, int(np.ceil(x)))}]
        assert min(np.abs(got - c).max() for c in near) == 0, (k, got, x)


def _patch_point(page, view: int, r: int, c: int) -> tuple[float, float]:
    pic = page.locator("#sec-images .probe-pic").nth(view)
    pic.scroll_into_view_if_needed()
    box = pic.bounding_box()
    d = page.evaluate("v => probe.imageViews[v].data", view)
    sx, sy = box["width"] / d["image"][1], box["height"] / d["image"][0]
    return box["x"] + (c + 0.5) * d["patch"][1] * sx, box["y"] + (r + 0.5) * d["patch"][0] * sy


def test_hovering_a_patch_lays_its_map_over_the_picture(chromium, vit, vit_page):
    want = vit[1]
    page, log = _open(chromium, vit_page)
    assert page.locator("#sec-images .probe-imgview").count() == 2
    for view, (r, c) in [(0, (0, 0)), (0, (3, 5)), (1, (2, 1))]:
        page.mouse.move(*_patch_point(page, view, r, c))
        _wait(page, view, 1 + r * 6 + c, 1)
        w = want[1][view][:, 1 + r * 6 + c, 1:].mean(0)
        _check_drawn(page, view, w)
        readout = page.locator("#sec-images .probe-readout").nth(view).text_content()
        assert readout.startswith(f"Layer 1, mean over heads: patch ({r}, {c}) reads: ")
        first = re.search(r"reads: patch \(\d, \d\) ([0-9.]+)", readout)  # the largest weight first
        assert abs(float(first[1]) - float(w.max())) <= float(w.max()) / 510 + 5e-5
        assert f"{float(w.sum()):.4f} of its attention lands on the picture's patches" in readout
        # the hovered patch is outlined
        band = page.locator("#sec-images .probe-imgview").nth(view).locator(".band-cell").bounding_box()
        x, y = _patch_point(page, view, r, c)
        assert abs(band["x"] + band["width"] / 2 - x) < 1 and abs(band["y"] + band["height"] / 2 - y) < 1
    # another layer and one head: that head's map
    root = page.locator("#sec-images .probe-imgview").first
    root.locator(".sel-layer").select_option("0")
    root.locator(".sel-head").select_option("2")
    _wait(page, 0, 24, 0, "2")  # still the last patch hovered there, (3, 5)
    _check_drawn(page, 0, want[0][0][2, 24, 1:])
    assert "Layer 0, head 2: patch (3, 5) reads" in root.locator(".probe-readout").text_content()
    _clean(log)
    page.close()


def test_the_keyboard_moves_the_patch_and_changes_head_and_layer(chromium, vit, vit_page):
    want = vit[1]
    page, log = _open(chromium, vit_page)
    _wait(page, 0, 0, 1)  # before any hover: what [CLS] reads, no patch outlined
    _check_drawn(page, 0, want[1][0][:, 0, 1:].mean(0))
    assert page.locator("#sec-images .band-cell").first.is_hidden()
    page.locator("#sec-images .probe-pic").first.focus()
    _wait(page, 0, 1 + 2 * 6 + 3, 1)  # focused, the picture shows the middle patch (2, 3)
    page.keyboard.press("ArrowRight")
    _wait(page, 0, 1 + 2 * 6 + 4, 1)
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowDown")  # the last row: stays there
    _wait(page, 0, 1 + 3 * 6 + 4, 1)
    _check_drawn(page, 0, want[1][0][:, 23, 1:].mean(0))
    assert "patch (3, 4) reads" in page.locator("#sec-images .probe-readout").first.text_content()
    page.keyboard.press("]")  # head 0
    _wait(page, 0, 23, 1, "0")
    page.keyboard.press("PageUp")  # layer 0, still head 0
    _wait(page, 0, 23, 0, "0")
    _check_drawn(page, 0, want[0][0][0, 23, 1:])
    assert page.locator("#sec-images .sel-head").first.input_value() == "0"
    # a tap (a pointer press, no hover before it) picks a patch as well
    x, y = _patch_point(page, 0, 0, 4)
    page.evaluate(
        "([x, y]) => probe.imageViews[0].pic.dispatchEvent(new PointerEvent('pointerdown',"
        " { clientX: x, clientY: y, bubbles: true, pointerType: 'touch' }))",
        [x, y],
    )
    _wait(page, 0, 5, 0, "0")
    # [CLS] beside the picture: hover it, or Tab to it
    page.locator("#sec-images .probe-imgview").nth(1).locator(".probe-words .tok").hover()
    _wait(page, 1, 0, 1)
    _check_drawn(page, 1, want[1][1][:, 0, 1:].mean(0))
    assert (
        page.locator("#sec-images .probe-readout")
        .nth(1)
        .text_content()
        .startswith("Layer 1, mean over heads: [CLS] reads: ")
    )
    _clean(log)
    page.close()


def test_hovering_a_word_lays_what_it_reads_over_the_picture(chromium, llava, llava_page):
    want = llava[1]
    page, log = _open(chromium, llava_page)
    words = page.locator("#sec-images .probe-imgview[data-kind='text']")
    assert words.count() == 2
    text = [0, 1, 18, 35, 36]
    first = 2  # the two tower pictures' patch views come first
    for image, offset in ((0, 2), (1, 19)):
        view = first + image
        chips = words.nth(image).locator(".probe-words .tok")
        assert chips.all_text_contents() == ["注意", "力", "[picture 0]", "7", "[picture 1]", "机", "9"]
        for qi in (4, 2):  # "9" (it has read both pictures), then "7" (between them)
            words.nth(image).locator(f".tok[data-q='{qi}']").hover()
            _wait(page, view, qi, 1)
            _check_drawn(page, view, want[1][0][:, text[qi], offset : offset + 16].mean(0))
            assert words.nth(image).locator(f".tok[data-q='{qi}']").get_attribute("class") == "tok q"
        readout = words.nth(image).locator(".probe-readout").text_content()
        # a causal model's word before a picture reads none of it
        said = "reads: " if image == 0 else "reads none of this picture (weight 0 on every patch)"
        assert readout.startswith("Layer 1, mean over heads: \u201c7\u201d (position 18) " + said)
    # the keyboard: Tab to a word shows its map; the arrows go to the next word
    page.mouse.move(0, 0)  # the page's margin: no word under the pointer when the page scrolls
    words.first.locator(".tok[data-q='0']").focus()
    _wait(page, first, 0, 1)
    page.keyboard.press("ArrowRight")
    _wait(page, first, 1, 1)
    page.keyboard.press("Tab")
    _wait(page, first, 2, 1)
    page.keyboard.press("PageUp")
    _wait(page, first, 2, 0)
    _check_drawn(page, first, want[0][0][:, 18, 2:18].mean(0))
    # Chinese words are drawn with glyphs (not the missing-glyph box): two differ, and from a box
    shots = [words.first.locator(f".tok[data-q='{i}']").screenshot() for i in (1, 3)]
    page.evaluate(
        "() => { const s = document.querySelector('.probe-words .tok[data-q=\"3\"]').cloneNode();"
        " s.id = 'box'; s.textContent = '\\ue000'; document.querySelector('.probe-words').append(s); }"
    )
    box = page.locator("#box").screenshot()
    assert len({*shots, box}) == 3
    _clean(log)
    page.close()
