"""The report's audio section draws each word's refined timestamps over the spectrogram, with
Whisper's raw ones faint beside them (a structure test on the figure's patches, not pixels).

Oracle: the spans as probe.word_timestamps gives them (refined and raw, tested on their own in
tests/test_word_timestamps_refine.py); the sentences are the zoo speech model's held-out ones.
"""

from __future__ import annotations

import pytest
from speech_caches import two_sentences

import probe
from probe.report.context import ReportContext
from probe.report.sections import audio


class _Keep(ReportContext):
    """A report context that keeps every figure it renders."""

    def figure(self, fig, alt: str = "") -> str:
        self.results.setdefault("_figures", []).append(fig)
        return super().figure(fig, alt)


@pytest.fixture(scope="module")
def drawn():
    _, _, cache = two_sentences()
    ctx = _Keep(caches=[cache])
    return ctx, audio.build(ctx), probe.word_timestamps(cache)


def _patches(fig, gid: str):
    (top,) = [ax for ax in fig.axes if ax.get_gid() == "spectrogram"]
    return [p for p in top.patches if p.get_gid() == gid]


def test_refined_spans_over_the_spectrogram_and_raw_ones_faint_beside_them(drawn):
    ctx, section, ts = drawn
    assert ts.refine == "attention+energy" and section["refined"]
    figs = ctx.results["_figures"]
    assert len(figs) == len(section["inputs"]) == 2
    for b, fig in enumerate(figs):
        rows = [r for r in ts.words.rows if r["item"] == b]
        spans = _patches(fig, "span")
        raws = _patches(fig, "raw-span")
        assert [e for p in spans for e in (p.get_x(), p.get_x() + p.get_width())] == pytest.approx(
            [e for r in rows for e in (r["start"], r["end"])]
        )
        assert [e for p in raws for e in (p.get_x(), p.get_x() + p.get_width())] == pytest.approx(
            [e for r in rows for e in (r["raw_start"], r["raw_end"])]
        )
        assert all(p.get_alpha() is not None and p.get_alpha() < 0.6 for p in raws)  # faint
        assert all(p.get_alpha() is None for p in spans)
        # beside, not on top: the raw lane lies under the spectrogram, the refined spans over it
        assert max(p.get_y() + p.get_height() for p in raws) <= 0 <= min(p.get_y() for p in spans)
        # the two differ: the raw words are contiguous, the refined ones leave the pauses out
        assert any((r["start"], r["end"]) != (r["raw_start"], r["raw_end"]) for r in rows)
        words = section["inputs"][b]["data"]["words"]
        assert [(w["rs"], w["re"]) for w in words] == [(r["raw_start"], r["raw_end"]) for r in rows]
    assert "timestamps: refined on the sound (attention+energy)" in section["notes"][0]
