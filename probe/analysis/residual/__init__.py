"""Residual stream and anatomy: what each sublayer writes (``E' = E + ΔE``), what each layer would
predict (logit lens), who wrote the prediction (direct logit attribution), and where the
parameters live (the budget). One idea per module:

* :mod:`.stream`: :func:`residual` -> :class:`ResidualStats` (norms, ratios, cosines per token)
* :mod:`.head`: finding the model's final norm and unembedding from one recorded forward
* :mod:`.lens`: :func:`logit_lens` -> :class:`LogitLens`
* :mod:`.attribution`: direct logit attribution (:class:`Attribution`), computed with the lens
* :mod:`.budget`: :func:`budget` -> :class:`Budget` (parameters by role and layer)
* :mod:`.configs`: configs (and the ``gpt3`` preset) built on the ``meta`` device for the budget
"""

from probe.analysis.residual.attribution import Attribution
from probe.analysis.residual.budget import Budget, budget
from probe.analysis.residual.configs import gpt3_config
from probe.analysis.residual.lens import LogitLens, logit_lens
from probe.analysis.residual.stream import ResidualStats, residual

__all__ = [
    "residual",
    "ResidualStats",
    "logit_lens",
    "LogitLens",
    "Attribution",
    "budget",
    "Budget",
    "gpt3_config",
]
