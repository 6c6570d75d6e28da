"""The :class:`ReportContext` every report section's ``build(ctx)`` receives (see REPORT_CONTRACT)."""

from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from probe.cache import Cache

# In a <script type="application/json"> block only "</script" and "<!--" could end or confuse the
# block; escaping every <, > and & as \u003c etc. makes any JSON string safe there (and in HTML).
_JSON_ESCAPES = {ord("<"): "\\u003c", ord(">"): "\\u003e", ord("&"): "\\u0026"}


def _finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float as None (JSON's null)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def safe_json(obj: Any) -> str:
    """``obj`` as JSON text with ``<``, ``>`` and ``&`` escaped, safe inside any HTML element; a
    NaN or infinite number (a model that overflowed) is written as null."""
    try:
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:  # NaN or infinity: JSON has no such number
        text = json.dumps(_finite(obj), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    # U+2028/9 are valid in JSON but were line terminators in old JavaScript; escape them too.
    return text.translate(_JSON_ESCAPES).replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def figure_uri(fig: Any, *, dpi: int = 100) -> str:
    """A matplotlib Figure as a ``data:image/png;base64,...`` URI; closes the figure if pyplot
    manages it (sections build bare ``Figure`` objects, so the user's pyplot backend and open
    figures are never touched: a report made in a notebook leaves its inline plotting working)."""
    from probe.report.fonts import quiet_missing_glyphs

    buf = io.BytesIO()
    try:
        with quiet_missing_glyphs():  # without a CJK font, fonts.context warned once already
            fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    finally:
        if getattr(fig.canvas, "manager", None) is not None:
            import matplotlib.pyplot as plt

            plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


@dataclass
class ReportContext:
    """What a report section sees.

    ``caches`` are the caches the report shows (``cache`` is the first); ``model`` and
    ``tokenizer`` are set when the report was made from a model (``probe report --model/--hf``);
    ``results`` is shared between sections so nothing is computed twice.
    """

    caches: list[Cache]
    model: Any = None
    tokenizer: Any = None
    results: dict[str, Any] = field(default_factory=dict)
    on_progress: Callable[[str], None] | None = None

    @property
    def cache(self) -> Cache:
        """The first cache."""
        return self.caches[0]

    def figure(self, fig: Any, alt: str = "") -> str:
        """``fig`` (a matplotlib Figure) as an inline PNG data URI; the figure is closed.

        ``alt`` is accepted for symmetry with the template's ``<img alt>``; the template sets it.
        """
        return figure_uri(fig)

    def json(self, obj: Any) -> str:
        """JSON safe to embed in ``<script type="application/json">`` (``<``, ``>``, ``&`` escaped)."""
        return safe_json(obj)

    def progress(self, text: str) -> None:
        """Advance the report's progress bar, showing ``text``."""
        if self.on_progress is not None:
            self.on_progress(text)


__all__ = ["ReportContext", "safe_json", "figure_uri"]
