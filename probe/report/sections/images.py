"""Attention on the picture: for an image model's cache, what [CLS] reads layer by layer and its
attention rollout, and each head of the last layer, laid over the picture the model saw."""

from __future__ import annotations

TITLE = "Attention on the picture"
ORDER = 22
MAX_IMAGES = 4  # pictures drawn per cache; the rest are left out (the section says so)


def build(ctx) -> dict | None:
    """Per picture (up to :data:`MAX_IMAGES` per cache) two figures; None when no cache holds an
    image grid."""
    from probe.analysis.maps import image_stack
    from probe.errors import ProbeError
    from probe.report import image_figures as imf

    items, left_out, depth = [], 0, []
    for ci, cache in enumerate(ctx.caches):
        try:
            stack, pos = image_stack(cache)
        except ProbeError:
            continue
        if "grid" not in pos or not cache.pattern_layers(stack):
            continue
        query = "cls" if "class" in pos["kinds"] else pos["grid"]["offset"]
        names = cache.metadata.get("images") or []
        n = cache.n_texts
        left_out += max(0, n - MAX_IMAGES)
        last = cache.pattern_layers(stack)[-1]
        stats = _stats(ctx, cache)
        try:
            fig = imf.distance_depth(stats, stack)
        except ProbeError:  # no distance_px (a stats cache: none computed)
            fig = None
        if fig is not None:
            label = f"cache {ci + 1}" if len(ctx.caches) > 1 else ""
            depth.append(
                {"label": label, "fig": ctx.figure(fig, "distance against depth"), "name": f"depth_{ci}"}
            )
        for b in range(min(n, MAX_IMAGES)):
            ctx.progress(f"picture {b + 1}")
            picture = imf.picture_of(cache, b)
            label = (f"cache {ci + 1}, " if len(ctx.caches) > 1 else "") + (
                names[b] if b < len(names) else f"picture {b + 1}"
            )
            layers = imf.image_layers(cache, query=query, stack=stack, batch=b, picture=picture)
            heads = imf.image_heads(cache, last, query=query, stack=stack, batch=b, picture=picture)
            items.append(
                {
                    "label": label,
                    "layers": ctx.figure(layers, f"{label}: layer by layer"),
                    "heads": ctx.figure(heads, f"{label}: the heads of layer {last}"),
                    "name": f"picture_{ci}_{b}",
                }
            )
    if not items:
        return None
    pictures = any(c.metadata.get("image_png") for c in ctx.caches)
    return {"pictures": items, "depth": depth, "left_out": left_out, "has_picture": pictures}


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
