"""The report's "Which heads matter" section, the results it reads (saved and loaded), and
``probe report --importance``.

Oracle: the numbers the test reads off the HeadImportance / Patching objects it built itself (and
the focus roles from ``probe.head_stats``), formatted in the test, found in the page; the saved
files compared tensor by tensor with the objects that wrote them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import models
import probe
from probe.analysis.interventions import load_result

TEXTS = ["attention lets tokens read.", "graph neural networks pass"]


@pytest.fixture(scope="module")
def gpt():
    return models.load("minigpt")


@pytest.fixture(scope="module")
def imp(gpt):
    return probe.head_importance(gpt, TEXTS, metric="loss")


@pytest.fixture(scope="module")
def cache(gpt):
    return probe.capture(gpt, TEXTS)


@pytest.fixture(scope="module")
def patching(gpt):
    return probe.patch(
        gpt, "attention lets tokens read", "attention lets tokens send", what="heads", answer=" ", wrong="t"
    )


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "probe", *args], capture_output=True, text=True, timeout=300)


def _rows_html(imp, cache) -> list[str]:
    """The top-table rows the page must hold, written from the objects: head, change, gradient,
    role, entropy, confidence, first, prev."""
    stats = {(r["layer"], r["head"]): r for r in probe.head_stats(cache, progress=False).table}
    ranked = sorted(imp.table, key=lambda r: -abs(r["change"]))
    out = []
    for rank, r in enumerate(ranked[:10], 1):
        s = stats[(r["layer"], r["head"])]
        role = "no role" if s["role"] == "none" else s["role"]
        cells = [
            str(rank),
            f"L{r['layer']}.H{r['head']}",
            f"{r['change']:+.4g}",
            f"{r['gradient']:+.4g}",
            role,
        ]
        cells += [f"{s[m]:.3g}" for m in ("entropy", "confidence", "first", "prev")]
        out.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return out


def test_the_section_shows_the_results_numbers(imp, cache, patching, tmp_path):
    page = probe.report(cache, tmp_path, importance=imp, patching=patching, progress=False).read_text()
    assert "Which heads matter" in page
    for row in _rows_html(imp, cache):
        assert row in page
    base = imp.table[0]["metric"]
    assert all(r["metric"] == base for r in imp.table)
    assert f"with every head, {base:.4g}" in page
    assert "its output replaced by zeros" in page and "“attention lets tokens read.”" in page
    assert f"the clean value ({patching.clean:.4g})" in page
    assert f"the corrupted value ({patching.corrupted:.4g})" in page
    # the change is ablated - metric in every row (the grid is the table's)
    for r in imp.table:
        assert r["change"] == pytest.approx(r["ablated"] - r["metric"], abs=1e-6)
        assert imp.grid[r["layer"], r["head"]].item() == pytest.approx(r["change"], abs=1e-6)


def test_no_result_no_section(cache, tmp_path):
    page = probe.report(cache, tmp_path, progress=False).read_text()
    assert "Which heads matter" not in page


def test_save_and_load_keep_every_number(imp, patching, tmp_path):
    imp.save(tmp_path / "imp.json")
    back = probe.HeadImportance.load(tmp_path / "imp.json")
    assert torch.equal(back.grid, imp.grid) and torch.equal(back.gradients, imp.gradients)
    assert list(back.table) == list(imp.table)
    assert (back.metric_name, back.how, back.rows, back.texts) == (imp.metric_name, imp.how, imp.rows, TEXTS)
    patching.save(tmp_path / "p.json")
    p = load_result(tmp_path / "p.json")
    assert isinstance(p, probe.Patching) and torch.equal(p.grid, patching.grid)
    assert (p.clean, p.corrupted, p.rows, p.cols) == (
        patching.clean,
        patching.corrupted,
        patching.rows,
        patching.cols,
    )
    with pytest.raises(probe.ProbeError, match="not head importance"):
        probe.HeadImportance.load(tmp_path / "p.json")


def test_nan_cells_are_stored_as_null(imp, tmp_path):
    grid = imp.grid.clone()
    grid[0, 0] = math.nan
    odd = type(imp)(imp.metric_name, imp.how, imp.table, grid, imp.gradients, imp.rows)
    odd.save(tmp_path / "odd.json")
    assert json.loads((tmp_path / "odd.json").read_text())["change"][0][0] is None
    assert math.isnan(probe.HeadImportance.load(tmp_path / "odd.json").grid[0, 0])


def test_a_result_of_another_model_is_a_note(imp, cache, tmp_path):
    # a result whose heads are not the cache's (a third layer minigpt does not have)
    from probe.analysis.table import Table

    rows = list(imp.table) + [dict(imp.table[0], layer=2, component="L2.H0")]
    grid = torch.cat([imp.grid, imp.grid[:1]])
    odd = type(imp)(imp.metric_name, imp.how, Table(rows, imp.table.columns), grid, grid, imp.rows + ["L2"])
    page = probe.report(cache, tmp_path, importance=odd, progress=False).read_text()
    assert "the importance result measured 9 decoder self-attention heads, the cache holds 8" in page


def test_report_refuses_a_wrong_object(cache, patching, tmp_path):
    with pytest.raises(probe.ProbeError, match="importance= takes a probe.HeadImportance"):
        probe.report(cache, tmp_path, importance=patching, progress=False)


def test_cli_measures_importance_with_a_model(gpt, tmp_path):
    text = "attention lets tokens read."
    r = run("report", "--model", "minigpt", "--importance", text, "-o", str(tmp_path), "--how", "zero")
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "index.html").read_text()
    imp = probe.head_importance(gpt, text, metric="loss")
    cache = probe.capture(gpt, text)
    for row in _rows_html(imp, cache):
        assert row in page


def test_cli_reads_saved_results(imp, cache, patching, tmp_path):
    cache.save(tmp_path / "run.safetensors")
    imp.save(tmp_path / "imp.json")
    patching.save(tmp_path / "p.json")
    out = tmp_path / "rep"
    r = run(
        "report",
        str(tmp_path / "run.safetensors"),
        "--importance",
        str(tmp_path / "imp.json"),
        "--patching",
        str(tmp_path / "p.json"),
        "-o",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    page = (out / "index.html").read_text()
    for row in _rows_html(imp, cache):
        assert row in page
    assert "Patching heads" in page


@pytest.mark.parametrize("content", ["not json", '{"kind": "something"}', '{"kind": "head_importance"}'])
def test_cli_bad_importance_file_exits_2(cache, tmp_path, content):
    cache.save(tmp_path / "run.safetensors")
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    r = run(
        "report", str(tmp_path / "run.safetensors"), "--importance", str(bad), "-o", str(tmp_path / "rep")
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "bad.json" in r.stderr
    assert not (tmp_path / "rep" / "index.html").exists()


def test_cli_importance_without_a_model_exits_2(cache, tmp_path):
    cache.save(tmp_path / "run.safetensors")
    r = run("report", str(tmp_path / "run.safetensors"), "--importance", "-o", str(tmp_path / "rep"))
    assert r.returncode == 2 and "--importance without a file" in r.stderr


@pytest.mark.slow  # about 12 s on two cores: CI's slow job runs it (the default pytest keeps to ~15 min)
def test_cli_importance_with_another_metric(gpt, tmp_path):
    text = "attention lets tokens read."
    args = ["--metric", "logit_diff", "--answer", "e", "--wrong", "t", "-o", str(tmp_path)]
    r = run("report", "--model", "minigpt", text, "--importance", *args)
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "index.html").read_text()
    imp = probe.head_importance(gpt, text, metric="logit_diff", answer="e", wrong="t")
    assert imp.metric_name == "logit(e) - logit(t)" and imp.metric_name in page
    for row in _rows_html(imp, probe.capture(gpt, text)):
        assert row in page
    r = run(
        "report", "--model", "minigpt", text, "--importance", "--metric", "prob", "-o", str(tmp_path / "x")
    )
    assert r.returncode == 2 and "--metric prob needs --answer" in r.stderr
