"""The report's 'Circuit' section: the graph as SVG, the faithfulness curve, the edges, in Chromium.

Oracles: the circuit's own edge table (the scores themselves are checked against exact patching in
tests/test_circuit*.py), the curve the test runs itself with ``c.evaluate()`` (the model really
run with every other edge corrupted), and the head explorer's own selectors after a click.
"""

from __future__ import annotations

import base64
import csv
import io
import math
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

import models
import probe
from probe.errors import ProbeError
from probe.intervene.circuit import induction_prompts

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
RED, BLUE = "#b2182b", "#2166ac"


class Elements(HTMLParser):
    """Every start tag, as ``(classes, attrs)``; the rows of the table of edges."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.found: list[tuple[set[str], dict[str, str]]] = []
        self.rows: list[dict[str, str]] = []  # the table's rows of edges
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.found.append((set((a.get("class") or "").split()), a))
        if tag == "tr" and "data-edge" in a:
            self.rows.append(a)

    def having(self, cls: str) -> list[dict[str, str]]:
        return [a for c, a in self.found if cls in c]


@pytest.fixture(scope="module")
def lm():
    if "induction" not in models.names() or not models.checkpoint_path("induction").exists():
        pytest.skip("the zoo's induction model is not shipped in this checkout")
    return models.load("induction")


@pytest.fixture(scope="module")
def task(lm):
    from models.induction import CHARS

    ps = induction_prompts(16, CHARS[1:], seed=0)
    c = probe.circuit(lm, ps.clean, ps.corrupted, metric="logit-diff", answers=ps.answers, method="eap-ig")
    return ps, c


@pytest.fixture(scope="module")
def made(lm, task, tmp_path_factory):
    ps, c = task
    cache = probe.capture(lm, ps.clean[:4])
    path = probe.report(cache, tmp_path_factory.mktemp("circuit"), circuit=c, progress=False)
    return path, Elements(path.read_text(encoding="utf-8"))


def _by_abs_score(c) -> list[dict]:
    """The edges by |score|, computed here from the result's own table (NaN left out)."""
    rows = [r for r in c.table.rows if not math.isnan(r["score"])]
    return sorted(rows, key=lambda r: -abs(r["score"]))


def test_the_graph_draws_the_top_edges_wider_by_score(task, made):
    _, c = task
    path, page = made
    from probe.report.sections.circuit import SHOWN

    drawn = {a["data-edge"]: a for a in page.having("probe-circuit-edge")}
    top = _by_abs_score(c)[:SHOWN]
    assert set(drawn) == {r["edge"] for r in top}
    count = page.having("probe-circuit-count")[0]
    assert (count["data-shown"], count["data-of"]) == (str(len(top)), str(len(c)))
    widths = [float(drawn[r["edge"]]["stroke-width"]) for r in top]
    scale = abs(top[0]["score"])
    pairs = list(zip(top, widths, strict=True))
    for (a, wa), (b, wb) in zip(pairs, pairs[1:], strict=False):
        assert wa >= wb, (a["edge"], b["edge"])
        if abs(a["score"]) - abs(b["score"]) > 0.01 * scale:  # clearly larger: clearly wider
            assert wa > wb, (a["edge"], b["edge"])
    assert widths[0] > widths[-1]
    for r in top:
        e = drawn[r["edge"]]
        assert e["stroke"] == (RED if r["score"] >= 0 else BLUE)
        assert math.isclose(float(e["data-score"]), r["score"], rel_tol=1e-12, abs_tol=1e-300)
        assert (e["data-source"], e["data-target"]) == (r["source"], r["target"])
    heads = {a["data-node"] for a in page.having("probe-circuit-node") if a.get("data-kind") == "head"}
    assert heads == {n.name for n in c.graph.nodes if n.kind == "head"}
    text = path.read_text(encoding="utf-8")
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in text


def test_the_curve_is_the_circuits_own(task, made):
    _, c = task
    _, page = made
    want = c.evaluate()  # the default counts, run again here
    points = page.having("probe-circuit-point")
    got = {}
    for key in ("kept", "faithfulness"):
        got[key] = [(int(p["data-edges"]), float(p["data-value"])) for p in points if p["data-series"] == key]
    rows = list(want.table)
    assert [n for n, _ in got["kept"]] == [r["edges"] for r in rows]
    for key in ("kept", "faithfulness"):
        for (n, v), r in zip(got[key], rows, strict=True):
            assert math.isclose(v, r[key], rel_tol=1e-5, abs_tol=1e-6), (key, n, v, r[key])


def test_the_table_lists_the_top_edges_with_a_csv(task, made):
    _, c = task
    _, page = made
    table = [a["data-edge"] for a in page.rows]
    assert table == [r["edge"] for r in _by_abs_score(c)[: len(table)]] and table
    link = next(a for a in page.having("probe-download") if a.get("download") == "circuit_edges.csv")
    head, b64 = link["href"].split(",", 1)
    assert head == "data:text/csv;charset=utf-8;base64"
    got = list(csv.DictReader(io.StringIO(base64.b64decode(b64).decode("utf-8-sig"))))
    assert [r["edge"] for r in got] == table
    want = {r["edge"]: r["score"] for r in c.table.rows}
    assert all(float(r["score"]) == want[r["edge"]] for r in got)  # the scores at full precision


def test_a_chosen_circuit_shows_its_edges_and_kept_if_removed_for_patching(lm, task, tmp_path):
    ps, c = task
    sel = c.greedy(4)
    cache = probe.capture(lm, ps.clean[:2])
    page = Elements(probe.report(cache, tmp_path / "a", circuit=sel, progress=False).read_text("utf-8"))
    assert {a["data-edge"] for a in page.having("probe-circuit-edge")} == set(sel.table.column("edge"))
    count = page.having("probe-circuit-count")[0]
    assert (count["data-shown"], count["data-of"]) == ("4", "4")

    exact = probe.circuit(lm, ps.clean[:4], ps.corrupted[:4], answers=ps.answers[:4], method="patching")
    text = probe.report(cache, tmp_path / "b", circuit=exact, progress=False).read_text("utf-8")
    assert "kept if removed" in text
    clean = exact.references["clean"]
    top = _by_abs_score(exact)[0]
    assert f"<td>{(clean - top['score']) / clean:.3f}</td>" in text  # (clean - drop) / clean


def test_clicking_a_head_selects_it_in_the_explorer(made):
    from probe.report.browser import browser, open_report

    path, _ = made
    chosen = "#sec-attention .{} option:checked"
    with browser() as chromium:
        page, log = open_report(chromium, path)
        page.locator('#sec-circuit .probe-circuit-node[data-node="L0.H3"]').click()
        assert page.locator(chosen.format("sel-layer")).text_content() == "0"
        assert page.locator(chosen.format("sel-head")).text_content() == "3"
        readout = page.locator("#sec-circuit .probe-circuit-readout")
        assert readout.get_attribute("data-node") == "L0.H3"
        assert "\u2192 L1.H0.k (" in readout.text_content()  # what it writes, with the score
        page.locator('#sec-circuit .probe-circuit-node[data-node="L1.H0"]').focus()
        page.keyboard.press("Enter")
        assert page.locator(chosen.format("sel-layer")).text_content() == "1"
        assert page.locator(chosen.format("sel-head")).text_content() == "0"
        v = page.evaluate("probe.views.findIndex(v => v.root.dataset.view === 'attention')")
        assert page.evaluate(f"[probe.views[{v}].set.layers[probe.views[{v}].li]]") == [1]
        assert log.errors == [] and [m for m in log.console if m[0] in ("error", "warning")] == []
        assert [u for u in log.requests if not u.startswith(("file:", "data:", "blob:"))] == []


def test_a_click_shows_the_heads_contributions_too(lm, task, tmp_path):
    from probe.report.browser import browser, open_report

    ps, c = task
    cache = probe.contributions(lm, ps.clean[:2])
    path = probe.report(cache, tmp_path, circuit=c, progress=False)
    with browser() as chromium:
        page, log = open_report(chromium, path)
        page.locator('#sec-circuit .probe-circuit-node[data-node="L0.H2"]').click()
        for side in ("A", "B"):
            box = f"#sec-contributions .probe-pair-side[data-side={side}] "
            assert page.locator(box + ".sel-layer option:checked").text_content() == "0"
            assert page.locator(box + ".sel-head option:checked").text_content() == "2"
        assert log.errors == []


def test_a_saved_circuit_and_refusals(lm, task, tmp_path):
    ps, c = task
    cache = probe.capture(lm, ps.clean[:2])
    c.to_json(tmp_path / "c.json")
    text = probe.report(cache, tmp_path / "r", circuit=tmp_path / "c.json", progress=False).read_text("utf-8")
    assert 'id="sec-circuit"' in text and "No faithfulness curve" in text
    with pytest.raises(ProbeError, match="circuit= takes"):
        probe.report(cache, tmp_path / "x", circuit=42, progress=False)
    with pytest.raises(ProbeError, match="circuit_curve= goes with circuit="):
        probe.report(cache, tmp_path / "x", circuit_curve=c.evaluate([1]), progress=False)
    (tmp_path / "bad.json").write_text('{"kind": "something else"}', encoding="utf-8")
    with pytest.raises(ProbeError, match="not a circuit's data"):
        probe.report(cache, tmp_path / "x", circuit=tmp_path / "bad.json", progress=False)
    assert not (tmp_path / "x").exists()
    other = probe.capture(models.load("minigpt"), "the cat sat")  # another model's heads
    text = probe.report(other, tmp_path / "m", circuit=c, progress=False).read_text("utf-8")
    assert "could not be built: the circuit&#39;s graph has" in text


def _files(tmp_path: Path, n: int = 6) -> list[str]:
    from models.induction import CHARS

    ps = induction_prompts(n, CHARS[1:], seed=3)
    (tmp_path / "clean.txt").write_text("\n".join(ps.clean) + "\n", encoding="utf-8")
    (tmp_path / "corrupted.txt").write_text("\n".join(ps.corrupted) + "\n", encoding="utf-8")
    (tmp_path / "answers.tsv").write_text("".join(f"{a}\t{b}\n" for a, b in ps.answers), encoding="utf-8")
    args = ["--clean", "clean.txt", "--corrupted", "corrupted.txt", "--answers-file", "answers.tsv"]
    return [sys.executable, "-m", "probe", "circuit", "--model", "induction", *args]


def test_cli_report_writes_the_section(lm, tmp_path):
    cmd = _files(tmp_path) + ["--curve", "1,2,4", "--report", "rep"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "wrote rep/index.html" in r.stdout or "wrote rep" in r.stdout
    page = Elements((tmp_path / "rep" / "index.html").read_text(encoding="utf-8"))
    assert page.having("probe-circuit-graph") and page.having("probe-circuit-edge")
    points = [int(p["data-edges"]) for p in page.having("probe-circuit-point") if p["data-series"] == "kept"]
    assert points == [1, 2, 4]  # --curve's counts, run once


def test_cli_report_onto_a_file_is_one_line(lm, tmp_path):
    (tmp_path / "taken").write_text("mine", encoding="utf-8")
    r = subprocess.run(_files(tmp_path) + ["--report", "taken"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    assert "taken is a file; give a directory" in r.stderr
    assert (tmp_path / "taken").read_text(encoding="utf-8") == "mine"


@pytest.mark.slow
def test_a_cjk_report_of_smollm2_with_grouped_heads_and_mlps(tmp_path):
    """SmolLM2 (grouped-query attention: 9 heads share 3 key/value heads; MLPs) on Chinese prompts:
    the section draws its top edges, a key/value edge ends under the 3 heads that read it, and a
    click chooses the head in the explorer; no page error, no request."""
    import torch

    from probe.report.browser import browser, open_report

    lm = models.load("smollm2")
    clean = ["小猫坐在垫子上。小猫", "北京是中国的首都，北京"]
    corrupted = ["小狗坐在垫子上。小狗", "东京是日本的首都，东京"]
    with torch.no_grad():
        ids = [lm(**lm.tokenizer(t, return_tensors="pt")).logits[0, -1].argmax().item() for t in clean]
    c = probe.circuit(lm, clean, corrupted, metric="prob", answers=ids, method="eap")
    path = probe.report(probe.capture(lm, clean), tmp_path, circuit=c, circuit_curve=c.evaluate([1, 10, 100]))
    text = path.read_text(encoding="utf-8")
    assert "小猫坐在垫子上" in text
    page = Elements(text)
    drawn = page.having("probe-circuit-edge")
    assert [a["data-edge"] for a in sorted(drawn, key=lambda a: -abs(float(a["data-score"])))] == [
        r["edge"] for r in _by_abs_score(c)[: len(drawn)]
    ]
    for a in drawn:
        t = c.graph.targets[c.graph.target(a["data-target"])]
        if t.kind in ("k", "v"):
            assert a["data-readers"].split() == [f"L{t.layer}.H{h}" for h in t.heads] and len(t.heads) == 3
    head = next(
        a for a in page.having("probe-circuit-node") if a.get("data-kind") == "head" and a["tabindex"] == "0"
    )
    with browser() as chromium:
        p, log = open_report(chromium, path)
        p.locator(f'#sec-circuit [data-node="{head["data-node"]}"]').click()
        assert p.locator("#sec-attention .sel-layer option:checked").text_content() == head["data-layer"]
        assert p.locator("#sec-attention .sel-head option:checked").text_content() == head["data-head"]
        assert (
            log.errors == []
            and [u for u in log.requests if not u.startswith(("file:", "data:", "blob:"))] == []
        )
