"""The tutorial's own figures, when the report is about a bundled zoo model (see probe.report.seeds).

The figures need a capture of the tutorial's own text. The report never captures: it takes the
cache the caller passed as ``probe.report(..., tutorial=)`` (``probe report --model`` does), or
the report's first cache when that is the tutorial's text already; otherwise the section says
how to get them.
"""

from __future__ import annotations

from collections.abc import Mapping

from probe.cache import Cache

TITLE = "Tutorial figures"
ORDER = 15


def _tutorial_cache(ctx, name: str):
    from probe.report import seeds

    given = ctx.results.get("tutorial")
    if isinstance(given, Mapping) and not isinstance(given, Cache):  # a Cache is a Mapping too
        given = given.get(name)
    if given is not None:
        return given
    return ctx.cache if seeds.is_tutorial_cache(ctx.cache, name) else None


def build(ctx) -> dict | None:
    """The seed figures of the first cache's zoo model; None for any other model."""
    from probe.report import seeds

    name = (ctx.cache.metadata.get("model") or {}).get("name")
    if name not in seeds.MODELS:
        return None
    cache = _tutorial_cache(ctx, name)
    if cache is None:
        text, target = seeds.TEXTS[name]
        return {"model": name, "figures": [], "text": text, "target": target}
    ctx.progress(f"tutorial figures ({name})")
    items = [
        {"name": f.name, "tutorial": f.tutorial, "caption": f.caption, "fig": ctx.figure(f.figure, f.caption)}
        for f in seeds.figures_for({name: cache}, [name])
    ]
    return {"model": name, "figures": items}
