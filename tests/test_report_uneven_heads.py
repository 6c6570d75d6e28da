"""A report of a model whose layers have different head counts: the zoo's induction model (4 heads
in layer 0, 1 in layer 1) shows each layer's own heads, and no head a layer does not have.

Oracles: the cache's own tensors (``cache.pattern``, the weights the model computed), the model's
config (``n_head = [4, 1]``), and what Chromium draws and offers (the head selector's options).
"""

from __future__ import annotations

import base64
import json
import re
import zlib

import numpy as np
import pytest

import models
import probe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
TEXT = "^wh4t+COMES/nexTwh4t+COMES/nexT"  # ^, then a segment of its base64 tokens twice


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    model = models.load("induction")
    assert list(model.config.n_head) == [4, 1]
    cache = probe.capture(model, TEXT)
    out = tmp_path_factory.mktemp("uneven")
    path = probe.report(cache, out, model=model, tokenizer=model.tokenizer, progress=False)
    return cache, path


def _view(html: str, name: str) -> dict:
    m = re.search(rf'<div class="probe-attn" data-view="{name}">\s*<script[^>]*>(.*?)</script>', html, re.S)
    assert m is not None, name
    return json.loads(m.group(1))


def _head(view: dict, layer: int, head: int) -> np.ndarray:
    """The embedded weights of (layer, head): the packed heads run layer by layer, each layer's own."""
    s = view["sets"][0]
    li = s["layers"].index(layer)
    idx = sum(len(h) for h in s["layerHeads"][:li]) + s["layerHeads"][li].index(head)
    assert idx < s["nFull"]
    raw = zlib.decompress(base64.b64decode(s["full"]))
    q = np.frombuffer(raw, dtype="<u2" if view["bytes"] == 2 else "u1")
    return q.reshape(s["nFull"], s["nq"], s["nk"])[idx] / view["scale"]


def test_the_embedded_heads_are_each_layers_own_and_hold_the_models_weights(made):
    cache, path = made
    view = _view(path.read_text(encoding="utf-8"), "attention")
    s = view["sets"][0]
    assert s["layers"] == [0, 1]
    assert s["layerHeads"] == [[0, 1, 2, 3], [0]]  # no head 1..3 in layer 1
    assert s["nFull"] == 5  # five heads embedded, none invented
    n = len(TEXT)
    for layer, head in [(1, 0), (0, 3), (0, 0)]:
        want = cache.pattern("decoder", layer, head=head, batch=0).double().numpy()
        assert want.shape == (n, n)
        got = _head(view, layer, head)
        assert np.abs(got - want).max() <= 0.5 / view["scale"] + 1e-9, (layer, head)
    # the two heads the model's circuit is made of differ: the test would see a swap
    assert not np.allclose(_head(view, 1, 0), _head(view, 0, 3), atol=1e-3)


def test_the_explorer_offers_only_each_layers_heads_in_a_browser(made):
    from probe.report.browser import browser, hover_cell, open_report

    cache, path = made
    sec = "#sec-attention "
    options = f"[...document.querySelectorAll('{sec}.sel-head option')].map(o => o.textContent)"
    with browser() as chromium:
        page, log = open_report(chromium, path)
        assert page.evaluate(options) == ["0", "1", "2", "3"]
        scale = page.evaluate("probe.views[0].scale")
        page.select_option(sec + ".sel-head", "3")
        for q, k in [(30, 29), (20, 5)]:  # (30, 29): the previous token
            ro = hover_cell(page, 0, q, k)
            assert ro.startswith("Layer 0, Head 3: ")
            w = float(re.search(r"weight ([0-9.]+)", ro).group(1))
            assert abs(w - cache.pattern("decoder", 0, head=3, batch=0)[q, k].item()) <= 0.5 / scale + 1e-6
        # layer 1 has one head: the selector offers it alone, and the explorer shows it
        page.select_option(sec + ".sel-layer", "1")
        assert page.evaluate(options) == ["0"]
        assert page.evaluate("[probe.views[0].li, probe.views[0].hi]") == [1, 0]
        for q, k in [(30, 16), (25, 11)]:  # the token after the earlier copy of the query's token
            ro = hover_cell(page, 0, q, k)
            assert ro.startswith("Layer 1, Head 0: ")
            w = float(re.search(r"weight ([0-9.]+)", ro).group(1))
            assert abs(w - cache.pattern("decoder", 1, head=0, batch=0)[q, k].item()) <= 0.5 / scale + 1e-6
        # the keys that step through heads stay on layer 1's own head
        page.locator(sec + ".probe-matrix").focus()
        page.keyboard.press("]")
        assert page.evaluate("[probe.views[0].li, probe.views[0].hi]") == [1, 0]
        # the overview leaves layer 1's columns H1..H3 empty and says so
        note = page.locator(sec + ".overview-missing")
        assert note.is_visible() and "L0: 4, L1: 1" in note.text_content()
        page.locator(sec + ".probe-overview").scroll_into_view_if_needed()
        box = page.locator(sec + ".probe-overview").bounding_box()
        geo = page.evaluate(
            "(() => { const v = probe.views[0], L = v.overviewLayout(), "
            "cv = v.el('.probe-overview'); return [L.left, L.top, L.cw, L.ch, L.gap, cv.width]; })()"
        )
        left, top, cw, ch, gap, width = geo
        zoom = box["width"] / width
        for hi in (1, 2, 3):  # hovering a missing cell names it as missing; clicking it changes nothing
            x = box["x"] + (left + hi * (cw + gap) + cw / 2) * zoom
            y = box["y"] + (top + (ch + gap) + ch / 2) * zoom
            page.mouse.move(x, y)
            assert (
                page.locator(sec + ".probe-tooltip").text_content()
                == f"Layer 1 has no head {hi} (it has 1 head)"
            )
            page.mouse.click(x, y)
            assert page.evaluate("[probe.views[0].li, probe.views[0].hi]") == [1, 0]
        assert log.errors == [] and [m for m in log.console if m[0] in ("error", "warning")] == []


def test_the_summary_and_the_role_grid_name_each_layers_own_heads(made):
    _, path = made
    html = path.read_text(encoding="utf-8")
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))
    assert "2 of 2 layers captured, 4 heads in layer 0, 1 in layer 1" in text
    grid = html[html.index('<table class="probe-roles">') :]
    grid = grid[: grid.index("</table>")]
    rows = dict(re.findall(r"<tr><th>L(\d)</th>(.*?)</tr>", grid))
    cells = {layer: re.findall(r'<td class="([\w-]+)"', row) for layer, row in rows.items()}
    # the model's circuit (models/induction.py): L0 H3 the previous-token head, L1 H0 the induction head
    assert cells["0"][3] == "role-prev" and len(cells["0"]) == 4 and "probe-no-head" not in cells["0"]
    assert cells["1"] == ["role-ind", "probe-no-head", "probe-no-head", "probe-no-head"]
    for h in (1, 2, 3):
        assert f'title="layer 1 has no head {h} here"' in grid


def test_the_overview_figure_hatches_the_heads_layer_1_does_not_have():
    from matplotlib.patches import Rectangle

    cache = probe.capture(models.load("induction"), TEXT)
    fig = probe.plot.overview(cache)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["H0", "H1", "H2", "H3"]
    hatched = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_hatch()]
    assert len(hatched) == 3
    # every hatched cell lies in layer 1's row (below layer 0's), one per column H1..H3
    image = ax.images[0].get_array()
    rows, cols = image.shape
    assert all(p.get_y() > rows / 2 - 1 for p in hatched)
    assert sorted(round(p.get_x() / (cols / 4)) for p in hatched) == [1, 2, 3]
    # the weights drawn in layer 1's first cell are layer 1 head 0's (scaled by its largest weight)
    w = cache.pattern("decoder", 1, head=0, batch=0).numpy()
    n = w.shape[0]
    drawn = np.asarray(image[rows - n :, :n])
    assert np.abs(drawn - w / w.max()).max() < 1e-6


def test_a_generation_and_a_top_k_cache_report_each_layers_heads(tmp_path):
    model = models.load("induction")
    gen = probe.generate(model, TEXT[:22], max_new_tokens=4)
    html = probe.report(gen.cache, tmp_path / "gen", progress=False).read_text(encoding="utf-8")
    sec = html[html.index('id="sec-generation"') :]
    data = json.loads(re.search(r'<script type="application/json"[^>]*>(.*?)</script>', sec, re.S).group(1))
    assert [e["layer"] for e in data["layers"]] == [0, 1]
    assert [len(e["heads"]) for e in data["layers"]] == [4, 1]
    assert [len(e["ratio"]) for e in data["layers"]] == [5, 2]  # each layer's heads, then their mean
    top = probe.capture(model, TEXT, keep={"topk": 3})
    html = probe.report(top, tmp_path / "topk", progress=False).read_text(encoding="utf-8")
    kept = html[html.index('id="sec-kept"') :]
    kept = kept[: kept.index("</section>")]
    assert "could not be built" not in kept and "mean share of each row kept" in kept
