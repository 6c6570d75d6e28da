"""Attention on the picture: for an image model's cache, what [CLS] reads layer by layer and its
attention rollout, and each head of the last layer, laid over the picture the model saw; a hover
view per picture (hover a patch: what it reads); for a vision-language model, the text beside
each picture (hover a word: where on the picture it reads). The hover views' data is
:mod:`probe.report.sections._image_hover`'s, drawn by ``static/image_hover.js``."""

from __future__ import annotations

from dataclasses import dataclass, field

from markupsafe import Markup

TITLE = "Attention on the picture"
ORDER = 22
MAX_IMAGES = 4  # pictures drawn per cache; the rest are left out (the section says so)


def _positions(cache) -> list[tuple[str, dict]]:
    """``(stack, positions)`` of every stack of ``cache`` that holds patterns and knows its picture's
    positions (a grid, or a vision-language model's rows)."""
    from probe.cache.pictures import picture_stacks

    return [(s, pos) for s, pos in picture_stacks(cache.metadata) if cache.pattern_layers(s)]


def _staged(cache) -> list[tuple[str, dict]]:
    """``(stack, positions)`` of every stack whose layers have grids of their own (Swin's stages)
    and whose blocks are numbered attentions (which the per-layer figures do not read)."""
    out = []
    for s, meta in (cache.metadata.get("stacks") or {}).items():
        pos = (meta or {}).get("positions")
        if isinstance(pos, dict) and pos.get("layer_grids") and not cache.pattern_layers(s):
            out.append((s, pos))
    return out


@dataclass
class _Found:
    """What the section gathers over the report's caches."""

    items: list = field(default_factory=list)  # a picture of an image model: figures, hover view
    words: list = field(default_factory=list)  # a picture of a text: the words' hover view
    views: list = field(default_factory=list)  # every hover view (their budget is planned at once)
    depth: list = field(default_factory=list)  # distance against depth, per cache
    artifacts: list = field(default_factory=list)  # the artifact sentence, per cache
    stages: list = field(default_factory=list)  # Swin: stage-by-stage figures, per picture
    left_out: int = 0  # pictures not drawn


def build(ctx) -> dict | None:
    """Per picture (up to :data:`MAX_IMAGES` per cache) two figures and a hover view; per
    picture of a vision-language model's texts a word hover view; per picture of a Swin cache its
    stages; None when no cache holds an image grid."""
    from probe.report.sections import _image_hover as hv

    f = _Found()
    multi = len(ctx.caches) > 1
    for ci, cache in enumerate(ctx.caches):
        found = _positions(cache)
        where = f"cache {ci + 1}, " if multi else ""
        for stack, pos in [(s, p) for s, p in found if "grid" in p][:1]:
            _grid_pictures(ctx, f, cache, ci, stack, pos, where, multi)
        for stack, _pos in _staged(cache):  # Swin: a grid per stage, blocks numbered in a layer
            _stage_pictures(ctx, f, cache, ci, stack, where)
        for stack, pos in [(s, p) for s, p in found if "rows" in p]:
            _text_pictures(f, cache, stack, pos, where)
    if not f.items and not f.words and not f.stages:
        return None
    hv.plan(f.views)
    embedded = 0
    for it in [*f.items, *f.words]:
        v = it.pop("view")
        if v is None:  # no layer on the picture's own grid: the figures only
            it["data"] = None
            continue
        ctx.progress(f"hover maps: {it['label']}")
        it["data"] = hv.view_data(v)
        it["chips"] = v.chips
        it["note"] = _layers_note(v)
        embedded += hv.embedded_bytes(it["data"])
    return {
        "pictures": f.items,
        "words": f.words,
        "depth": f.depth,
        "artifacts": f.artifacts,
        "stages": f.stages,
        "left_out": f.left_out,
        "has_picture": any(c.metadata.get("image_png") for c in ctx.caches),
        "embedded_mb": f"{embedded / 2**20:.2f}",
        "lut": _lut(),
        "js": Markup(hv.view_script("image_hover.js")),
    }


def _n_pictures(cache) -> int:
    from probe.cache.pictures import picture_count

    return picture_count(cache.metadata) or cache.n_texts


def _label(cache, b: int, where: str) -> str:
    names = cache.metadata.get("images") or []
    return where + (names[b] if b < len(names) else f"picture {b}")


def _grid_pictures(ctx, f: _Found, cache, ci: int, stack: str, pos: dict, where: str, multi: bool) -> None:
    """An image model's pictures: what [CLS] (or the first patch) reads layer by layer, the last
    layer's heads, a hover view; the cache's distance-against-depth figure and artifacts."""
    from probe.errors import ProbeError
    from probe.report import image_figures as imf
    from probe.report.sections import _image_hover as hv

    pngs = cache.metadata.get("image_png") or []
    query = "cls" if "class" in pos["kinds"] else pos["grid"]["offset"]
    n = _n_pictures(cache)
    f.left_out += max(0, n - MAX_IMAGES)
    last = cache.pattern_layers(stack)[-1]
    found_art = _artifacts(cache, stack)
    if found_art is not None:
        f.artifacts.append(_artifact_line(found_art, where))
    try:
        fig = imf.distance_depth(_stats(ctx, cache), stack)
    except ProbeError:  # no distance_px (a stats cache: none computed)
        fig = None
    if fig is not None:
        f.depth.append(
            {
                "label": f"cache {ci + 1}" if multi else "",
                "fig": ctx.figure(fig, "distance against depth"),
                "name": f"depth_{ci}",
            }
        )
    for b in range(min(n, MAX_IMAGES)):
        ctx.progress(f"picture {b}")
        picture = imf.picture_of(cache, b)
        label = _label(cache, b, where)
        layers = imf.image_layers(
            cache, query=query, stack=stack, batch=b, picture=picture, artifacts=found_art
        )
        heads = imf.image_heads(cache, last, query=query, stack=stack, batch=b, picture=picture)
        view = hv.patch_view(cache, stack, pos, b, label)
        if view.layers:
            f.views.append(view)
        f.items.append(
            {
                "label": label,
                "layers": ctx.figure(layers, f"{label}: layer by layer"),
                "heads": ctx.figure(heads, f"{label}: the heads of layer {last}"),
                "name": f"picture_{ci}_{b}",
                "view": view if view.layers else None,
                "png": pngs[b] if b < len(pngs) else None,
            }
        )


def _stage_pictures(ctx, f: _Found, cache, ci: int, stack: str, where: str) -> None:
    """A Swin cache's pictures: what each stage's centre patch reads, block by block."""
    from probe.report import image_figures as imf

    n = _n_pictures(cache)
    f.left_out += max(0, n - MAX_IMAGES)
    for b in range(min(n, MAX_IMAGES)):
        ctx.progress(f"stages, picture {b}")
        label = _label(cache, b, where)
        fig = imf.stage_maps(cache, stack=stack, batch=b, picture=imf.picture_of(cache, b))
        f.stages.append(
            {"label": label, "fig": ctx.figure(fig, f"{label}: stage by stage"), "name": f"stages_{ci}_{b}"}
        )


def _text_pictures(f: _Found, cache, stack: str, pos: dict, where: str) -> None:
    """A vision-language model's pictures: the words' hover view of each."""
    from probe.report.sections import _image_hover as hv

    pngs = cache.metadata.get("image_png") or []
    text = hv.text_views(cache, stack, pos, cache.n_texts, cache.metadata.get("images") or [])
    f.left_out += max(0, len(text) - MAX_IMAGES)
    for view in text[:MAX_IMAGES]:
        view.label = where + view.label
        f.views.append(view)
        png = pngs[view.picture] if view.picture < len(pngs) else None
        f.words.append({"label": view.label, "view": view, "png": png, "stack": stack})


def _artifacts(cache, stack: str):
    """:func:`probe.artifacts` of the stack with its default thresholds; None when the cache holds
    no residual stream or no whole patterns (then the section says nothing of artifacts)."""
    from probe.analysis.artifacts import artifacts
    from probe.errors import ProbeError

    if not cache.pattern_layers(stack):
        return None
    try:
        return artifacts(cache, stack=stack)
    except ProbeError:
        return None


def _artifact_line(found, where: str) -> str:
    """One sentence: the artifact patches per layer and picture, or that there are none."""
    rule = (
        f"receiving at least {found.received_min:g}x a uniform share with a residual norm at least "
        f"{found.norm_min:g}x the picture's median"
    )
    if not len(found.found):
        return f"{where}no artifact patches ({rule})."
    per: dict[tuple[int, int], list[str]] = {}
    for r in found.found:
        per.setdefault((r["layer"], r["batch"]), []).append(f"({r['row']}, {r['col']})")
    shown = "; ".join(
        f"layer {layer}, picture {b}: {', '.join(cells)}" for (layer, b), cells in sorted(per.items())
    )
    return f"{where}artifact patches, outlined in cyan ({rule}): {shown}."


def _lut() -> str:
    from probe.report.sections._patterns import colour_lut

    return colour_lut("inferno")  # the figures' colour map


def _layers_note(v) -> str:
    """What of the view's layers the page holds, when not all of them (the budget's choice)."""
    parts = []
    if v.words_left_out:
        parts.append(
            f"the last {len(v.queries)} words' maps (the {v.words_left_out} before them are shown only)"
        )
    if len(v.mean_layers) < len(v.layers):
        parts.append(
            f"the maps of layers {', '.join(map(str, v.mean_layers))} of {len(v.layers)} are embedded "
            "(the page's budget)"
        )
    if v.n_heads > 1 and len(v.head_layers) < len(v.mean_layers):
        which = ", ".join(map(str, sorted(v.head_layers))) if v.head_layers else "no layer"
        parts.append(f"single heads for {which} (the rest: the mean over heads only)")
    return "; ".join(parts)


def _stats(ctx, cache):
    """The head statistics of ``cache``; shared with the heads section when it is the report's
    only cache (that section computes the same, so nothing is computed twice)."""
    from probe.analysis.focus import head_stats

    if len(ctx.caches) == 1 and ctx.results.get("head_stats") is not None:
        return ctx.results["head_stats"]
    stats = head_stats(cache, rollout=False, progress=False)
    if len(ctx.caches) == 1:
        ctx.results["head_stats"] = stats
    return stats
