"""What is kept of each attention: the pattern consumers, and ``keep=`` parsed.

Each consumer implements the seam of :mod:`probe.capture.hooks.record` (``weights``, ``sdpa``,
``close``):

* :mod:`~.keep`: :class:`~.keep.KeepPatterns`, the default: every pattern whole, stored;
* :mod:`~.rows`: selected query rows (:class:`~.rows.KeepRows`) or the top-k keys of every row
  (:class:`~.rows.KeepTopK`), never a whole SDPA pattern;
* :mod:`~.blocks`: :class:`~.blocks.BlockConsumer`, each attention handed to a reader a block of
  query rows at a time (the statistics of ``probe.head_stats(model, ...)`` and ``keep="stats"``);
* :mod:`~.kept`: ``keep=`` (and ``--keep``) parsed into a :class:`~.kept.Keep`.

A new way of keeping patterns is one new consumer here, chosen by the tracer
(:mod:`probe.capture.engine.tracer`).
"""
