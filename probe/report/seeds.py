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

This module draws from caches only: the captures on the tutorials' texts (:data:`TEXTS`) are the
caller's (``probe.plot.seed_caches`` makes them; ``probe report --model`` does it with the model it
loaded). Titles follow probe's convention (layers and heads from 0) except tutorial 001's, which
keeps the tutorial's "Layer 1, Head 1" and says in the title which probe layer and head it is.
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
# what each model is captured on: (text, decoder target text or None)
TEXTS: dict[str, tuple[str, str | None]] = {
    "minigpt": (MINIGPT_TEXT, None),
    "fused_decoder": (FUSED_TEXT, None),
    "translator": (TRANSLATOR_SOURCE, TRANSLATOR_TARGET),
}


@dataclass
class SeedFigure:
    """One tutorial figure: ``name`` (file stem), ``tutorial`` ("001"...), ``caption`` (what it
    shows and what to compare) and the matplotlib ``figure``."""

    name: str
    tutorial: str
    caption: str
    figure: Figure


def check_name(name: str) -> None:
    """A one-line :class:`ProbeError` unless ``name`` is a zoo model with tutorial figures."""
    if name not in MODELS:
        raise ProbeError(f"no tutorial figures for model {name!r}; choose from {', '.join(MODELS)}")


def is_tutorial_cache(cache, name: str | None = None) -> bool:
    """Whether ``cache`` is zoo model ``name`` (default: the cache's own model) captured on its
    tutorial's text, one text (and for the translator the tutorial's target)."""
    meta = cache.metadata
    name = name or (meta.get("model") or {}).get("name")
    if name not in TEXTS or (meta.get("model") or {}).get("name") != name:
        return False
    text, target = TEXTS[name]
    return meta.get("texts") == [text] and (target is None or meta.get("target_texts") == [target])


def _minigpt(cache) -> list[SeedFigure]:
    fig = figures.heatmap(
        cache,
        0,
        0,
        title="Layer 1, Head 1 attention weights\n(the tutorial counts from 1: probe's layer 0, head 0)",
        xlabel="Key / 被读取的位置",
        ylabel="Query / 当前预测的位置",
        cmap="Blues",
    )
    caption = (
        "Tutorial 001, section 9: the trained mini-GPT's first layer, first head on "
        f"'{_text(cache, MINIGPT_TEXT)}'. Row i is what position i reads; the causal mask makes every "
        "cell right of the diagonal 0. The axis labels are the tutorial's own, in English and "
        "Chinese: 被读取的位置 'the position being read' (the keys), 当前预测的位置 'the position "
        "being predicted' (the queries). ␣ marks a space."
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
            f"Tutorial 003: head 0 of the fused-QKV masked decoder on the digits {_text(cache, FUSED_TEXT)}; "
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
    last = cache.pattern_layers("decoder")[-1]
    enc_last = cache.pattern_layers("encoder")[-1]
    enc = figures.heatmap(cache, enc_last, 0, stack="encoder", cmap="viridis")
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
            f"Tutorial 004, first figure: the last encoder layer ({enc_last}), first head (0), over "
            f"'{_text(cache, TRANSLATOR_SOURCE)}'. P is the padding word: its column is 0, the pad "
            "mask hides it.",
            enc,
        ),
        SeedFigure(
            "translator_dec_self_attn",
            "004",
            f"Tutorial 004, second figure: the last decoder layer ({last}), first head (0), over "
            f"'{_text(cache, TRANSLATOR_TARGET, 'target_texts')}'. S is the start token the decoder "
            "reads first (teacher forcing). The upper triangle is 0: the subsequent mask hides "
            "future words.",
            dec,
        ),
        SeedFigure(
            "translator_dec_enc_attn",
            "004",
            f"Tutorial 004, third figure: decoder-encoder attention of the last layer ({last}), first "
            "head (0): English queries (S = start) over German keys; the P (padding) column is 0.",
            crs,
        ),
    ]


_BUILDERS = {"minigpt": _minigpt, "fused_decoder": _fused, "translator": _translator}


def _text(cache, default: str, field: str = "texts") -> str:
    """The first text the cache was captured on (the tutorial's ``default`` if it holds none)."""
    texts = cache.metadata.get(field) or []
    return str(texts[0]) if texts and texts[0] is not None else default


def figures_for(caches: Mapping[str, object], names: Iterable[str] | None = None) -> list[SeedFigure]:
    """The tutorials' figures (see the module docstring), in tutorial order, drawn from ``caches``.

    ``caches`` maps a zoo model name to a cache of that model captured on the tutorial's text
    (:data:`TEXTS`; ``probe.plot.seed_caches`` makes them); ``names`` picks some (default: every
    name in ``caches``). Returns a list of :class:`SeedFigure`.
    """
    names = [n for n in MODELS if n in caches] if names is None else list(names)
    out: list[SeedFigure] = []
    for name in names:
        check_name(name)
        if name not in caches:
            raise ProbeError(
                f"no cache for {name!r}; capture it on its tutorial's text first "
                f"(probe.plot.seed_caches([{name!r}]))"
            )
        out.extend(_BUILDERS[name](caches[name]))
    return out


def write_figures(
    out_dir: str | os.PathLike,
    caches: Mapping[str, object],
    names: Iterable[str] | None = None,
    fmt: str = "png",
) -> list[Path]:
    """Write the tutorials' figures of ``caches`` into ``out_dir`` as ``<name>.<fmt>``; returns
    the paths."""
    return [save(f.figure, Path(out_dir) / f"{f.name}.{fmt}") for f in figures_for(caches, names)]


__all__ = ["SeedFigure", "check_name", "figures_for", "write_figures", "is_tutorial_cache", "MODELS", "TEXTS"]
