"""Attention that is not one plain softmax over the keys: sinks, flex_attention, local windows,
several patterns per layer, differential attention. Each against an oracle probe never computes:
the weights Hugging Face's eager attention returns (``output_attentions=True``, same weights) or a
masked softmax written here."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers as tf  # noqa: E402
from torch import nn  # noqa: E402

import probe  # noqa: E402

tf.logging.set_verbosity_error()
TOL = 1e-6


def _ids(batch=2, T=7, vocab=96, pad_left=2):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :pad_left] = 0
    return ids, mask


def _capture(model, **x):
    with torch.no_grad(), probe.trace(model) as t:
        out = model(**x, output_attentions=True)
    return t.cache, out


def _close(got, want, tol=TOL):
    assert got.shape == want.shape
    assert float((got.float() - want.detach().float()).abs().max()) <= tol


# -- attention sinks ----------------------------------------------------------------------------
def _gpt_oss():
    cfg = tf.GptOssConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = tf.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "sinks"):
                m.sinks.normal_(0.0, 2.0)  # sinks that take a visible share
    return model


def test_gpt_oss_sink_pattern_over_real_keys_and_sink_mass_beside_it():
    model = _gpt_oss()
    ids, mask = _ids()
    cache, out = _capture(model, input_ids=ids, attention_mask=mask)
    for i in range(2):
        want = out.attentions[i]  # eager: the softmax over keys + sink, the sink column dropped
        _close(cache[f"decoder.blocks.{i}.self_attn.pattern"], want)
        # the sink's mass: the rest of each row's probability
        sink = cache[f"decoder.blocks.{i}.self_attn.sink"]
        _close(sink, 1 - want.sum(-1))
        assert float(sink.min()) > 1e-3  # the sinks really take mass: the check above means something
        info = cache.metadata["layers"][i]["self_attn"]
        assert "sink" in info["kind"] and info["heads"] == 4
    # the chain and the deltas are unaffected
    assert torch.equal(cache["decoder.blocks.0.resid_post"], cache["decoder.blocks.1.resid_pre"])


class SinkBlock(nn.Module):
    """Softmax over [scores | sink]: the sink logit per head, written out here."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.sink = nn.Parameter(torch.tensor([0.5, -1.0]))

    def scores(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
        T = x.size(1)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        return s, v

    def forward(self, x):
        s, v = self.scores(x)
        col = self.sink.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        w = torch.cat([s, col], -1).softmax(-1)[..., :-1]
        return x + self.out((w @ v).transpose(1, 2).flatten(2))


def test_hand_written_sink_against_a_softmax_written_here():
    torch.manual_seed(1)
    model = nn.Sequential(SinkBlock(), SinkBlock()).eval()
    x = torch.randn(2, 6, 16)
    with torch.no_grad(), probe.trace(model) as t:
        model(x)
    with torch.no_grad():
        s, _ = model[0].scores(x)
        e = s.double().exp()
        z = e.sum(-1, keepdim=True) + model[0].sink.double().exp().view(1, -1, 1, 1)
        sink = model[0].sink.double().exp().view(1, -1, 1) / z[..., 0]
    _close(t.cache["decoder.blocks.0.self_attn.pattern"], (e / z).float())
    _close(t.cache["decoder.blocks.0.self_attn.sink"], sink.float())
