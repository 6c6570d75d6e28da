"""``probe.generate`` at the top level: the capture's generate, with ``keep="stats"`` reading through
the analysis' statistics (as :mod:`probe.entry` does for ``probe.capture``), so neither stage
imports the other."""

from __future__ import annotations

from typing import Any

from probe.capture.generation.generate import Generation
from probe.capture.generation.generate import generate as _generate


def _stats(model: Any, ids: Any, tokenizer: Any, layers: Any):
    from probe.entry import capture

    return capture(model, ids, tokenizer=tokenizer, keep="stats", layers=layers)


def generate(model: Any, prompt: Any, **kwargs: Any) -> Generation:
    """:func:`probe.capture.generation.generate.generate` (see there and ``docs/generation.md``), and
    ``keep="stats"``: each head's statistics of what the model read, never a pattern whole."""
    return _generate(model, prompt, stats_of=_stats, **kwargs)


generate.__doc__ = (generate.__doc__ or "") + "\n\n" + (_generate.__doc__ or "")

__all__ = ["Generation", "generate"]
