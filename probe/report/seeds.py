"""The tutorials' own figures, reproduced from the bundled zoo models.

What a student compares with the textbook (texts, titles and axis labels as in the tutorials):

- 001 mini-GPT: "Layer 1, Head 1 attention weights" over ``attention lets tokens`` (Blues, Key /
  Query axis labels in English and Chinese);
- 003 fused-QKV decoder: head 0's "Attention Weights Heatmap" (rainbow) and its "Attention Pattern
  Over Time" (query rows t = 0, 2, 4, ... as lines over key positions);
- 004 translator: the last layer's first head (viridis) for encoder self-attention over
  ``ich mochte ein bier P``, decoder self-attention over ``S i want a beer`` and decoder-encoder
  attention (English queries over German keys).

Tutorial 004 labels all three of its plots with the source words on x and the target words on y;
here each axis carries the tokens that really are its queries and keys.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from probe.errors import ProbeError
from probe.report import figures
from probe.report.matrix import save

MODELS = ("minigpt", "fused_decoder", "translator")
MINIGPT_TEXT = "attention lets tokens"
# Tutorial 003 draws a random training sequence of 10 digits; any 10 digits show the same mask.
FUSED_TEXT = "3141592653"
TRANSLATOR_SOURCE = "ich mochte ein bier P"
TRANSLATOR_TARGET = "S i want a beer"


@dataclass
class SeedFigure:
    """One tutorial figure: ``name`` (file stem), ``tutorial`` ("001"...), ``caption`` (what it
    shows and what to compare) and the matplotlib ``figure``."""

    name: str
    tutorial: str
    caption: str
    figure: Figure


def seed_caches(names: Iterable[str] = MODELS) -> dict:
    """Capture each named zoo model on its tutorial's text: ``{name: probe.Cache}``.

    The translator is trained on first use (about a minute) and cached by ``models.load``.
    """
    import models  # the zoo ships beside probe; imported only when seed figures are asked for
    from probe.forward import capture

    out = {}
    for name in names:
        if name not in MODELS:
            raise ProbeError(f"no tutorial figures for model {name!r}; choose from {', '.join(MODELS)}")
        model = models.load(name)
        if name == "minigpt":
            out[name] = capture(model, MINIGPT_TEXT)
        elif name == "fused_decoder":
            out[name] = capture(model, FUSED_TEXT)
        else:
            out[name] = capture(model, TRANSLATOR_SOURCE, target=TRANSLATOR_TARGET)
    return out


def _minigpt(cache) -> list[SeedFigure]:
    fig = figures.heatmap(
        cache,
        0,
        0,
        title="Layer 1, Head 1 attention weights",
        xlabel="Key / 被读取的位置",
        ylabel="Query / 当前预测的位置",
        cmap="Blues",
    )
    caption = (
        "Tutorial 001, section 9: the trained mini-GPT's first layer, first head on "
        f"'{MINIGPT_TEXT}'. Row i is what position i reads; the causal mask makes every cell "
        "right of the diagonal 0."
    )
    return [SeedFigure("minigpt_layer1_head1", "001", caption, fig)]


def _fused(cache) -> list[SeedFigure]:
    heat = figures.heatmap(
        cache,
        0,
        0,
        title="Attention Weights Heatmap (Head 0)",
        xlabel="Key Position",
        ylabel="Query Position",
        cmap="rainbow",
        ticks="positions",
    )
    n = len(FUSED_TEXT)
    lines = figures.over_time(
        cache,
        0,
        0,
        queries=range(0, n, 2),
        title="Attention Pattern Over Time",
        xlabel="Key Position",
        ticks="positions",
    )
    return [
        SeedFigure(
            "fused_decoder_head0",
            "003",
            f"Tutorial 003: head 0 of the fused-QKV masked decoder on the digits {FUSED_TEXT}; "
            "the upper triangle (future keys) is 0.",
            heat,
        ),
        SeedFigure(
            "fused_decoder_over_time",
            "003",
            "Tutorial 003: head 0's query rows t = 0, 2, 4, 6, 8 as lines over key positions; "
            "query t puts all its weight on keys 0..t.",
            lines,
        ),
    ]


def _translator(cache) -> list[SeedFigure]:
    last = cache.n_layers("decoder") - 1
    enc = figures.heatmap(cache, cache.n_layers("encoder") - 1, 0, stack="encoder", cmap="viridis")
    dec = figures.heatmap(cache, last, 0, stack="decoder", cmap="viridis")
    crs = figures.heatmap(
        cache,
        last,
        0,
        stack="decoder",
        kind="cross",
        cmap="viridis",
        xlabel="Source (keys)",
        ylabel="Target (queries)",
    )
    return [
        SeedFigure(
            "translator_enc_self_attn",
            "004",
            f"Tutorial 004, first figure: last encoder layer, first head, over '{TRANSLATOR_SOURCE}'. "
            "The P (padding) column is 0: the pad mask hides it.",
            enc,
        ),
        SeedFigure(
            "translator_dec_self_attn",
            "004",
            f"Tutorial 004, second figure: last decoder layer, first head, over '{TRANSLATOR_TARGET}'. "
            "The upper triangle is 0: the subsequent mask hides future words.",
            dec,
        ),
        SeedFigure(
            "translator_dec_enc_attn",
            "004",
            "Tutorial 004, third figure: decoder-encoder attention of the last layer, first head: "
            "English queries over German keys; the P column is 0.",
            crs,
        ),
    ]


_BUILDERS = {"minigpt": _minigpt, "fused_decoder": _fused, "translator": _translator}


def figures_for(
    caches: Mapping[str, object] | None = None, names: Iterable[str] = MODELS
) -> list[SeedFigure]:
    """The tutorials' figures (see the module docstring), in tutorial order.

    ``caches`` maps model name to a cache captured on the tutorial's text (:func:`seed_caches`
    makes them; pass your own to skip the captures). Returns a list of :class:`SeedFigure`.
    """
    names = list(names)
    if caches is None:
        caches = seed_caches(names)
    out: list[SeedFigure] = []
    for name in names:
        if name not in _BUILDERS:
            raise ProbeError(f"no tutorial figures for model {name!r}; choose from {', '.join(MODELS)}")
        out.extend(_BUILDERS[name](caches[name]))
    return out


def seed_figures(
    out_dir: str | os.PathLike, *, names: Iterable[str] = MODELS, fmt: str = "png", caches=None
) -> list[Path]:
    """Write the tutorials' figures into ``out_dir`` as ``<name>.<fmt>``; returns the paths."""
    paths = []
    for seed in figures_for(caches, names):
        paths.append(save(seed.figure, Path(out_dir) / f"{seed.name}.{fmt}"))
    return paths


__all__ = ["SeedFigure", "seed_caches", "figures_for", "seed_figures", "MODELS"]
