"""The report's audio section ("What the transcript heard") on the zoo speech model, and in Chromium.

Oracles: the cross-attention recomputed from the model's own query/key projections by hooks
(tests/test_models_speech.py), the words' gold spans from the sentence generator, the word
timestamps as probe.word_timestamps gives them (tested on its own in tests/test_audio.py).
"""

from __future__ import annotations

import pytest
import torch
from speech_caches import two_sentences
from test_models_speech import _weights_by_hook

import models
import probe
from probe.report.browser import browser, open_report
from probe.report.context import ReportContext
from probe.report.sections import audio


@pytest.fixture(scope="module")
def speech():
    model, sents, cache = two_sentences()
    gold = [[(w, a, b) for w, (a, b) in zip(s.words, s.times, strict=True)] for s in sents]
    return model, sents, cache, gold


def test_the_section_embeds_each_words_attention_over_time(speech):
    model, sents, cache, gold = speech
    ctx = ReportContext(caches=[cache], results={"audio_gold": gold})
    s = audio.build(ctx)
    ts = probe.word_timestamps(cache, gold=gold)
    feats = model.processor([x.audio for x in sents])["input_features"]
    rows = cache.metadata["target_ids"]
    ids = torch.tensor([r + [0] * (max(map(len, rows)) - len(r)) for r in rows])  # padded on the right
    want = _weights_by_hook(model, feats, ids)
    assert len(s["inputs"]) == 2 and s["has_gold"] and s["notes"][0].startswith("heads chosen (gold): ")
    hop = cache.metadata["stacks"]["encoder"]["positions"]["frames"]["hop"]
    assert hop == 0.02
    for b, (it, sent) in enumerate(zip(s["inputs"], sents, strict=True)):
        d = it["data"]
        n = len(sent.audio) // 160 // 2 + (len(sent.audio) // 160) % 2  # frames holding the audio
        assert d["frames"] == n and d["hop"] == hop
        assert [w["w"] for w in d["words"]] == sent.words
        for k, w in enumerate(d["words"]):
            # word k is token k + 1 of the decoder: the row that predicts it is k
            att = torch.stack(
                [want[("decoder", layer, "cross")][b, head, k, :n] for layer, head in ts.chosen]
            )
            att = att.mean(0)
            assert abs(w["max"] - float(att.max())) < 1e-6
            assert (
                max(abs(q - float(x / att.max() * 255)) for q, x in zip(w["q"], att, strict=True))
                <= 0.5 + 1e-3
            )
            assert (w["gs"], w["ge"]) == sent.times[k]
            row = [r for r in ts.words.rows if r["item"] == b][k]
            assert (w["s"], w["e"]) == (row["start"], row["end"])
        assert it["fig"].startswith("data:image/png;base64,")


def test_no_section_for_a_text_cache():
    gpt = models.load("minigpt")
    assert audio.build(ReportContext(caches=[probe.capture(gpt, "attention")])) is None


def test_the_frames_are_time_here_not_source_words_for_the_alignment_section(speech):
    from probe.report.sections import alignment

    _, _, cache, _ = speech
    assert alignment.not_words(cache.metadata) == "audio frames"
    assert alignment.build(ReportContext(caches=[cache])) is None  # no frame-as-word alignment


def test_the_summary_says_why_the_causal_checks_did_not_run_with_the_model(speech):
    from probe.report.sections import causal

    model, _, cache, _ = speech
    verdict = causal.verdict(ReportContext(caches=[cache], model=model, tokenizer=model.tokenizer))["verdict"]
    assert "a cache alone" not in verdict
    why = "the functional checks perturb token ids alone, and this model read input_features"
    assert verdict.endswith(f"not run: {why}")
    assert "a cache alone" in causal.verdict(ReportContext(caches=[cache]))["verdict"]  # no model given


def test_timings_are_told_from_word_alignments():
    assert audio.timings_of([[("red", 0.1, 0.4)], [(0.2, 0.5)]]) is not None
    assert audio.timings_of([[{"word": "red", "start": 0.1, "end": 0.4}]]) is not None
    assert audio.timings_of("0-0 1-1") is None and audio.timings_of([[(0, 1), (1, 2)]]) is not None


def test_hovering_a_word_draws_its_attention_in_chromium(speech, tmp_path):
    _, sents, cache, gold = speech
    out = probe.report(cache, tmp_path / "rep", gold=gold, progress=False)
    with browser() as b:
        page, log = open_report(b, out)
        page.wait_for_function("() => document.documentElement.dataset.probeAudioReady === '1'")
        views = page.locator("#sec-audio .probe-audioview")
        assert views.count() == 2
        chip = views.nth(1).locator(".tok").nth(2)
        chip.scroll_into_view_if_needed()
        chip.hover()
        page.wait_for_function("() => probe.audioViews[1].root.dataset.word === '2'")
        readout = views.nth(1).locator(".probe-readout").text_content()
        a, e = sents[1].times[2]
        assert readout.startswith(f"{sents[1].words[2]}: ") and f"(gold {a:.2f}-{e:.2f} s)" in readout
        assert "here" in chip.get_attribute("class")
        # the canvas holds the bars: some pixels in the bars' orange
        orange = page.evaluate(
            """() => { const c = probe.audioViews[1].canvas, g = c.getContext('2d');
            const px = g.getImageData(0, 0, c.width, c.height).data; let n = 0;
            for (let i = 0; i < px.length; i += 4)
              if (px[i] === 248 && px[i + 1] === 162 && px[i + 2] === 58) n++;
            return n; }"""
        )
        assert orange > 0
        chip.focus()
        page.keyboard.press("ArrowRight")
        page.wait_for_function("() => probe.audioViews[1].root.dataset.word === '3'")
        assert log.errors == [] and [m for m in log.console if m[0] in ("error", "warning")] == []
        assert [u for u in log.requests if not u.startswith(("file:", "data:"))] == []
        page.close()
