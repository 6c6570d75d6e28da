"""Analyses that read a cache: what the captured attention and residual stream say.

One folder or module per analysis: ``causal/`` (the causal-mask audit), ``focus/`` (per-head
statistics and roles), ``residual/`` (the residual stream, logit lens, attribution, budget),
``alignment/`` (word alignment and word timestamps from cross-attention), ``compare/`` (two
captures side by side), ``generation/`` (what generated tokens read), ``maps.py`` and
``pointing.py`` (attention on a picture), ``artifacts.py`` (artifact patches),
``interventions.py`` (importance and patching results as data) and ``table.py`` (the ``Table``
the results share). They read :class:`probe.Cache` objects (and, where they must run
the model, go through :mod:`probe.forward` only); they never import :mod:`probe.capture`.
Results share :class:`probe.analysis.table.Table` for exports (dict, JSON, CSV, pandas, HTML).
"""
