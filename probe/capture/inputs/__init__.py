"""What the user passes, turned into one forward call and its metadata: a router, one module a modality.

* :mod:`~.route`: :func:`~.route.prepare`, each kind of input sent to its modality;
* the modalities: :mod:`~.text` (texts, tokenized and padded; the decoder's text),
  :mod:`~.tensors` (ids or float inputs), :mod:`~.keywords` (a dict of keyword tensors, what
  every other modality becomes), :mod:`~.pictures` (pictures through the processor; a
  vision-language model's processor checked by :mod:`~.vlm`), :mod:`~.sound` (waveforms, sound
  files, an audio model's features), :mod:`~.transcript` (an encoder-decoder's decoder inputs
  for keyword inputs);
* what they read: :mod:`~.images` (pictures opened, processed, shown as the model saw them),
  :mod:`~.audio` (sound read, resampled, extracted; what each frame's time is computed from),
  :mod:`~.spectrogram` (what the model heard, for the report), :mod:`~.tokenizers` (one
  interface over zoo and Hugging Face tokenizers), :mod:`~.processors` (a processor's tokenizer,
  image processor, feature extractor), :mod:`~.decoding` (greedy decoding when no target is
  given);
* what they share: :mod:`~.prepared` (:class:`~.prepared.Prepared`, and what preparing asks of
  the model: name, device, keywords its forward takes) and :mod:`~.checks` (context length,
  vocabulary, keyword tensors a forward would fail on).

A new input modality is one new module here, routed by :mod:`~.route`; its positions, if they
are not tokens, one module in :mod:`probe.capture.positions`.
"""
