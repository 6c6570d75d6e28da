"""The focus statistics of patterns held in a cache: whole patterns, and a rows cache's kept rows.

* :mod:`~.read`: a cache's attentions folded into a ``FocusAccumulator`` layer by layer, a block
  of heads at a time (:func:`~.read.add_patterns`), with each stack's :mod:`~.rollout`;
* :mod:`~.pattern`: the per-query terms of a whole pattern and the metrics of a block of heads
  (:func:`~.pattern.block_metrics`), written as directly as the definitions: the independent
  check of the streamed path in the tests;
* :mod:`~.rows`: the per-row quantities of a pattern, band by band over a causal layer's lower
  triangle (:class:`~.rows.PatternRows`), and :func:`~.rows.is_causal`;
* :mod:`~.kept`: the per-row metrics of a cache that kept selected query rows.
"""
