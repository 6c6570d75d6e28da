"""Attention views: the layers x heads overview grid and the head explorer (self-attention)."""

from __future__ import annotations

from probe.report.sections._patterns import FULL_BUDGET, colour_lut, pack, pattern_sets

TITLE = "Attention"
ORDER = 20
KINDS = ("self",)


def build(ctx, kinds: tuple[str, ...] = KINDS, key: str = "attention") -> dict | None:
    """The packed patterns of every ``kinds`` pattern set, for report.js's overview and explorer."""
    sets = pattern_sets(ctx.caches, kinds)
    if not sets:
        return None
    packed, enc = pack(sets, progress=ctx.progress)
    n_down = sum(s.n_heads for s in sets) - sum(p["nFull"] for p in packed)
    return {
        "id": key,
        "data": {"sets": packed, "scale": enc["scale"], "bytes": enc["bytes"], "lut": colour_lut()},
        "scale": enc["scale"],
        "downsampled": n_down,
        "budget": FULL_BUDGET,
        "rectangular": any(p["nq"] != p["nk"] for p in packed),
    }
