"""Several whole softmaxes in one call of one module (issue 22, several patterns per layer): LiLT's
self-attention runs a layout-stream and a text-stream softmax over the same summed scores, 4 heads
each; probe stores them as ``self_attn.0`` (layout) and ``self_attn.1`` (text), never as one
pattern of 8 heads, and says which is which in the metadata.

Oracles: softmaxes written here from the query/key projections read by hooks, and HF eager
``output_attentions`` (LiLT's text stream) with the same weights; for the toy, softmaxes written here.
"""

from __future__ import annotations

import math

import catalogue_configs as K
import torch
from torch import nn

import probe


def _inputs(vocab: int, T: int = 8):
    ids = torch.randint(4, min(vocab, 512), (2, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _lilt_oracle(model, x):
    """Per layer, the softmax of LiLT's summed scores written here from hooked projections."""
    seen: dict = {}
    hooks = []
    for i, ly in enumerate(model.encoder.layer):
        s = ly.attention.self
        for name in ("query", "key", "layout_query", "layout_key"):
            hook = lambda m, a, o, i=i, name=name: seen.__setitem__((i, name), o)  # noqa: E731
            hooks.append(getattr(s, name).register_forward_hook(hook))
    try:
        with torch.no_grad():
            eager = model(**x, output_attentions=True).attentions
    finally:
        for h in hooks:
            h.remove()
    H = model.config.num_attention_heads
    r = model.config.channel_shrink_ratio
    d = model.config.hidden_size // H
    bias = (1.0 - x["attention_mask"][:, None, None, :].float()) * torch.finfo(torch.float32).min
    want = []
    for i in range(len(model.encoder.layer)):
        q, k = (seen[(i, n)].unflatten(-1, (H, -1)).transpose(1, 2) for n in ("query", "key"))
        lq, lk = (seen[(i, n)].unflatten(-1, (H, -1)).transpose(1, 2) for n in ("layout_query", "layout_key"))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d) + lq @ lk.transpose(-1, -2) / math.sqrt(d // r)
        want.append((scores + bias).softmax(-1))
    return want, eager


def test_lilt_layout_and_text_softmaxes_are_two_patterns_of_the_models_heads():
    torch.manual_seed(0)
    model = K.build("lilt")
    x = _inputs(model.config.vocab_size)
    with torch.no_grad(), probe.trace(model) as t:
        model(**x)
    cache = t.cache
    want, eager = _lilt_oracle(model, x)
    rows = x["attention_mask"].bool()[:, None, :, None]
    H = model.config.num_attention_heads
    for layer, w in enumerate(want):
        assert cache.attentions("encoder", layer) == [("self", 0), ("self", 1)]
        for index in (0, 1):
            got = cache.pattern("encoder", layer, "self", index=index).float()
            assert got.shape == (2, H, 8, 8)  # the model's heads, not twice as many
            d = (got - w).abs()[rows.expand_as(got)]
            assert float(d.max()) <= 1e-6
        text = cache.pattern("encoder", layer, "self", index=1).float()
        assert float((text - eager[layer]).abs()[rows.expand_as(text)].max()) <= 1e-6
        meta = cache.metadata["layers"][layer]
        assert meta["self_attn.0"]["kind"].startswith("LiLT's layout stream")
        assert meta["self_attn.1"]["kind"].startswith("LiLT's text stream")
        assert (
            meta["self_attn.0"]["module"]
            == meta["self_attn.1"]["module"]
            == f"encoder.layer.{layer}.attention"
        )
        assert "sublayers" not in meta["deltas"]["self_attn"]  # one sublayer, two softmaxes


class TwoSoftmaxes(nn.Module):
    """One module that computes two attentions with different scores, 2 heads each."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.qk1, self.qk2, self.v = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d), nn.Linear(d, d)

    def scores(self, lin, x):
        q, k = lin(x).unflatten(-1, (2, 2, -1)).permute(2, 0, 3, 1, 4)
        return q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))

    def forward(self, x):
        a1 = self.scores(self.qk1, x).softmax(-1)
        a2 = self.scores(self.qk2, x).softmax(-1)
        v = self.v(x).unflatten(-1, (2, -1)).transpose(1, 2)
        return x + ((a1 + a2) @ v).transpose(1, 2).flatten(2)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = TwoSoftmaxes()

    def forward(self, x):
        return self.attn(x)


def test_two_whole_softmaxes_of_one_module_are_stored_in_run_order_against_softmaxes_written_here():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block()).eval()
    x = torch.randn(1, 5, 8)
    cache = probe.capture(model, x)
    h = x
    for layer, block in enumerate(model):
        m = block.attn
        with torch.no_grad():
            want = [m.scores(m.qk1, h).softmax(-1), m.scores(m.qk2, h).softmax(-1)]
            h = block(h)
        assert cache.attentions("encoder", layer) == [("self", 0), ("self", 1)]
        for index in (0, 1):
            got = cache.pattern("encoder", layer, "self", index=index)
            assert got.shape == (1, 2, 5, 5)
            assert float((got - want[index]).abs().max()) <= 1e-6
        kinds = [cache.metadata["layers"][layer][f"self_attn.{i}"]["kind"] for i in (0, 1)]
        assert kinds == [f"softmax {i} of 2 that one call of this module computes" for i in (1, 2)]
