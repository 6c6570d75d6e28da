"""Residual stream, simply: |E| entering and leaving each layer and |ΔE| per sublayer (``probe.plot``)."""

from __future__ import annotations

TITLE = "Residual stream norms"
ORDER = 25
MAX_TEXTS = 4  # figures per cache; the rest are left out (the section says so)


def build(ctx) -> dict | None:
    """One figure per text (up to :data:`MAX_TEXTS` per cache); None when no cache holds residuals."""
    from probe.report import figures

    items, left_out = [], 0
    for ci, cache in enumerate(ctx.caches):
        ends = ("resid_pre", "resid_post", ".delta")
        if not any(k.endswith(ends) or k.endswith(tuple(e + ".norm" for e in ends)) for k in cache.keys()):
            continue
        n = cache.n_texts
        left_out += max(0, n - MAX_TEXTS)
        for b in range(min(n, MAX_TEXTS)):
            ctx.progress(f"residual norms, text {b + 1}")
            label = (f"cache {ci + 1}, " if len(ctx.caches) > 1 else "") + f"text {b + 1}"
            fig = figures.residual_norms(cache, batch=b)
            items.append({"label": label, "fig": ctx.figure(fig, label), "name": f"residual_norms_{ci}_{b}"})
    if not items:
        return None
    return {"figures": items, "left_out": left_out, "multi": len(items) > 1}
