"""Head roles: the rule that labels a head from its mean metrics (the rules themselves, with their
thresholds and priority, are :data:`~probe.analysis.focus.definitions.table.ROLE_RULES`)."""

from __future__ import annotations

import math

from probe.analysis.focus.definitions.table import MIN_MATCHES, ROLE_RULES


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


__all__ = ["roles_of"]
