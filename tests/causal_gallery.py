"""A gallery of tiny decoders with the causal-mask bugs people actually ship, and correct twins.

One ``TinyLM`` (vocabulary 40, d 32, 2 layers, 4 heads, learned positions); ``modes`` picks how
each layer's attention is written (``"ok"`` is the textbook masked softmax). Bugs sit in layer
``BAD_LAYER`` (and head ``BAD_HEAD`` where a bug is per head) so the tests can check that the audit
names the right place. The model takes ``attention_mask``/``position_ids`` (padding) and
``past_key_values``/``use_cache`` (a KV cache, transformers-style) like a Hugging Face decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BAD_LAYER, BAD_HEAD = 1, 2
WINDOW = 4
V, D, H = 40, 32, 4


@dataclass
class Out:
    logits: torch.Tensor
    past_key_values: tuple | None = None


def alibi(n_heads: int, T: int, S: int) -> torch.Tensor:
    """[H, T, S] ALiBi bias (bottom-right aligned): a per-head linear distance penalty, -inf on later keys."""
    slopes = torch.tensor([2.0 ** -(h + 1) for h in range(n_heads)])
    dist = torch.arange(S)[None, :] - (torch.arange(T)[:, None] + S - T)
    return (slopes[:, None, None] * dist.clamp(max=0)).masked_fill(dist > 0, float("-inf"))


class Attention(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, pad=None, past=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        S = k.shape[2]
        new = (k, v)
        m = self.mode
        if m == "kv_is_causal" and pad is None:  # the bug: is_causal=True aligns top-left when S > T
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(y.transpose(1, 2).reshape(B, T, D)), new
        if m == "sdpa_nomask":  # the bug: is_causal forgotten on the fused path
            y = F.scaled_dot_product_attention(q, k, v)
            return self.o(y.transpose(1, 2).reshape(B, T, D)), new
        if m == "alibi":
            bias = alibi(H, T, S).to(q.dtype)
            if pad is not None:
                bias = bias.masked_fill(~pad[:, None, None, :].bool(), torch.finfo(q.dtype).min)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            return self.o(y.transpose(1, 2).reshape(B, T, D)), new
        s = q @ k.transpose(-2, -1) / (D // H) ** 0.5
        qpos = torch.arange(T)[:, None] + (S - T)  # bottom-right: query i sits at S - T + i
        kpos = torch.arange(S)[None, :]
        future = kpos > qpos
        neg = torch.finfo(s.dtype).min
        if pad is not None and m != "ignore_pad":
            if m == "pad_over_queries":  # the bug: [B, 1, T, 1] instead of [B, 1, 1, S]
                s = s.masked_fill(~pad[:, None, -T:, None].bool(), neg)
            else:
                s = s.masked_fill(~pad[:, None, None, :].bool(), neg)
        if m == "fill_1e9":  # additive mask in the model's dtype: -1e9 is -inf in fp16, 0 * -inf NaN
            w = (s + (1 - (~future).to(s.dtype)) * torch.tensor(-1e9, dtype=s.dtype)).softmax(-1)
        elif m in ("after_softmax", "after_softmax_renorm"):
            w = F.softmax(s, dim=-1) * (~future)
            if m == "after_softmax_renorm":
                w = w / w.sum(-1, keepdim=True).clamp_min(1e-30)
        elif m == "triu0":
            w = F.softmax(s.masked_fill(torch.ones(T, S, dtype=torch.bool).triu(0), float("-inf")), -1)
        elif m == "swapped":  # meant masked_fill(triu(1)), wrote tril(-1): the past is hidden
            w = F.softmax(s.masked_fill(torch.ones(T, S, dtype=torch.bool).tril(-1), float("-inf")), -1)
        elif m == "one_head":
            hide = future.expand(H, T, S).clone()
            hide[BAD_HEAD] = False
            w = F.softmax(s.masked_fill(hide, float("-inf")), -1)
        elif m in ("window", "window_wide"):
            reach = WINDOW + (1 if m == "window_wide" else 0)  # the bug: one key more than declared
            w = F.softmax(s.masked_fill(future | (qpos - kpos >= reach), float("-inf")), -1)
        else:  # ok, shift_mlp, ignore_pad, pad_over_queries
            w = F.softmax(s.masked_fill(future, float("-inf")), -1)
        return self.o((w @ v).transpose(1, 2).reshape(B, T, D)), new


class Block(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attention(mode)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x, pad=None, past=None):
        a, new = self.attn(self.ln1(x), pad, past)
        x = x + a
        h = self.ln2(x)
        if self.mode == "shift_mlp":  # meant roll(+1) (read the previous token), wrote roll(-1)
            h = h + torch.roll(h, shifts=-1, dims=1)
        return x + self.mlp(h), new


class TinyLM(nn.Module):
    """A decoder whose layer i attends as ``modes[i]`` says."""

    is_causal = True

    def __init__(self, modes: list[str], seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.name = "tiny-" + "-".join(sorted(set(modes) - {"ok"}) or ["ok"])
        self.emb, self.pos = nn.Embedding(V, D), nn.Embedding(64, D)
        self.blocks = nn.ModuleList([Block(m) for m in modes])
        self.head = nn.Linear(D, V)
        if any(m.startswith("window") for m in modes):
            self.sliding_window = WINDOW
        self.eval()

    def forward(self, ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False):
        n = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        if position_ids is None:
            position_ids = torch.arange(n, n + ids.shape[1]).expand(ids.shape[0], -1)
        x = self.emb(ids) + self.pos(position_ids)
        pasts = []
        for i, b in enumerate(self.blocks):
            x, new = b(x, attention_mask, None if past_key_values is None else past_key_values[i])
            pasts.append(new)
        return Out(self.head(x), tuple(pasts) if use_cache else None)


def broken(mode: str) -> TinyLM:
    """A TinyLM with ``mode`` in layer BAD_LAYER and textbook attention elsewhere."""
    modes = ["window" if mode.startswith("window") else "ok"] * 2
    modes[BAD_LAYER] = mode
    return TinyLM(modes)


def everywhere(mode: str) -> TinyLM:
    """A TinyLM with ``mode`` in every layer."""
    return TinyLM([mode, mode])


IDS = torch.tensor([[3, 14, 15, 9, 2, 6, 5, 35, 8, 9, 7, 9, 3, 23, 8, 4]])  # 16 tokens
