"""Inkling2's block attention residuals (issue 22, several softmaxes per layer): a softmax of
learned queries over the outputs of earlier blocks (weights over depth, not keys) is not stored
and is said so in the layer's metadata; the layer's attention (keys plus a per-token sink logit)
is stored exact, its sink's mass beside it.

Oracles: HF eager ``output_attentions`` with the same weights (the attention over the real keys,
the sink column dropped: the sink's mass is 1 minus the row's sum), and a forward hook counting
the block-residual modules' calls.
"""

from __future__ import annotations

import catalogue_configs as K
import pytest
import torch
from catalogue_check import make_inputs, trace_and_eager


@pytest.mark.parametrize("model_type", ["inkling2_text", "inkling2_loop_text"])
def test_inkling2_depth_softmaxes_are_set_aside_and_attention_is_exact(model_type):
    torch.manual_seed(0)
    model = K.build(model_type)
    x = make_inputs(model)
    depth = []  # every block-residual module call (each runs one softmax over depth)
    hooks = [
        (m, lambda *a: depth.append(1))
        for m in model.modules()
        if type(m).__name__.endswith("BlockAttentionResidual")
    ]
    c, out = trace_and_eager(model, x, hooks)
    want = out.attentions
    assert len(depth) > len(want)  # the depth softmaxes ran, more of them than attention layers
    layers = c.layer_indices(c.stacks[0])
    assert len(layers) == len(want)
    real = x["attention_mask"].bool()
    for layer, w in zip(layers, want, strict=True):
        assert c.attentions(c.stacks[0], layer) == [("self", None)]
        got = c.pattern(c.stacks[0], layer)
        torch.testing.assert_close(got[0], w[0], atol=1e-6, rtol=0)  # row 0 has no padding
        d = (got - w).abs()[real[:, None, :, None].expand_as(got)]
        assert float(d.max()) <= 1e-6
        sink = c[f"{c.stacks[0]}.blocks.{layer}.self_attn.sink"]
        torch.testing.assert_close(sink[0], 1 - w[0].sum(-1), atol=1e-5, rtol=0)
    notes = [m.get("not_attention", "") for m in c.metadata["layers"]]
    assert sum("block attention residuals" in n for n in notes) == len(want)
