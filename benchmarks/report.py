"""Benchmark: rendering the HTML report, its size, and how the page behaves in Chromium.

1. Render time and size: ``probe.report`` for a GPT-2-small-shaped decoder (12 layers x 12 heads,
   random weights, SDPA) at T = 128 and for the bundled ``minigpt`` (its tutorial figures
   included), medians of ``--repeats`` renders after one warm-up (so the one-time imports of
   matplotlib/seaborn and fonts are left out; they are printed separately). The capture is not
   timed; its own benchmark is benchmarks/capture.py.
2. The page in headless Chromium (Playwright, /usr/bin/chromium) for growing T and head counts
   (synthetic softmax patterns, tests/report_caches.py): time until every view is drawn, the
   median time to switch the explorer to another head and to move the hovered cell, each
   including one animation frame, and how many heads are embedded at full resolution.
   "Smooth" means a head switch under 100 ms and a hover under 16 ms (one frame at 60 Hz).

    python benchmarks/report.py                      # both tables
    python benchmarks/report.py --repeats 1 --no-browser
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import gpt2_shaped  # noqa: E402
import report_caches  # noqa: E402

import probe  # noqa: E402

PAGES = [(128, 12, 12), (512, 12, 12), (1024, 2, 4), (2048, 1, 1), (2048, 2, 2), (4096, 1, 1)]

SWITCH_JS = """async (n) => {
  const v = probe.views[0], frame = () => new Promise(r => requestAnimationFrame(() => r()));
  const nHeads = Math.max(1, Math.min(v.set.nFull, v.set.layers.length * v.set.heads.length));
  const times = [];
  for (let i = 0; i < n; i++) {
    const idx = (i + 1) % nHeads, t0 = performance.now();
    v.selectHead(Math.floor(idx / v.set.heads.length), idx % v.set.heads.length);
    await frame();
    times.push(performance.now() - t0);
  }
  return times;
}"""

HOVER_JS = """async (n) => {
  const v = probe.views[0], frame = () => new Promise(r => requestAnimationFrame(() => r()));
  const times = [];
  for (let i = 0; i < n; i++) {
    const q = (i * 7919) % v.set.nq, k = Math.min(q, (i * 104729) % v.set.nk), t0 = performance.now();
    v.focusCell(q, k, null);
    await frame();
    times.push(performance.now() - t0);
  }
  return times;
}"""


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def render_table(repeats: int, tmp: Path) -> None:
    import models

    t0 = time.perf_counter()
    import probe.plot  # noqa: F401  (matplotlib, seaborn)
    from probe.report import html

    html.discover()
    print(f"one-time imports (matplotlib, seaborn, sections): {time.perf_counter() - t0:.2f} s\n")
    rows = []
    gpt = gpt2_shaped.build()
    ids = torch.randint(0, 50257, (1, 128), generator=torch.Generator().manual_seed(0))
    mini = probe.capture(models.load("minigpt"), "attention lets tokens read.")
    cases = [
        ("gpt2-small-shaped, 12 x 12 heads", 128, probe.capture(gpt, ids)),
        ("minigpt (+ tutorial figures)", 27, mini),
    ]
    for name, T, cache in cases:
        out = tmp / name.split(",")[0].split(" ")[0]
        probe.report(cache, out, progress=False)  # warm-up
        s = _median_time(lambda c=cache, o=out: probe.report(c, o, progress=False), repeats)
        size = (out / "index.html").stat().st_size
        rows.append((name, T, s, size))
    print("| report | T | render s (median) | index.html MB |")
    print("|---|---|---|---|")
    for name, T, s, size in rows:
        print(f"| {name} | {T} | {s:.2f} | {size / 2**20:.2f} |")
    print()


def browser_table(tmp: Path, n: int) -> None:
    from probe.report.browser import browser, open_report

    print("| T | layers x heads | exact heads | index.html MB | load s | head switch ms | hover ms |")
    print("|---|---|---|---|---|---|---|")
    with browser() as b:
        for T, L, H in PAGES:
            cache = report_caches.synthetic([f"t{i}" for i in range(T)], n_layers=L, n_heads=H)
            path = probe.report(cache, tmp / f"p{T}_{L}x{H}", progress=False)
            t0 = time.perf_counter()
            page, log = open_report(b, path)
            load = time.perf_counter() - t0
            n_full = page.evaluate("probe.views[0].set.nFull")
            switch = statistics.median(page.evaluate(SWITCH_JS, n))
            hover = statistics.median(page.evaluate(HOVER_JS, 4 * n))
            assert not log.errors, log.errors
            page.close()
            mb = path.stat().st_size / 2**20
            print(f"| {T} | {L} x {H} | {n_full} | {mb:.2f} | {load:.2f} | {switch:.1f} | {hover:.1f} |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--switches", type=int, default=10, help="head switches timed per page")
    ap.add_argument("--no-browser", action="store_true", help="skip the Chromium table")
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as d:
        render_table(args.repeats, Path(d))
        if not args.no_browser:
            browser_table(Path(d), args.switches)


if __name__ == "__main__":
    main()
