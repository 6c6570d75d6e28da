"""Analyses that read a cache: causal-mask audit, per-head focus, residual stream, alignment.

Each analysis is one module here. They read :class:`probe.Cache` objects (and, where they must run
the model, go through :mod:`probe.forward` only); they never import :mod:`probe.capture`.
Results share :class:`probe.analysis.table.Table` for exports (dict, JSON, CSV, pandas, HTML).
"""
