"""Notebooks: ``Cache`` and every analysis result render inline through ``_repr_html_``.

Jupyter, JupyterLab and VS Code insert that HTML into the page as it is, so it must work with no
require.js, no script at all, no network. Oracles: the strings the test puts in (hostile tokens
and model name) and what a real browser (Debian's Chromium) requests and runs when the HTML of
every result is put into one page without any Content-Security-Policy.
"""

from __future__ import annotations

import re

import pytest
import report_caches as rc

import probe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
HOSTILE_TOKENS = ["a", rc.HOSTILE, "b", rc.SCRIPT_END, "&amp;", "c"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import models

    cache = rc.synthetic(HOSTILE_TOKENS, name=rc.HOSTILE, resid=True)
    gpt = models.load("minigpt")
    lens = probe.logit_lens(gpt, "tokens rea")
    out = tmp_path_factory.mktemp("corpus") / "run"
    probe.run_corpus(gpt, ["attention lets tokens read.", "tokens read."], out, batch_size=2, progress=False)
    stats = probe.head_stats(cache, progress=False)
    return {
        "Cache": cache,
        "HeadStats": stats,
        "Table": stats.table,
        "CausalReport": probe.check_causal(cache),
        "ResidualStats": probe.residual(cache),
        "LogitLens": lens,
        "Attribution": lens.attribution,
        "Budget": probe.budget(gpt),
        "Alignment": probe.align(rc.encoder_decoder()),
        "Corpus": probe.open_corpus(out),
    }


def test_every_result_has_static_inline_html(results):
    for name, obj in results.items():
        html = obj._repr_html_()
        assert isinstance(html, str) and len(html) > 100, name
        # nothing a notebook would have to load or run: no script (require.js or other), no link,
        # no frame, no URL other than inline data
        assert not re.search(r"<\s*(script|link|iframe|object|embed)\b", html, re.I), name
        assert not re.search(r"require|https?:|//cdn|@import", html, re.I), name
        tags = re.findall(r"<[^>]*>", html)  # attributes live in tags; escaped text has no "<"
        assert [t for t in tags if re.search(r"\son[a-z]+\s*=", t, re.I)] == [], name
        assert [t for t in tags if re.search(r"""\b(?:src|href)\s*=\s*(?!["']?data:)""", t)] == [], name
        assert rc.HOSTILE not in html and rc.SCRIPT_END not in html, name
    cache_html = results["Cache"]._repr_html_()
    assert "&lt;img src=x onerror=alert(1)&gt;" in cache_html and "data:image/png;base64," in cache_html


def test_every_result_renders_in_chromium_offline_and_runs_nothing(results, tmp_path):
    from probe.report.browser import browser

    blocks = "".join(
        f'<section id="r-{name}"><h2>{name}</h2>{obj._repr_html_()}</section>'
        for name, obj in results.items()
    )
    page_file = tmp_path / "notebook.html"
    page_file.write_text(f'<!doctype html><html><meta charset="utf-8"><body>{blocks}</body></html>')
    console, errors, requests, dialogs = [], [], [], []
    with browser() as b:
        page = b.new_page()
        page.on("console", lambda m: console.append((m.type, m.text)))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(page_file.as_uri())
        page.wait_for_load_state("load")
        assert page.evaluate("document.scripts.length") == 0
        assert page.locator("img[src=x]").count() == 0
        # the hostile token is shown as text in the cache's summary
        assert rc.HOSTILE in page.locator("#r-Cache").text_content()
        # every inline image decodes
        sizes = page.evaluate("Array.from(document.images).map(i => i.naturalWidth * i.naturalHeight)")
        assert sizes and all(s > 0 for s in sizes)
        for name in results:
            assert page.locator(f"#r-{name}").inner_text().strip() != name, name
        page.close()
    assert [u for u in requests if not u.startswith(("file:", "data:"))] == []
    assert errors == [] and dialogs == [] and [m for m in console if m[0] in ("error", "warning")] == []


def test_cache_thumbnail_is_a_png_of_the_weights():
    # decoded by PIL (an independent PNG reader); colours against the ramp written out here
    import base64
    import io

    import torch
    from PIL import Image

    from probe.cache.display import thumbnail_uri

    w = torch.tensor([[1.0, 0.0, 0.0], [0.25, 0.75, 0.0], [0.5, 0.0, 0.5]])
    uri = thumbnail_uri(w)
    img = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))
    assert img.size == (3, 3) and img.mode == "RGB"
    white, blue = torch.tensor([255.0, 255, 255]), torch.tensor([8.0, 48, 107])
    for (q, k), v in [((0, 0), 1.0), ((0, 1), 0.0), ((1, 0), 0.25), ((1, 1), 0.75), ((2, 2), 0.5)]:
        assert img.getpixel((k, q)) == tuple((white + (blue - white) * v).round().int().tolist())
    # a long pattern is max-pooled to 96 x 96: one strong weight stays visible
    big = torch.zeros(300, 300)
    big[123, 45] = 1.0
    img = Image.open(io.BytesIO(base64.b64decode(thumbnail_uri(big).split(",", 1)[1])))
    assert img.size == (96, 96) and (8, 48, 107) in [c for _, c in img.getcolors(96 * 96)]
