"""The statistics' table and every constant of their definitions, in one place.

:data:`METRICS` is the order of the metric columns (``HeadStats``, ``keep="stats"`` caches and
``FocusAccumulator.to_dict`` all follow it; a new statistic is a new entry here); the constants
below are the numbers the definitions in the docstring of :mod:`probe.analysis.focus` name
(every backend reads them from here, so a compiled loop and the whole-pattern path cannot
disagree on a threshold).
"""

from __future__ import annotations

SPAN_MASS = 0.9  # effective span: keys needed to cover this share of a row's mass
LOCAL_WINDOW = 2  # local mass: keys with |i - j| <= this
BEYOND = (16, 128, 1024)  # beyond_<D>: mass further than D tokens
REACH_MASS = 0.9  # reach90: the distance within which this share of a row's mass lies
# the word-level masses: each query's word + this step (previous, own, next word)
WORD_STEPS = (("word_prev", -1), ("word_self", 0), ("word_next", 1))

METRICS = (
    "entropy",
    "norm_entropy",
    "confidence",
    "first",
    "special",
    "punct",
    "content",
    "span",
    "prev",
    "self",
    "next",
    "local",
    "distance",
    "signed_distance",
    "pos_offset",
    "pos_frac",
    "word_prev",
    "word_self",
    "word_next",
    "prev_score",
    "dup_score",
    "induction_score",
    "dup_prefix",
    "induction_prefix",
    "dup_matches",
    "induction_matches",
    *(f"beyond_{d}" for d in BEYOND),
    "reach90",
    "distance_px",
    "on_class",
    "on_register",
    "on_image",
)
IDX = {m: i for i, m in enumerate(METRICS)}

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

__all__ = [
    "METRICS",
    "IDX",
    "SPAN_MASS",
    "LOCAL_WINDOW",
    "BEYOND",
    "REACH_MASS",
    "WORD_STEPS",
    "SINK_EPSILON",
    "ROLE_RULES",
    "MIN_MATCHES",
]
