"""``probe serve``: started as a subprocess and driven in Debian's headless Chromium (Playwright).

What a user does: the grid, a statistic chosen, a head opened, its top texts with their marks, a
query hovered, search, a text, back and forward; nothing on the console, no request for anything
that is not on the server. And what the command refuses, as one line.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("playwright")
if not Path(os.environ.get("PROBE_CHROMIUM", "/usr/bin/chromium")).exists():
    pytest.skip("needs chromium (apt-get install chromium)", allow_module_level=True)

import probe  # noqa: E402
from models import load as load_model  # noqa: E402
from probe.report.browser import PageLog, browser  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LETTERS = "acdefghiklmnoprstuw"
EXAMPLES = {"stats": ["induction_score", "first"], "k": 20, "positions": 4, "keys": 4}


def _texts(n: int = 60) -> list[str]:
    rng = random.Random(3)
    out = []
    for i in range(n):
        words = ["".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 4))) for _ in range(3)]
        if i % 2:
            words.append(words[0])
        out.append(" ".join(words)[:30])
    out[4] = "a bad text"  # not in minigpt's vocabulary: its page says so
    return out


TEXTS = _texts()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "run"
    return probe.run_corpus(
        load_model("minigpt"), TEXTS, out, batch_size=8, shard_size=16, examples=EXAMPLES, progress=False
    )


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _serve(run_dir: Path, *extra: str):
    """``probe serve RUN_DIR --port 0`` started; returns ``(process, base URL)`` once it listens."""
    cmd = [sys.executable, "-m", "probe", "serve", str(run_dir), "--port", "0", *extra]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    m = re.search(r"on (http://127\.0\.0\.1:\d+)/ ", line)
    if not m:
        proc.kill()
        raise AssertionError(f"no address: {line!r} {proc.stderr.read()[-2000:]}")
    return proc, m.group(1)


def _stop(proc) -> str:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    err = proc.stderr.read()
    assert "Traceback" not in err, err[-3000:]
    return err


def _page(b, base: str):
    log = PageLog()
    page = b.new_page(viewport={"width": 1200, "height": 900})
    page.on("console", lambda m: log.console.append((m.type, m.text)))
    page.on("pageerror", lambda e: log.errors.append(str(e)))
    page.on("request", lambda r: log.requests.append(r.url))
    return page, log


def _clean(log: PageLog, base: str) -> None:
    assert not log.errors, log.errors
    assert not [c for c in log.console if c[0] in ("error", "warning")], log.console
    outside = [u for u in log.requests if not (u.startswith(base + "/") or u.startswith("data:"))]
    assert not outside, outside


def test_grid_head_examples_search_and_history_in_chromium(run):
    proc, base = _serve(run.path)
    try:
        with browser() as b:
            page, log = _page(b, base)
            page.goto(base + "/")
            assert page.locator("svg.grid a.cell").count() == 8  # 2 layers x 4 heads
            page.select_option("select[name=stat]", "induction_score")
            page.wait_for_url(re.compile(r"stat=induction_score"))
            page.click('a.cell[data-layer="1"][data-head="2"]')
            page.wait_for_url(re.compile(r"/head/decoder/self/1/2\?stat=induction_score"))
            assert "layer 1 head 2" in page.locator("h1").inner_text()
            assert page.locator("svg.hist rect").count() == 30
            shown = page.locator("#top li.example").evaluate_all("els => els.map(e => +e.dataset.text)")
            assert shown == run.top(1, 2, "induction_score", k=20).column("text")
            first = page.locator("#top li.example").first
            assert first.locator(".tok.q").count() >= 1 and first.locator(".tok.tgt").count() >= 1
            q = first.locator(".tok.q").nth(0)
            q.hover()
            assert first.locator(".tok.focus").count() == 1 and "focus" in q.get_attribute("class")
            page.go_back()
            page.wait_for_url(re.compile(r"/\?.*stat=induction_score"))
            assert page.locator("select[name=stat]").input_value() == "induction_score"
            page.go_forward()
            page.wait_for_url(re.compile(r"/head/decoder/self/1/2"))
            page.fill("input[name=q]", "L1H2")
            page.press("input[name=q]", "Enter")
            page.wait_for_url(re.compile(r"/search\?q=L1H2"))
            assert page.locator('ul.found-heads a[href^="/head/decoder/self/1/2"]').count() == 1
            word = TEXTS[9].split()[0]
            page.goto(f"{base}/search?q={word}")
            want = [i for i, t in enumerate(TEXTS) if word in t][:50]
            links = page.locator("ol.found-texts a").evaluate_all(
                "els => els.map(e => e.getAttribute('href'))"
            )
            assert [int(re.search(r"/text/(\d+)", h).group(1)) for h in links] == want
            page.locator("ol.found-texts a").first.click()
            page.wait_for_url(re.compile(rf"/text/{want[0]}"))
            assert page.locator("p.source").inner_text() == TEXTS[want[0]]
            assert page.locator("svg.grid a.cell").count() == 8
            page.goto(base + "/text/4")
            assert "Not captured" in page.locator("p.error").inner_text()
            r = page.goto(base + "/head/decoder/self/9/9")
            assert r.status == 404 and page.locator("p.error").inner_text() == (
                "no decoder self-attention layer 9 head 9 in this run"
            )
            log.console = [c for c in log.console if "404" not in c[1]]  # the page asked for was a 404
            _clean(log, base)
    finally:
        _stop(proc)


def test_with_the_model_a_text_is_captured_again_for_its_marks_and_report(run):
    proc, base = _serve(run.path, "--model", "minigpt")
    try:
        with browser() as b:
            page, log = _page(b, base)
            page.goto(base + "/head/decoder/self/0/1?stat=prev&k=3")  # prev: no examples kept
            first = page.locator("#top li.example").first
            assert first.locator(".tok.q").count() == 0
            first.locator("button.capture").click()
            first.locator(".tok.q").first.wait_for(timeout=60_000)
            assert (
                first.locator(".tok.q").count() == 4
            )  # the 4 positions with the largest previous-token weight
            assert page.locator("table.partners").count() == 1  # composition from the model's weights
            page.goto(base + "/text/9")
            page.click("text=the full report")
            page.wait_for_url(re.compile(r"/text/9/report"), timeout=120_000)
            assert "probe" in page.title().lower()
            outside = [u for u in log.requests if not (u.startswith(base + "/") or u.startswith("data:"))]
            assert not outside, outside
            assert not log.errors, log.errors
    finally:
        _stop(proc)


def _cli(*args: str) -> tuple[int, str]:
    r = subprocess.run(
        [sys.executable, "-m", "probe", *args], env=_env(), capture_output=True, text=True, timeout=120
    )
    return r.returncode, r.stderr


def test_what_probe_serve_refuses_is_one_line(run, tmp_path):
    code, err = _cli("serve", str(tmp_path))
    assert code == 2 and err.strip().count("\n") == 0 and "is not a corpus run (no manifest.json)" in err
    bad = tmp_path / "run"
    shutil.copytree(run.path, bad)
    f = bad / "shards" / "00001.texts.parquet"
    f.write_bytes(f.read_bytes()[:100])
    code, err = _cli("serve", str(bad))
    assert code == 2 and err.strip().count("\n") == 0 and f"{f} is corrupt or half-written" in err
    proc, base = _serve(run.path)
    try:
        port = base.rsplit(":", 1)[1]
        code, err = _cli("serve", str(run.path), "--port", port)
        assert code == 2 and err.strip().count("\n") == 0 and f"cannot listen on 127.0.0.1:{port}" in err
    finally:
        _stop(proc)
