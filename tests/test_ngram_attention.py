"""ProphetNet's n-gram self-attention (issue 22, several patterns per layer): the decoder's main
stream stored as ``self_attn.0`` ``[b, h, T, T]`` and each predict stream ``n`` as ``self_attn.<n>``
``[b, h, T, 2T]`` (its queries over [main stream keys | its own stream's keys]), each said so in
the metadata; the encoder and cross-attention as usual.

Oracle: HF eager ``output_attentions`` with the same weights: ``decoder_attentions`` (the main
stream), ``decoder_ngram_attentions`` ``[b, ngram, h, T, 2T]`` (split per stream here) and the
cross-attention scores eager returns before its softmax (their softmax is the weights).
"""

from __future__ import annotations

import catalogue_configs as K
import torch
from catalogue_check import make_inputs, trace_and_eager


def test_prophetnet_main_and_predict_streams_are_stored_apart_exactly():
    torch.manual_seed(0)
    model = K.build("prophetnet")
    x = make_inputs(model)
    c, want = trace_and_eager(model, x)
    ngram = model.config.ngram
    assert ngram == 2
    pairs = zip(want.decoder_attentions, want.decoder_ngram_attentions, strict=True)
    for layer, (main, streams) in enumerate(pairs):
        assert c.attentions("decoder", layer) == [("self", i) for i in range(1 + ngram)] + [("cross", None)]
        meta = c.metadata["layers"][len(c.layer_indices("encoder")) + layer]
        torch.testing.assert_close(c.pattern("decoder", layer, index=0), main, atol=1e-6, rtol=0)
        assert meta["self_attn.0"]["kind"].startswith("ProphetNet main stream")
        T = main.shape[-1]
        for n in range(ngram):
            got = c.pattern("decoder", layer, index=n + 1)
            assert got.shape[-2:] == (T, 2 * T)
            torch.testing.assert_close(got, streams[:, n], atol=1e-6, rtol=0)
            assert meta[f"self_attn.{n + 1}"]["kind"].startswith(f"ProphetNet predict stream {n + 1} of 2")
        # the streams differ: not one softmax stored three times
        a, b = (c.pattern("decoder", layer, index=i) for i in (1, 2))
        assert float((a - b).abs().max()) > 1e-3
        cross = want.cross_attentions[layer].softmax(-1)
        torch.testing.assert_close(c.pattern("decoder", layer, "cross"), cross, atol=1e-6, rtol=0)
        # one module computed the three: its one output is the delta, no sum of sublayers claimed
        assert "sum of the layer's" not in meta["deltas"]["self_attn"]
