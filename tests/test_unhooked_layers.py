"""List elements whose ``forward`` the model calls directly (``layer.forward(x)``), so that no
module hook sees them: each is still one layer, started by its first child's call (issue 22,
SqueezeBERT was refused as one layer with two patterns).

Oracles: the attention probabilities SqueezeBERT's own ``softmax`` modules return (forward hooks)
and the softmax of the scores eager ``output_attentions`` returns (SqueezeBERT returns its scores
before the softmax); eager ``output_hidden_states`` for the residual stream; for a toy, a softmax
written here.
"""

from __future__ import annotations

import math

import torch
import transformers as tf
from torch import nn

import probe


def squeezebert():
    cfg = tf.SqueezeBertConfig(
        vocab_size=96, hidden_size=32, embedding_size=32, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=64, q_groups=2, k_groups=2, v_groups=2, output_groups=2, intermediate_groups=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.SqueezeBertModel(cfg).eval()


def test_squeezebert_layers_are_its_list_elements_exact_against_its_softmax_modules():
    model = squeezebert()
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    probs = []
    hooks = [
        layer.attention.softmax.register_forward_hook(lambda m, a, o: probs.append(o))
        for layer in model.encoder.layers
    ]
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad(), probe.trace(model) as t:
        model(input_ids=ids, attention_mask=mask)
    c = t.cache
    assert c.layer_indices("encoder") == [0, 1, 2]
    for i in range(3):
        got = c.pattern("encoder", i)
        assert got.shape == (2, 4, 7, 7)
        torch.testing.assert_close(got, probs[i], atol=1e-6, rtol=0)
        torch.testing.assert_close(got, out.attentions[i].softmax(-1), atol=1e-6, rtol=0)
        meta = c.metadata["layers"][i]
        assert meta["module"] == f"encoder.layers.{i}"
        if i == 2:
            # the last element's output is never handed to a next element: not known, and said so
            assert f"encoder.blocks.{i}.resid_post" not in c.keys()
            assert "next element's input" in meta["residual_note"]
            continue
        # the stream as the model hands it on, [batch, pos, d_model] (the model keeps it transposed)
        pre, post = c[f"encoder.blocks.{i}.resid_pre"], c[f"encoder.blocks.{i}.resid_post"]
        torch.testing.assert_close(pre, out.hidden_states[i], atol=1e-6, rtol=0)
        torch.testing.assert_close(post, out.hidden_states[i + 1], atol=1e-6, rtol=0)
        assert "d_model, pos" in meta["residual_layout"]
    assert c.metadata["stacks"]["encoder"]["chain"] is True
    assert "prompt_slots" not in c.metadata  # only CpmAnt runs prompt slots ahead of the tokens


class Attn(nn.Module):
    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        w = (q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))).softmax(-1)
        return self.out((w @ v).transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = Attn(), nn.Linear(8, 8)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class Direct(nn.Module):
    """Runs its blocks with ``block.forward(x)``: no hook fires for the blocks themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for b in self.blocks:
            x = b.forward(x)
        return x


def test_blocks_run_by_their_forward_are_layers_with_their_own_patterns_and_deltas():
    torch.manual_seed(0)
    model = Direct().eval()
    x = torch.randn(2, 5, 8)
    cache = probe.capture(model, x)
    h = x
    for i, blk in enumerate(model.blocks):
        q, k, _ = blk.attn.qkv(h).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        want = (q @ k.transpose(-1, -2) / 2.0).softmax(-1)  # head size 4
        torch.testing.assert_close(cache.pattern("encoder", i), want, atol=1e-6, rtol=0)
        a = blk.attn(h)
        if i == 1:
            # the last block's output is never handed to a next block: no residuals, and said so
            assert "encoder.blocks.1.resid_pre" not in cache.keys()
            assert "next element's input" in cache.metadata["layers"][1]["residual_note"]
            break
        torch.testing.assert_close(cache[f"encoder.blocks.{i}.resid_pre"], h, atol=1e-6, rtol=0)
        torch.testing.assert_close(cache[f"encoder.blocks.{i}.self_attn.delta"], a, atol=1e-6, rtol=0)
        h = h + a
        torch.testing.assert_close(cache[f"encoder.blocks.{i}.mlp.delta"], blk.mlp(h), atol=1e-6, rtol=0)
        h = h + blk.mlp(h)
        torch.testing.assert_close(cache[f"encoder.blocks.{i}.resid_post"], h, atol=1e-6, rtol=0)
