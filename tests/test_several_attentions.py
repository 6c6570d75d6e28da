"""Several attentions in one layer, and softmaxes in a layer that are not attention (issue 22,
item 3): LongCat-Flash's two attention sublayers stored as ``self_attn.0`` / ``self_attn.1`` with
their modules in the metadata; the hyper-connection softmaxes of GLM-5-Next (weights over the
layer's parallel streams, ``[batch, T, n, n]``) never stored, and said so.

Oracles: HF eager ``output_attentions`` with the same weights (it returns both of LongCat-Flash's
attentions, in run order), and softmaxes written here for the toys.
"""

from __future__ import annotations

import math

import catalogue_configs as K
import pytest
import torch
from catalogue_check import eager_twin, trace_and_eager
from torch import nn

import probe
from probe.errors import ProbeError


def _inputs(vocab: int, T: int = 8):
    ids = torch.randint(4, min(vocab, 512), (2, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _real_rows(got, want, mask):
    """max |got - want| over the real query rows."""
    rows = mask.bool()[:, None, :, None].expand_as(got)
    return float((got - want).abs()[rows].max())


def test_longcat_flash_two_attention_sublayers_are_numbered_with_their_modules():
    torch.manual_seed(0)
    model = K.build("longcat_flash")
    x = _inputs(model.config.vocab_size)
    outs = []  # each attention sublayer's output, read by a hook
    hooks = [(a, lambda m, i, o: outs.append(o[0])) for ly in model.layers for a in ly.self_attn]
    c, out = trace_and_eager(model, x, hooks)
    want = out.attentions
    assert len(want) == 4  # two layers, two attention sublayers each, in run order
    for layer in range(2):
        assert c.attentions("decoder", layer) == [("self", 0), ("self", 1)]
        meta = c.metadata["layers"][layer]
        for i in range(2):
            got = c[f"decoder.blocks.{layer}.self_attn.{i}.pattern"]
            assert _real_rows(got, want[2 * layer + i], x["attention_mask"]) <= 1e-5
            assert meta[f"self_attn.{i}"]["module"] == f"layers.{layer}.self_attn.{i}"
        # one self_attn delta per layer: the sum of both sublayers' outputs, and said so
        delta = c[f"decoder.blocks.{layer}.self_attn.delta"]
        torch.testing.assert_close(delta, outs[2 * layer] + outs[2 * layer + 1], atol=1e-6, rtol=0)
        assert "sum of the layer's 2 self-attention sublayers" in meta["deltas"]["self_attn"]
        # the two are different attentions, not one stored twice
        a, b = (c.pattern("decoder", layer, index=i) for i in range(2))
        assert float((a - b).abs().max()) > 1e-3


@pytest.mark.parametrize("model_type", ["glm5_next_text", "glm5_next"])
def test_glm5_next_stream_mixing_softmaxes_are_not_stored_and_said_so(model_type):
    torch.manual_seed(0)
    model = K.build(model_type)
    x = _inputs(model.config.get_text_config().vocab_size)
    with torch.no_grad(), probe.trace(model) as t:
        model(**x)
        want = eager_twin(model)(**x, output_attentions=True).attentions
    c = t.cache
    stack = c.stacks[0]
    layers = [i for i in c.layer_indices(stack) if c.attentions(stack, i)]
    # layer 0 is linear attention (no softmax over keys), layer 1 one SDPA attention: the one
    # pattern eager returns; the four [batch, T, n, n] mixing softmaxes are not patterns
    assert len(layers) == len(want) == 1
    got = c.pattern(stack, layers[0])
    assert _real_rows(got, want[0], x["attention_mask"]) <= 1e-5
    notes = [m.get("not_attention", "") for m in c.metadata["layers"]]
    assert all("parallel streams (hyper-connections)" in n for n in notes), notes


class TwoAttentions(nn.Module):
    """A block with two attention sublayers, each its own module."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.attn = nn.ModuleList([Attn(d), Attn(d)])

    def forward(self, x):
        x = x + self.attn[0](x)
        return x + self.attn[1](x)


class Attn(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        w = (q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))).softmax(-1)
        return self.out(w @ v)


def test_two_attention_modules_in_a_block_against_softmaxes_written_here():
    torch.manual_seed(0)
    model = nn.Sequential(TwoAttentions(), TwoAttentions()).eval()
    x = torch.randn(2, 5, 8)
    cache = probe.capture(model, x)
    h = x
    for layer, block in enumerate(model):
        for i, attn in enumerate(block.attn):
            q, k, _ = attn.qkv(h).chunk(3, -1)
            want = (q @ k.transpose(-1, -2) / math.sqrt(8)).softmax(-1)
            torch.testing.assert_close(
                cache.pattern("encoder", layer, index=i)[:, 0], want, atol=1e-6, rtol=0
            )
            assert cache.metadata["layers"][layer][f"self_attn.{i}"]["module"] == f"{layer}.attn.{i}"
            h = h + attn(h)


class Mixed(nn.Module):
    """A hyper-connected block: ``n`` parallel streams ``[batch, T, n, d]``, mixed by a softmax over
    the streams, then one attention over the keys on their mean."""

    def __init__(self, n: int = 3, d: int = 8) -> None:
        super().__init__()
        self.mix, self.attn = nn.Linear(d, n), Attn(d)

    def forward(self, s):
        comb = self.mix(s).softmax(-1)  # [batch, T, n, n]: weights over streams
        s = comb @ s
        return s + self.attn(s.mean(2)).unsqueeze(2)


def test_a_softmax_over_parallel_streams_is_not_attention():
    torch.manual_seed(0)
    model = nn.Sequential(Mixed(), Mixed()).eval()
    s = torch.randn(2, 5, 3, 8)
    cache = probe.capture(model, s)
    h = s
    for layer, block in enumerate(model):
        assert cache.attentions("encoder", layer) == [("self", None)]
        m = block.mix(h).softmax(-1) @ h
        q, k, _ = block.attn.qkv(m.mean(2)).chunk(3, -1)
        want = (q @ k.transpose(-1, -2) / math.sqrt(8)).softmax(-1)
        torch.testing.assert_close(cache.pattern("encoder", layer)[:, 0], want, atol=1e-6, rtol=0)
        assert "3 parallel streams" in cache.metadata["layers"][layer]["not_attention"]
        h = block(h)


def test_stream_mixing_that_cannot_be_told_from_attention_by_shape_is_refused():
    # as many streams as positions: [batch, T, n, n] could be [batch, heads, q, k]
    torch.manual_seed(0)
    model = nn.Sequential(Mixed(n=5), Mixed(n=5)).eval()
    with pytest.raises(ProbeError, match="does not recognise"):
        probe.capture(model, torch.randn(2, 5, 5, 8))
