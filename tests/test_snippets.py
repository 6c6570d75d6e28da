"""Every code snippet of README.md and docs/*.md runs as written and prints what the page shows.

One test per snippet, named ``FILE:LINE`` (the line of its opening fence); the snippets of a page
run in order in one namespace and one temporary folder. The convention is in tests/snippet_pages.py
and docs/writing-docs.md. ``PROBE_SNIPPETS_UPDATE=1 pytest tests/test_snippets.py`` rewrites the
expected output that drifted.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import snippets

CASES = [(page, i, s.id) for page in snippets.pages() for i, s in enumerate(snippets.extract(page))]
PAGES: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _write_updates():
    # pages run in this process: leave no trace for the tests after this module (a page may put
    # examples/ on sys.path or seed torch's global generator)
    import torch

    path, rng = list(sys.path), torch.get_rng_state()
    yield
    for where in snippets.apply_edits():
        print(f"snippets: rewrote the expected output at {where}")
    PAGES.clear()
    sys.path[:] = path
    torch.set_rng_state(rng)


def _translator_ready() -> None:
    # the translator trains on first use (into this session's $PROBE_CACHE_DIR, see conftest.py) and
    # says so once; train it before any page runs, so that no page's output depends on running first
    if not PAGES:
        import contextlib
        import io

        import models

        with contextlib.redirect_stderr(io.StringIO()):
            models.load("translator")
            models.load("smollm2")  # converted on first use, with a notice, like the translator


@pytest.fixture(scope="module")
def page_dirs(tmp_path_factory):
    return tmp_path_factory


@pytest.mark.parametrize(("page", "index"), [c[:2] for c in CASES], ids=[c[2] for c in CASES])
def test_snippet(page, index, page_dirs):
    _translator_ready()
    if page not in PAGES:
        name = page.relative_to(snippets.ROOT).as_posix().replace("/", "-").removesuffix(".md")
        PAGES[page] = snippets.Page(page, page_dirs.mktemp(name))
    before = len(snippets.EDITS)
    try:
        PAGES[page].run_through(index)
    except snippets.SnippetSkipped as e:
        pytest.skip(str(e))
    if len(snippets.EDITS) > before:
        warnings.warn(
            f"{PAGES[page].snippets[index].id}: expected output updated from this run", stacklevel=1
        )


def test_convention_on_a_sample_page(tmp_path, monkeypatch):
    # the runner itself, on a page written here: outputs compared, `...` wildcards, exit codes, no-run
    monkeypatch.setenv("PROBE_SNIPPETS_UPDATE", "0")  # compare, even in a run that updates the pages
    page = tmp_path / "sample.md"
    page.write_text(
        "```python\nx = 6 * 7\nprint('answer', x)\nx  # -> 42\n```\n\n```text\nanswer ...\n```\n\n"
        "```console\n$ echo one; echo two  # exit 0\none\n...\n$ false  # exit 1\n```\n\n"
        "<!-- no-run -->\n```bash\nexit 3\n```\n\n"
        "```python\nprint(x + 1)\n```\n```text\n44\n```\n",
        encoding="utf-8",
    )
    found = snippets.extract(page)
    assert [s.kind for s in found] == ["python", "shell", "shell", "python"]
    assert found[0].expected == ["answer ..."] and found[2].skip == "<!-- no-run -->"
    assert [(c.code, c.exit, c.expected) for c in found[1].commands] == [
        ("echo one; echo two  # exit 0", 0, ["one", "..."]),
        ("false  # exit 1", 1, None),
    ]
    run = snippets.Page(page, tmp_path)
    run.run_through(1)  # the first three: all as shown
    with pytest.raises(snippets.SnippetSkipped):
        run.run_through(2)
    with pytest.raises(snippets.SnippetFailure, match=r"-44\n\+43"):
        run.run_through(3)  # 6 * 7 + 1 is 43, not the 44 the page shows


def test_wildcards_and_regeneration():
    assert snippets.matches(["a ... c", "...", "z"], ["a b c", "x", "y", "z"])
    assert not snippets.matches(["a ... c"], ["a b d"])
    assert snippets.matches(["..."], [])
    assert snippets.same_value("torch.Size([1, 4])", "torch.Size([1,\n  4])")
    assert snippets.same_value("[1, ...]", "[1, 2, 3]")
    assert snippets.regenerate(["wrote ... KB", "old"], ["wrote 12 KB", "new"]) == ["wrote ... KB", "new"]
    # floats within a relative 1e-3 or one unit of their last shown digit; integers exactly
    assert snippets.matches(["max 6.475447177886963, kl 2.109e-08"], ["max 6.47544527053833, kl 2.11e-08"])
    assert snippets.matches(["run, 72.6 KB"], ["run, 72.5 KB"])
    assert not snippets.matches(["run, 72.6 KB"], ["run, 72.4 KB"])
    assert not snippets.matches(["kl 2.109e-08"], ["kl 2.12e-08"])
    assert not snippets.matches(["104,598 parameters"], ["104,599 parameters"])
    assert not snippets.matches(["probe 0.1.0"], ["probe 0.1.1"])  # a version is no float
    assert snippets.same_value("tensor(0.2114)", "tensor(0.2115)")
    assert not snippets.same_value("tensor(0.2114)", "tensor(0.2125)")
    text = "bar:  50%|#####     | 1/2 [00:01<00:01]\rbar: 100%|##########| 2/2 [00:02<00:00]\ndone\n"
    assert snippets.normalise(text, {}) == ["done"]
    assert snippets.normalise("saved /tmp/x/run.safetensors\n", {"/tmp/x": "..."}) == [
        "saved .../run.safetensors"
    ]
