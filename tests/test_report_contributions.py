"""The report's 'Weights and contributions' section: the two head explorers in step, in Chromium.

Oracles: the cache's own tensors (the weights, and the contributions with each row divided by its
sum, computed here), and the statistics' table the section summarises.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

import models
import probe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
TEXT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    cache = probe.contributions(models.load("minigpt"), TEXT)
    return cache, probe.report(cache, tmp_path_factory.mktemp("contrib"), progress=False)


def test_the_section_says_the_first_token_share_both_ways(made):
    cache, path = made
    html = path.read_text(encoding="utf-8")
    assert 'id="sec-contributions"' in html
    stats = probe.head_stats(cache, progress=False)
    rows = list(stats.table)
    by_weight = sum(r["first"] for r in rows) / len(rows)
    by_contrib = sum(r["first_contrib"] for r in rows) / len(rows)
    text = re.sub(r"<[^>]+>", "", html)
    assert f"{by_weight:.2f} of the weight, {by_contrib:.2f} of what the heads write" in text
    assert not math.isclose(by_weight, by_contrib)


def test_a_cache_without_contributions_has_no_section(tmp_path):
    cache = probe.capture(models.load("minigpt"), TEXT)
    html = probe.report(cache, tmp_path, progress=False).read_text(encoding="utf-8")
    assert 'id="sec-contributions"' not in html


def test_the_explorers_move_in_step_and_show_the_cached_values(made):
    from probe.report.browser import browser, hover_cell, open_report

    cache, path = made
    w = cache.pattern("decoder", 1, head=2, batch=0)
    c = cache.pattern("decoder", 1, head=2, batch=0, by="contribution")
    c = c / c.sum(-1, keepdim=True)
    with browser() as chromium:
        page, log = open_report(chromium, path)
        ia = page.evaluate("probe.views.findIndex(v => v.root.dataset.view === 'contrib-w')")
        ib = page.evaluate("probe.views.findIndex(v => v.root.dataset.view === 'contrib-c')")
        side = "#sec-contributions .probe-pair-side[data-side={}] "
        page.select_option(side.format("A") + ".sel-layer", "1")
        page.select_option(side.format("A") + ".sel-head", "2")
        assert page.evaluate(f"[probe.views[{ib}].li, probe.views[{ib}].hi]") == [1, 2]
        scale = page.evaluate(f"probe.views[{ib}].scale")
        for q, k in [(21, 0), (21, 17), (9, 4)]:
            hover_cell(page, ia, q, k)
            delta = page.locator("#sec-contributions .probe-pair-delta")
            assert abs(float(delta.get_attribute("data-a")) - w[q, k].item()) <= 0.5 / scale + 1e-6
            assert abs(float(delta.get_attribute("data-b")) - c[q, k].item()) <= 0.5 / scale + 1e-6
        assert log.errors == [] and [m for m in log.console if m[0] in ("error", "warning")] == []
        assert [u for u in log.requests if not u.startswith(("file:", "data:", "blob:"))] == []


def test_cli_report_with_contributions(tmp_path):
    out = tmp_path / "r"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "probe",
            "report",
            "--model",
            "minigpt",
            "--contributions",
            TEXT,
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert 'id="sec-contributions"' in (out / "index.html").read_text(encoding="utf-8")
    cache_file = tmp_path / "c.safetensors"
    probe.capture(models.load("minigpt"), TEXT, out=cache_file)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "probe",
            "report",
            str(cache_file),
            "--contributions",
            "-o",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "--contributions captures them from --model and a text" in r.stderr
