"""Tiny transformers written every way attention gets written, for the capture tests.

Each attention module exposes what an *independent* oracle needs: softmax-based modules keep the
weights they computed (``.weights``); SDPA/MHA-based ones expose their projections so the tests
can recompute a masked softmax by hand (see ``oracle_weights`` in the tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

SOFTMAX_KINDS = ("F.softmax", "torch.softmax", "Tensor.softmax")
SDPA_KINDS = ("sdpa_causal", "sdpa_bool", "sdpa_float", "sdpa_scale", "sdpa_gqa")
ALL_KINDS = SOFTMAX_KINDS + SDPA_KINDS + ("mha",)


def alibi_bias(n_heads: int, T: int, S: int) -> torch.Tensor:
    """A float attention bias [H, T, S]: -inf above the diagonal, a per-head linear distance penalty."""
    slopes = torch.tensor([2.0 ** -(h + 1) for h in range(n_heads)])
    dist = torch.arange(S)[None, :] - torch.arange(T)[:, None]  # key - query
    bias = slopes[:, None, None] * dist.clamp(max=0)
    return bias.masked_fill(dist > 0, float("-inf"))


class Attention(nn.Module):
    """Causal self-attention written as ``kind`` says (see ALL_KINDS)."""

    def __init__(self, d: int, n_heads: int, kind: str, n_kv_heads: int | None = None):
        super().__init__()
        self.kind, self.h = kind, n_heads
        self.kv = n_kv_heads or n_heads
        self.hd = d // n_heads
        if kind == "mha":
            self.mha = nn.MultiheadAttention(d, n_heads, batch_first=True)
            return
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, self.kv * self.hd)
        self.v = nn.Linear(d, self.kv * self.hd)
        self.o = nn.Linear(d, d)
        self.weights: torch.Tensor | None = None

    def qkv(self, x):
        q = rearrange(self.q(x), "b t (h d) -> b h t d", h=self.h)
        k = rearrange(self.k(x), "b t (h d) -> b h t d", h=self.kv)
        v = rearrange(self.v(x), "b t (h d) -> b h t d", h=self.kv)
        return q, k, v

    def forward(self, x):
        B, T, _ = x.shape
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        if self.kind == "mha":
            out, _ = self.mha(x, x, x, attn_mask=~causal, need_weights=False)
            return out
        q, k, v = self.qkv(x)
        if self.kind in SOFTMAX_KINDS:
            scores = q @ k.transpose(-2, -1) / self.hd**0.5
            scores = scores.masked_fill(~causal, float("-inf"))
            if self.kind == "F.softmax":
                w = F.softmax(scores, dim=-1)
            elif self.kind == "torch.softmax":
                w = torch.softmax(scores, -1)
            else:
                w = scores.softmax(dim=-1)
            self.weights = w
            y = w @ v
        elif self.kind == "sdpa_causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.kind == "sdpa_bool":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        elif self.kind == "sdpa_float":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=alibi_bias(self.h, T, T))
        elif self.kind == "sdpa_scale":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
        elif self.kind == "sdpa_gqa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            raise ValueError(self.kind)
        return self.o(rearrange(y, "b h t d -> b t (h d)"))


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm ``x + f(ln(x))`` or post-norm ``ln(x + f(x))`` transformer block."""

    def __init__(self, d: int, n_heads: int, kind: str, post_norm: bool, n_kv_heads=None):
        super().__init__()
        self.post_norm = post_norm
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, n_heads, kind, n_kv_heads)
        self.mlp = MLP(d)

    def forward(self, x):
        if self.post_norm:
            x = self.ln1(x + self.attn(x))
            return self.ln2(x + self.mlp(x))
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ParallelBlock(nn.Module):
    """GPT-J style: ``x + attn(ln(x)) + mlp(ln(x))``, both sublayers reading the same stream."""

    def __init__(self, d: int, n_heads: int, kind: str):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = Attention(d, n_heads, kind)
        self.mlp = MLP(d)

    def forward(self, x):
        h = self.ln(x)
        return self.attn(h) + self.mlp(h) + x


class ToyLM(nn.Module):
    """Decoder-only LM over a 40-token vocabulary; ``post_norm`` is False, True or "parallel"."""

    def __init__(self, kind="sdpa_causal", post_norm=False, n_layers=3, d=32, n_heads=4, n_kv_heads=None):
        super().__init__()
        self.emb = nn.Embedding(40, d)
        self.pos = nn.Embedding(64, d)

        def block():
            if post_norm == "parallel":
                return ParallelBlock(d, n_heads, kind)
            return Block(d, n_heads, kind, post_norm, n_kv_heads)

        self.blocks = nn.ModuleList([block() for _ in range(n_layers)])
        self.head = nn.Linear(d, 40)

    def forward(self, ids):
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class CrossAttention(nn.Module):
    """Queries from the decoder stream, keys and values from the encoder output (SDPA)."""

    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.h = n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, memory, memory_mask):
        q = rearrange(self.q(x), "b t (h d) -> b h t d", h=self.h)
        k = rearrange(self.k(memory), "b s (h d) -> b h s d", h=self.h)
        v = rearrange(self.v(memory), "b s (h d) -> b h s d", h=self.h)
        mask = memory_mask[:, None, None, :]  # [B, 1, 1, S], True = may attend
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(rearrange(y, "b h t d -> b t (h d)"))


class EncoderBlock(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.h = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.mlp = MLP(d)

    def attend(self, x, key_mask):
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.h)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])
        return self.o(rearrange(y, "b h t d -> b t (h d)"))

    def forward(self, x, key_mask):
        x = x + self.attend(self.ln1(x), key_mask)
        return x + self.mlp(self.ln2(x))


class DecoderBlock(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.self_attn = Attention(d, n_heads, "F.softmax")
        self.cross_attn = CrossAttention(d, n_heads)
        self.mlp = MLP(d)

    def forward(self, y, memory, memory_mask):
        y = y + self.self_attn(self.ln1(y))
        y = y + self.cross_attn(self.ln2(y), memory, memory_mask)
        return y + self.mlp(self.ln3(y))


class ToySeq2Seq(nn.Module):
    """Pre-norm encoder-decoder; source id 0 is padding."""

    is_encoder_decoder = True

    def __init__(self, d=32, n_heads=4, n_enc=2, n_dec=3):
        super().__init__()
        self.src_emb, self.tgt_emb = nn.Embedding(30, d), nn.Embedding(30, d)
        self.encoder = nn.ModuleList([EncoderBlock(d, n_heads) for _ in range(n_enc)])
        self.decoder = nn.ModuleList([DecoderBlock(d, n_heads) for _ in range(n_dec)])
        self.head = nn.Linear(d, 30)

    def forward(self, src, tgt):
        key_mask = src != 0
        x = self.src_emb(src)
        for b in self.encoder:
            x = b(x, key_mask)
        y = self.tgt_emb(tgt)
        for b in self.decoder:
            y = b(y, x, key_mask)
        return self.head(y)


class NoAttention(nn.Module):
    """An MLP: nothing for probe to capture."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def streamed_both_ways(lm, ids, folder, monkeypatch, module, switch: str) -> dict[bool, bytes]:
    """The bytes of ``probe.capture(lm, ids, out=...)`` with ``module.<switch>`` True and False."""
    import probe

    files = {}
    for on in (True, False):
        monkeypatch.setattr(module, switch, on)
        path = folder / f"{switch}-{on}.safetensors"
        probe.capture(lm, ids, out=path)
        files[on] = path.read_bytes()
    return files
