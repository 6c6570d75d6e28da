"""The docs site builds with ``mkdocs build --strict``: no broken link or anchor, no page left out
of the nav, every API reference resolved (mkdocs, mkdocs-material and mkdocstrings are in the
``docs`` and ``dev`` extras, so CI runs this)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _mkdocs() -> list[str]:
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as e:
        pytest.skip(f"the docs extra is not installed ({e.name}): pip install -e '.[docs]'")
    return [sys.executable, "-m", "mkdocs"]


def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [*_mkdocs(), "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    # every page of docs/ is in the site, and the API reference was generated from the docstrings
    pages = sorted(p.relative_to(ROOT / "docs").with_suffix("") for p in (ROOT / "docs").rglob("*.md"))
    for page in pages:
        built = site / page / "index.html" if page.name != "index" else site / "index.html"
        assert built.exists(), page
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("probe.capture.capture", "probe.check_causal", "probe.head_stats", "probe.run_corpus"):
        assert f'id="{name}"' in api, name
    assert "Run ``model`` on ``inputs``" not in api  # docstrings are rendered, not pasted raw
    # the examples page shows each script's source (pymdownx.snippets), not the include line
    examples = (site / "examples" / "index.html").read_text(encoding="utf-8")
    assert "8&lt;--" not in examples and ">train_toy<" in examples


def test_readme_links_point_at_existing_docs_pages():
    # README.md is not part of the site (mkdocs does not check it): check its links here
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(((?:docs|reports)/[^)#]+)(?:#[^)]*)?\)", readme)
    assert links
    for link in links:
        assert (ROOT / link).exists(), link


def test_the_readme_is_a_front_door_of_at_most_250_lines():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail into docs/"
