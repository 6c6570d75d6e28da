"""The tutorial's own figures, when the report is about a bundled zoo model (see probe.report.seeds)."""

from __future__ import annotations

TITLE = "Tutorial figures"
ORDER = 15


def build(ctx) -> dict | None:
    """The seed figures of the first cache's zoo model, captured on the tutorial's own text;
    None for any other model."""
    from probe.report import seeds

    name = (ctx.cache.metadata.get("model") or {}).get("name")
    if name not in seeds.MODELS:
        return None
    ctx.progress(f"tutorial figures ({name})")
    items = [
        {"name": f.name, "tutorial": f.tutorial, "caption": f.caption, "fig": ctx.figure(f.figure, f.caption)}
        for f in seeds.figures_for(names=[name])
    ]
    return {"model": name, "figures": items}
