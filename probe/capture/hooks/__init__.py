"""What sees the model run: hooks, the torch-function mode, layers, residual stream, attention events.

* :mod:`~.watch`: :class:`~.watch.Watcher`, module hooks keeping the call stack and a
  ``TorchFunctionMode`` routing each torch op (softmax, SDPA, flex_attention to the recorder,
  the rest to the layer's stream), torch's fused modules run with the mode off;
* :mod:`~.layers`: :class:`~.layers.LayerTracker`, which call is a layer (list elements,
  parallel lists grouped by index, :mod:`~.parallel`; attention pooling heads, :mod:`~.pooling`)
  and which of its children are sublayers; :mod:`~.records`: a returned layer closed into its
  record;
* :mod:`~.residual`: a layer's residual stream followed op by op; :mod:`~.deltas`: split into
  ``resid_pre``, verified deltas and ``resid_post``;
* :mod:`~.record`: :class:`~.record.Recorder`, the attention ops (asking
  :mod:`probe.capture.layouts` first); :mod:`~.attentions`: the attention of each sublayer call
  opened, closed, judged self or cross and handed to the pattern consumer (the seam,
  :class:`~.attentions.PatternConsumer`); :mod:`~.streams`: several whole softmaxes of one call;
* :mod:`~.store`: the only part that talks to the sink (``dtype=``, reused buffers).

A new kind of attention event is a recorder handler (routed by the watcher); a new per-attention
fact a field of :class:`probe.capture.calls.Attention` set here.
"""
