"""Open a report in Debian's headless Chromium (Playwright) and take a screenshot.

Used by the browser tests and by ``python -m probe.report.browser`` (:func:`main`, which makes
the README's ``reports/screenshot.png``), so the committed picture comes from the tested code path.
Needs the ``playwright`` Python package (``.[dev]``) and ``/usr/bin/chromium``
(``apt-get install chromium``); ``playwright install`` is not needed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM = os.environ.get("PROBE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@dataclass
class PageLog:
    """What a page did: console messages ``(type, text)``, page errors, requested URLs, dialogs."""

    console: list[tuple[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)


@contextlib.contextmanager
def browser() -> Iterator[Any]:
    """A headless Chromium (Playwright ``Browser``), closed on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def open_report(
    b: Any, index: str | os.PathLike, *, width: int = 1280, height: int = 900
) -> tuple[Any, PageLog]:
    """Open ``index`` (an index.html) from ``file://`` in a new page, wait until its views are drawn.

    Returns ``(page, log)``; the log keeps recording while the page lives. A dialog (``alert``)
    is recorded and dismissed.
    """
    log = PageLog()
    page = b.new_page(viewport={"width": width, "height": height})
    page.on("console", lambda m: log.console.append((m.type, m.text)))
    page.on("pageerror", lambda e: log.errors.append(str(e)))
    page.on("request", lambda r: log.requests.append(r.url))

    def on_dialog(d: Any) -> None:
        log.dialogs.append(d.message)
        d.dismiss()

    page.on("dialog", on_dialog)
    page.goto(Path(index).resolve().as_uri())
    # a function, not an expression: Playwright would poll an expression with eval(), which the
    # page's Content-Security-Policy (rightly) forbids
    page.wait_for_function("() => document.documentElement.dataset.probeReady === '1'", timeout=120_000)
    return page, log


def screenshot(
    index: str | os.PathLike,
    out: str | os.PathLike,
    *,
    width: int = 1200,
    height: int = 900,
    hover: tuple[int, int] | None = (5, 2),
    section: str | None = None,
    b: Any = None,
) -> Path:
    """Open the report ``index``, hover cell ``hover`` (query, key) of the first explorer, and
    write a PNG screenshot of the viewport (scrolled to ``section``'s anchor, if given) to ``out``
    atomically; returns ``out``. ``b`` reuses an open :func:`browser`."""
    from probe.files import atomic_path

    with contextlib.ExitStack() as stack:
        if b is None:
            b = stack.enter_context(browser())
        page, _ = open_report(b, index, width=width, height=height)
        if hover is not None:
            hover_cell(page, 0, *hover)
        if section is not None:
            page.evaluate("id => document.getElementById(id).scrollIntoView()", f"sec-{section}")
        with atomic_path(out) as tmp:
            page.screenshot(path=str(tmp), type="png")
        page.close()
    return Path(out)


def hover_cell(page: Any, view: int, q: int, k: int) -> str:
    """Move the mouse over cell (query ``q``, key ``k``) of explorer ``view``; returns its readout."""
    # bring the cell into the viewport: the explorer scrolls inside its own box at long lengths
    page.evaluate(
        """([v, q, k]) => {
          const view = probe.views[v], cv = view.el('.probe-matrix'), sc = view.el('.probe-scroll');
          sc.scrollIntoView({ block: 'center' });
          const zx = cv.clientWidth / view.set.nk, zy = cv.clientHeight / view.set.nq;
          sc.scrollLeft = Math.max(0, view.pad[0] + (k + 0.5) * zx - sc.clientWidth / 2);
          sc.scrollTop = Math.max(0, view.pad[1] + (q + 0.5) * zy - sc.clientHeight / 2);
        }""",
        [view, q, k],
    )
    cv = page.locator(".probe-attn .probe-matrix").nth(view)
    box = cv.bounding_box()
    nq, nk = page.evaluate(f"[probe.views[{view}].set.nq, probe.views[{view}].set.nk]")
    page.mouse.move(box["x"] + (k + 0.5) * box["width"] / nk, box["y"] + (q + 0.5) * box["height"] / nq)
    return page.locator(".probe-attn .probe-readout").nth(view).text_content()


def main(argv: list[str] | None = None) -> int:
    """``python -m probe.report.browser INDEX OUT.png [--section NAME]``: screenshot a report."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m probe.report.browser", description=main.__doc__)
    p.add_argument("index", help="a report's index.html")
    p.add_argument("out", help="PNG file to write")
    p.add_argument("--section", default=None, help="scroll to this section first (e.g. attention)")
    p.add_argument("--width", type=int, default=1200)
    p.add_argument("--height", type=int, default=900)
    a = p.parse_args(argv)
    print(screenshot(a.index, a.out, width=a.width, height=a.height, section=a.section))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
