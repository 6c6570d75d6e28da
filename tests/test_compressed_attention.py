"""DeepSeek-V4's compressed attention (issue 22): one softmax over [T positions | C compressed block
summaries | a sink column], stored as ``pattern`` (the positions), ``compressed`` (the summaries)
and ``sink``; its hyper-connection softmaxes over streams are not stored.

Oracle: HF eager ``output_attentions`` with the same weights, ``[b, h, T, T + C]`` (the sink
column dropped: its mass is 1 minus the row's sum), cut at T here.
"""

from __future__ import annotations

import catalogue_configs as K
import torch
from catalogue_check import make_inputs, trace_and_eager


def test_deepseek_v4_positions_summaries_and_sink_are_stored_apart_exactly():
    torch.manual_seed(0)
    model = K.build("deepseek_v4")
    x = make_inputs(model)
    c, out = trace_and_eager(model, x)
    want = out.attentions
    stack = c.stacks[0]
    T = x["input_ids"].shape[1]
    summaries = []
    for layer, w in enumerate(want):
        key = f"{stack}.blocks.{layer}.self_attn"
        got, comp, sink = c[f"{key}.pattern"], c[f"{key}.compressed"], c[f"{key}.sink"]
        assert got.shape[-2:] == (T, T)
        torch.testing.assert_close(got, w[..., :T], atol=1e-6, rtol=0)
        torch.testing.assert_close(comp, w[..., T:], atol=1e-6, rtol=0)
        torch.testing.assert_close(sink, 1 - w.sum(-1), atol=1e-5, rtol=0)
        total = got.sum(-1) + comp.sum(-1) + sink
        torch.testing.assert_close(total, torch.ones_like(total), atol=1e-5, rtol=0)
        assert "compressed block summaries" in c.metadata["layers"][layer]["self_attn"]["kind"]
        summaries.append(comp.shape[-1])
    assert max(summaries) > 0  # a layer whose softmax really ran over block summaries
    assert float(c[f"{stack}.blocks.1.self_attn.compressed"].sum()) > 1e-3
