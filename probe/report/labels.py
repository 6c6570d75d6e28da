"""How token labels stay legible: whitespace made visible, long tokens shortened, labels thinned.

Which positions of a pattern are real and which tokens label its axes is the cache's own query
(:meth:`probe.Cache.axes`, :mod:`probe.cache.axes`).
"""

from __future__ import annotations

import math

MAX_LABEL_CHARS = 12


def display(token: str) -> str:
    """A token as a tick label: whitespace made visible, long tokens shortened."""
    if token == "":
        return "∅"
    shown = token.replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍")
    if shown.strip() == "":
        shown = "␣" * len(shown)
    if len(shown) > MAX_LABEL_CHARS:
        shown = shown[: MAX_LABEL_CHARS - 1] + "…"
    return shown


def font_size(n: int) -> float:
    """Tick label size (points) for an axis of ``n`` labels."""
    return 9.0 if n <= 32 else 8.0 if n <= 64 else 7.0 if n <= 128 else 6.0


def step(n: int, length_pt: float, size_pt: float) -> int:
    """Show every ``step``-th of ``n`` labels so that they fit ``length_pt`` points of axis."""
    if n <= 1 or length_pt <= 0:
        return 1
    return max(1, math.ceil(n * size_pt * 1.3 / length_pt))


__all__ = ["display", "font_size", "step"]
