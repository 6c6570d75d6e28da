"""What each focus statistic is: the table, the constants, the conventions and the reduction.

The words are the docstring of :mod:`probe.analysis.focus` (the metric table); the code here is
what every path computing the statistics shares:

* :mod:`~.table`: :data:`~.table.METRICS` (the columns, in order) and every constant of the
  definitions (``SPAN_MASS``, ``LOCAL_WINDOW``, ``BEYOND``, ``REACH_MASS``, ``WORD_STEPS``, the
  role rules);
* :mod:`~.tokens`: what each position of a side of a pattern is (real, special, punctuation, its
  word, its id, its kind in an image stack), from a cache's metadata;
* :mod:`~.layout`: what a layer's pattern has that does not depend on the heads (counted
  queries, key classes, template pairs, word ranges);
* :mod:`~.terms`: the per-query :class:`~.terms.Terms` every path fills, and
  :func:`~.terms.reduce`, which averages them into the metrics;
* :mod:`~.reach`: ``beyond_<D>`` and ``reach90`` as one rule over the mass within a distance;
* :mod:`~.roles`: the head roles from the mean metrics; :mod:`~.running`: the exact streaming
  mean and variance across texts.

A new statistic: its column in :mod:`~.table`, its per-query term in :class:`~.terms.Terms` and
its average in :func:`~.terms.reduce`; then the paths that fill the term (the whole-pattern
path, :mod:`probe.analysis.focus.whole`, and each backend, :mod:`probe.analysis.focus.backends`).
"""
