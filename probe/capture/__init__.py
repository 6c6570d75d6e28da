"""Capture: run a model once and record the attention it computed and its residual stream.

May import torch and :mod:`probe.cache`; nothing downstream (analysis, report) imports it. The
rooms, each importing only the ones below it (``docs/architecture-capture.md`` has the map):

* :mod:`~probe.capture.generation`: ``probe.generate``, a generation captured step by step;
* :mod:`~probe.capture.engine`: ``probe.capture``/``probe.trace`` (the lifecycle, one capture
  per model and thread), the tracer that assembles the hooks, naming what was captured, stepped
  traces, the streamed and ``keep="stats"`` runs;
* :mod:`~probe.capture.consumers`: what is kept of each attention (whole patterns, rows, top-k,
  row blocks handed to a reader), and ``keep=`` parsed;
* :mod:`~probe.capture.inputs`: what the user passes turned into one forward call and its
  metadata, one module per modality (texts, keyword tensors, pictures, sound, transcripts);
* :mod:`~probe.capture.positions`: what each position is (patches, tiles, merged grids, audio
  frames), named after the forward;
* :mod:`~probe.capture.hooks`: what sees the model run (module hooks, the torch-function mode,
  layers and their residual stream, attention events, the store);
* :mod:`~probe.capture.layouts`: attention a family computes in a layout of its own, mapped back;
* :mod:`~probe.capture.calls` (the records every room shares: module calls, attentions, the
  forward's facts, a captured layer) and :mod:`~probe.capture.patterns` (the weights SDPA never
  materialises, recomputed) at the bottom.
"""

from probe.capture.engine.trace import Trace, capture, trace
from probe.capture.patterns import sdpa_weights

__all__ = ["capture", "trace", "Trace", "sdpa_weights"]
