"""Causal-mask audit: prove a model never sees the future or the padding, or show where it does.

``probe.check_causal(model_or_cache, inputs=None, *, tokenizer=None, expect=None)`` returns a
:class:`CausalReport`. From a cache alone it runs the static checks (:mod:`.static`); with a
model it captures one forward for those and then runs the functional checks (:mod:`.suite`):
suffix perturbation and input gradient (:mod:`.functional`), padding parity, KV-cache decoding and
backend parity (:mod:`.parity`). What each stack is held to: :mod:`.expect`; future weight a mask
after the softmax hides: :mod:`.after_softmax`. Tolerances: :data:`TOLERANCES` (one table, per
dtype).
"""

from probe.analysis.causal.audit import check_causal
from probe.analysis.causal.report import KINDS, TOLERANCES, CausalReport, Finding

__all__ = ["check_causal", "CausalReport", "Finding", "TOLERANCES", "KINDS"]
