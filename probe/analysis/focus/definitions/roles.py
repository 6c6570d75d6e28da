"""Head roles: the rules (metric, threshold, priority) that label a head from its mean metrics."""

from __future__ import annotations

import math

SINK_EPSILON = 0.3  # Gu et al. 2024: a head is a sink head when its first-token mass exceeds this
# Roles, in priority order: a head gets the first role whose rule holds (all holding rules are
# listed in the ``roles`` column). Thresholds apply to the mean over texts.
ROLE_RULES: tuple[tuple[str, str, float], ...] = (
    ("induction", "induction_prefix", 0.4),
    ("duplicate-token", "dup_prefix", 0.4),
    ("previous-token", "prev", 0.5),
    ("next-token", "next", 0.5),
    ("self", "self", 0.5),
    ("broad/uniform", "norm_entropy", 0.9),
    ("sink", "first", SINK_EPSILON),
    ("positional", "pos_frac", 0.9),
    ("local", "local", 0.7),
)
# A template role needs this many matching queries in all (one repeated token is not evidence).
MIN_MATCHES = 5


def roles_of(values: dict[str, float]) -> list[str]:
    """Every role whose rule holds for a row of mean metric values, in priority order."""
    out = []
    for role, metric, threshold in ROLE_RULES:
        if role in ("induction", "duplicate-token"):
            matches = values.get(metric.replace("prefix", "matches"), 0)
            if not matches >= MIN_MATCHES:
                continue
        v = values.get(metric)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        if (v > threshold) if role == "sink" else (v >= threshold):
            out.append(role)
    return out


__all__ = ["ROLE_RULES", "SINK_EPSILON", "MIN_MATCHES", "roles_of"]
