"""The focus statistics while the model runs, a block of query rows at a time, no pattern ever whole.

* :mod:`~.reader`: :class:`~.reader.RowTerms`, one attention's per-query terms, filled block by
  block by the backends of :mod:`probe.analysis.focus.backends` and reduced when it closes;
* :mod:`~.run`: the readers of one forward (:func:`~.run.stats_readers`), the forward
  (:func:`~.run.run_model`) and the readers folded into a ``FocusAccumulator``;
* :mod:`~.keepstats`: ``keep="stats"`` caches, the same statistics stored by a capture and read back;
* :mod:`~.notes`: what this path leaves out (the rollout, the image metrics), and why.
"""
