"""Analyses of a generation cache: what each generated token read (``probe.lookback``).

:mod:`~probe.analysis.generation.steps` lays a generation on the cached sequence (which row wrote
which token), :mod:`~probe.analysis.generation.rows` reads those rows from whatever the cache kept,
:mod:`~probe.analysis.generation.lookback` computes the lookback ratio, masses and top prompt
tokens, and :mod:`~probe.analysis.generation.result` holds them (:class:`Lookback`).
"""

from probe.analysis.generation.lookback import lookback
from probe.analysis.generation.result import Lookback
from probe.analysis.generation.rows import writer_rows
from probe.analysis.generation.steps import Steps, generation_meta, steps

__all__ = ["Lookback", "Steps", "generation_meta", "lookback", "steps", "writer_rows"]
