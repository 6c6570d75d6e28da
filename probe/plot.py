"""``probe.plot``: attention figures as matplotlib Figures (PNG, SVG or PDF via :func:`save`).

    import models, probe
    cache = probe.capture(models.load("minigpt"), "attention lets tokens")
    fig = probe.plot.heatmap(cache, layer=0, head=0)     # title "Layer 0, Head 0"
    probe.plot.save(fig, "reports/minigpt_layer0_head0.png")

``layer``/``head`` count from 0 everywhere, in arguments and in titles (as in ``cache.pattern``).
See :mod:`probe.report.figures` for the conventions and :mod:`probe.report.seeds` for the
tutorials' own figures.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from probe.report import seeds as _seeds
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
from probe.report.image_figures import distance_depth, image_heads, image_layers, image_map, stage_maps
from probe.report.matrix import matrix, save


def seed_caches(names: Iterable[str] = _seeds.MODELS) -> dict:
    """Capture each named zoo model on its tutorial's text (``probe.report.seeds.TEXTS``):
    ``{name: probe.Cache}``, ready for :func:`seed_figures` or ``probe.report(..., tutorial=)``.

    The translator is trained on first use (with a progress bar) and cached by ``models.load``.
    """
    import models  # the zoo ships beside probe; imported only when tutorial figures are asked for
    from probe.entry import capture

    names = list(names)
    for name in names:
        _seeds.check_name(name)
    out = {}
    for name in names:
        text, target = _seeds.TEXTS[name]
        out[name] = capture(models.load(name), text, target=target)
    return out


def seed_figures(
    out_dir: str | os.PathLike,
    *,
    names: Iterable[str] = _seeds.MODELS,
    fmt: str = "png",
    caches: Mapping[str, object] | None = None,
) -> list[Path]:
    """Write the tutorials' figures of the zoo models ``names`` into ``out_dir`` as
    ``<name>.<fmt>``; returns the paths. ``caches`` (``{name: cache}`` on the tutorials' texts)
    skips the captures; by default :func:`seed_caches` makes them."""
    names = list(names)
    if caches is None:
        caches = seed_caches(names)
    return _seeds.write_figures(out_dir, caches, names, fmt)


__all__ = [
    "heatmap",
    "overview",
    "cross",
    "over_time",
    "residual_norms",
    "residual_norm_values",
    "head_matrix",
    "image_map",
    "image_heads",
    "image_layers",
    "distance_depth",
    "stage_maps",
    "matrix",
    "save",
    "seed_caches",
    "seed_figures",
    "cjk_font",
]
