"""The circuit section's faithfulness curve as SVG geometry: each point's place, the axes' ticks.

x: the number of edges in the circuit (a log scale when the counts span more than a factor of
20 and none is 0); y: the share of the clean metric the circuit keeps (``kept``: its metric over
the clean run's) and its faithfulness (``(metric - corrupted) / (clean - corrupted)``), on one
axis that always holds 0 and 1.
"""

from __future__ import annotations

import math
from typing import Any

W, H = 600, 260
MARGIN = {"left": 52, "right": 18, "top": 14, "bottom": 40}
SERIES = (
    ("kept", "share of the clean metric kept", "#2b6cb0", ""),
    ("faithfulness", "faithfulness", "#b2182b", "5 4"),
)


def finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not math.isnan(v) and not math.isinf(v)


def nice_step(span: float, most: int = 6) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that cuts ``span`` into at most ``most`` steps."""
    if span <= 0:
        return 1.0
    base = 10 ** math.floor(math.log10(span / most))
    return next(m * base for m in (1, 2, 2.5, 5, 10) if span / (m * base) <= most)


def _x_axis(counts: list[int]):
    lo, hi = min(counts), max(counts)
    log = lo > 0 and hi / lo > 20
    x0, x1 = MARGIN["left"], W - MARGIN["right"]
    if log:
        a, b = math.log10(lo), math.log10(hi)

        def fx(n: float) -> float:
            return x0 + (math.log10(n) - a) / (b - a) * (x1 - x0)

        ticks = [10**k for k in range(math.floor(a), math.ceil(b) + 1) if lo <= 10**k <= hi]
        ticks = sorted(set(ticks) | {lo, hi})
    else:
        top = hi if hi > 0 else 1

        def fx(n: float) -> float:
            return x0 + n / top * (x1 - x0)

        ticks = sorted(set(counts)) if len(set(counts)) <= 12 else []
        if not ticks:
            step = nice_step(top)
            ticks = [round(i * step) for i in range(int(top // step) + 1)]
    return fx, [{"x": round(fx(t), 1), "text": f"{t:,}"} for t in ticks], log


def curve_figure(rows: list[dict]) -> dict[str, Any] | None:
    """The SVG geometry of the curve of ``rows`` (``edges``, ``kept``, ``faithfulness`` each), or
    None when no row has a count."""
    rows = [r for r in rows if finite(r.get("edges"))]
    if not rows:
        return None
    fx, xticks, log = _x_axis([int(r["edges"]) for r in rows])
    values = [r[k] for r in rows for k, *_ in SERIES if finite(r.get(k))]
    lo, hi = min([0.0, *values]), max([1.0, *values])
    step = nice_step(hi - lo)
    lo, hi = math.floor(lo / step) * step, math.ceil(hi / step) * step
    y0, y1 = H - MARGIN["bottom"], MARGIN["top"]

    def fy(v: float) -> float:
        return y0 - (v - lo) / (hi - lo) * (y0 - y1)

    yticks = [lo + i * step for i in range(round((hi - lo) / step) + 1)]
    series = []
    for key, label, colour, dash in SERIES:
        pts = [(fx(r["edges"]), fy(r[key]), r) for r in rows if finite(r.get(key))]
        series.append(
            {
                "key": key,
                "label": label,
                "colour": colour,
                "dash": dash,
                "points": " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in pts),
                "dots": [{"x": round(x, 1), "y": round(y, 1), "row": r} for x, y, r in pts],
            }
        )
    return {
        "w": W,
        "h": H,
        "m": MARGIN,
        "series": series,
        "xticks": xticks,
        "yticks": [{"y": round(fy(v), 1), "text": f"{v:g}"} for v in yticks],
        "zero": round(fy(0.0), 1),
        "one": round(fy(1.0), 1),
        "log": log,
    }
