"""The capture's lifecycle: ``probe.capture``/``probe.trace``, the tracer, naming, stepped and streamed runs.

* :mod:`~.trace`: :class:`~.trace.Trace`, :func:`~.trace.trace`, :func:`~.trace.capture`
  (arguments checked, the sink opened, the forward traced, the cache written or aborted);
  :mod:`~.claims`: one capture per model and thread; :mod:`~.planned` (and :mod:`~.plans`): repeated
  captures of one model on one kind of input run with a plan learnt and checked by the first two;
* :mod:`~.tracer`: :class:`~.tracer.Tracer`, one capture's parts (:mod:`probe.capture.hooks`
  and a consumer) assembled;
* :mod:`~.naming`: what a traced forward must pass, and its stacks, cache keys and metadata (each
  stack's positions from :mod:`probe.capture.positions`);
* :mod:`~.steps`: ``probe.trace(model, steps=True)``, every forward a step of one sequence;
  :mod:`~.assemble`: the steps placed in one cache;
* :mod:`~.streamed`: one forward read a row block at a time, nothing kept whole
  (``stream_attention``); :mod:`~.stats`: ``keep="stats"``, residuals kept as their norms.
"""
