"""What the statistics computed while a model runs leave out, and why (``HeadStats.not_computed``)."""

from __future__ import annotations

from typing import Any

ROLLOUT_NOTE = (
    "attention rollout multiplies every layer's whole T x T pattern; head_stats(model, ...) never "
    "holds one: capture the model (probe.capture) and pass the cache to compute it"
)
PIXELS_NOTE = (
    "{} needs what each position is (the image grid), which is named after the forward: capture "
    "the patterns (probe.capture) and pass the cache to compute it"
)
IMAGE_METRICS = ("distance_px", "on_class", "on_register", "on_image")


def streamed_not_computed(meta: dict[str, Any], rollout: str = ROLLOUT_NOTE) -> dict[str, str]:
    """What statistics computed while the model runs leave out, with the reason."""
    out = {"rollout": rollout}
    if any(isinstance(s, dict) and s.get("positions") for s in (meta.get("stacks") or {}).values()):
        out.update({m: PIXELS_NOTE.format(m) for m in IMAGE_METRICS})
    return out


__all__ = ["streamed_not_computed", "ROLLOUT_NOTE", "PIXELS_NOTE", "IMAGE_METRICS"]
