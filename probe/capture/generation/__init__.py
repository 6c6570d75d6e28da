"""``probe.generate``: a generation captured step by step, as the model wrote.

* :mod:`~.generate`: :func:`~.generate.generate` and :class:`~.generate.Generation` (the
  model's own ``generate`` inside a stepped trace, :mod:`probe.capture.engine.steps`);
* :mod:`~.loop`: the greedy (or sampling) loop of models without a transformers ``generate``;
* :mod:`~.beams`: beam search, the returned beam followed through the steps;
* :mod:`~.pictures`: a vision-language generation's prompt pictures named on their grids
  (through :mod:`probe.capture.positions.pictures`).
"""
