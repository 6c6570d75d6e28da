"""Every zoo model's report fits the window: in Chromium the page is exactly as wide as the
viewport, at a desktop width and a narrow one (no figure, table or line wider than the page).

Oracle: the browser's own layout (the document's scroll width against the viewport's width), and
the elements it lays out past the right edge, named when the test fails. The reports are made as
``probe report --model NAME`` makes them: the model's capture of its own kind of input, reported
with the model at hand (the causal audit's functional checks, the tutorial figures).
"""

from __future__ import annotations

import pytest

import models
import probe
from probe.report.browser import browser, open_report

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
WIDTHS = (1280, 720)
# the translator trains on first use; SmolLM2 (30 layers x 9 heads) takes minutes to report on two cores
SLOW = {"translator", "smollm2"}
TEXTS = {
    "fused_decoder": "3141592653589793238",  # digits: its vocabulary
    "aligner": "der junge sah den hund",
    "induction": "^wh4t+COMES/nexTwh4t+COMES/nexT",  # ^, then a segment of its base64 tokens twice
    "smollm2": "The capital of France is Paris, and the capital of Italy is Rome.",
}

# what lies past the right edge of the viewport, outside any box that scrolls or clips it
OVERFLOW = """() => {
  const vw = document.documentElement.clientWidth, out = [];
  for (const el of document.querySelectorAll('body *')) {
    const r = el.getBoundingClientRect();
    if (r.width === 0 || r.right <= vw + 0.5) continue;
    let p = el.parentElement, inside = false;
    while (p && p !== document.body) {
      if (getComputedStyle(p).overflowX !== 'visible') { inside = true; break; }
      p = p.parentElement;
    }
    const sec = el.closest('section');
    const where = sec ? sec.id : 'page';
    if (!inside) out.push(`${el.tagName}.${el.className} in ${where}: ${Math.round(r.right)} px`);
  }
  return out.slice(0, 8);
}"""


def _capture(name: str, model):
    """The model's capture of its own kind of input, as its `probe report` command makes it."""
    if name == "single_head":
        return probe.capture(model, models.single_head.example_input())
    if name == "vit_zoo":
        from models import shapes

        picture = shapes.to_pil(shapes.generate(1, seed=3).images[0])
        return probe.capture(model, [picture], processor=model.processor)
    if name == "speech":
        from models import speech_data

        sound = speech_data.sentence(900005).audio  # 1.8 s: 300 frames in Whisper's padded window
        return probe.capture(model, sound, processor=model.processor, sampling_rate=16_000)
    if name == "translator":
        return probe.capture(model, "ich mochte ein bier P", target="S i want a beer")
    return probe.capture(model, TEXTS.get(name, "attention lets tokens read."))


@pytest.fixture(scope="module")
def chromium():
    with browser() as b:
        yield b


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in models.names()]
)
def test_every_zoo_models_report_is_as_wide_as_the_window(chromium, name, tmp_path):
    from probe.report.seeds import MODELS

    model = models.load(name)
    cache = _capture(name, model)
    tutorial = probe.plot.seed_caches([name]) if name in MODELS else None  # the tutorial's figures
    tok = getattr(model, "tokenizer", None)
    path = probe.report(cache, tmp_path, model=model, tokenizer=tok, tutorial=tutorial, progress=False)
    for width in WIDTHS:
        page, log = open_report(chromium, path, width=width)
        size = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
        over = page.evaluate(OVERFLOW)
        assert size[0] == size[1] and over == [], (name, width, size, over)
        assert log.errors == []
        page.close()
