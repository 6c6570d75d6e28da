"""``probe.plot``: attention figures as matplotlib Figures (PNG, SVG or PDF via :func:`save`).

    import models, probe
    cache = probe.capture(models.load("minigpt"), "attention lets tokens")
    fig = probe.plot.heatmap(cache, layer=0, head=0)     # title "Layer 1, Head 1"
    probe.plot.save(fig, "reports/minigpt_layer1_head1.png")

``layer``/``head`` are 0-based (as in ``cache.pattern``); titles count from 1. See
:mod:`probe.report.figures` for the conventions and :mod:`probe.report.seeds` for the
tutorials' own figures.
"""

from probe.report.figures import (
    cross,
    head_matrix,
    heatmap,
    over_time,
    overview,
    residual_norm_values,
    residual_norms,
)
from probe.report.fonts import cjk_font
from probe.report.matrix import matrix, save
from probe.report.seeds import seed_figures

__all__ = [
    "heatmap",
    "overview",
    "cross",
    "over_time",
    "residual_norms",
    "residual_norm_values",
    "head_matrix",
    "matrix",
    "save",
    "seed_figures",
    "cjk_font",
]
