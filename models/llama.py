"""A Llama-shaped decoder for long contexts: rotary positions, so any length runs.

Not a trained zoo entry (it ships no checkpoint and is not in ``models.names()``): a model with
the shape of Llama (Touvron et al. 2023) — RMSNorm before each sublayer, rotary position
embeddings (Su et al. 2021) on queries and keys, grouped-query attention through
``F.scaled_dot_product_attention(is_causal=True)``, a SwiGLU MLP — with seeded random weights,
for what needs a long-context model without a download: the long-context benchmark and examples.
Rotary positions have no table of learnt positions, so any sequence length runs, bounded only
by memory.

    >>> from models.llama import build
    >>> lm = build(n_layers=2, n_heads=4, d_model=64)
    >>> lm(torch.randint(0, 256, (1, 5000))).shape
    torch.Size([1, 5000, 256])

``build()`` defaults to GPT-2-small width: 12 layers, 12 heads, d_model 768, d_ff 2048. The
tokenizer reads bytes (``tokenizer.encode(text)``: one id per UTF-8 byte, vocabulary 256).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .tokenizers import CharTokenizer

VOCAB = 256


def tokenizer() -> CharTokenizer:
    """Latin-1 characters (ids 0..255): every ASCII text tokenizes, one id per character."""
    return CharTokenizer("llama", "".join(chr(i) for i in range(VOCAB)))


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[B, heads, T, hd]`` (positions 0..T-1, halves rotated)."""
    T, hd = x.shape[-2], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    ang = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos().repeat(1, 2).to(x.dtype), ang.sin().repeat(1, 2).to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, d: int, n_heads: int, n_kv_heads: int, base: float) -> None:
        super().__init__()
        self.h, self.kv, self.hd, self.base = n_heads, n_kv_heads, d // n_heads, base
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, n_kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(d, n_kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        q, k = rotate(q, self.base), rotate(k, self.base)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.h)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, d: int, d_ff: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, d_ff, bias=False)
        self.up_proj = nn.Linear(d, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, d: int, n_heads: int, n_kv_heads: int, d_ff: int, base: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(d)
        self.self_attn = Attention(d, n_heads, n_kv_heads, base)
        self.post_attention_layernorm = RMSNorm(d)
        self.mlp = MLP(d, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaShaped(nn.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, 256]``; ``context_length`` is None (any length)."""

    name = "llama"
    is_encoder_decoder = False
    context_length = None

    def __init__(self, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, d_ff: int, base: float):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, d_model)
        self.layers = nn.ModuleList(
            [Layer(d_model, n_heads, n_kv_heads, d_ff, base) for _ in range(n_layers)]
        )
        self.norm = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, VOCAB, bias=False)
        self.tokenizer = tokenizer()
        self.config = {
            "model_type": "llama-shaped",
            "hidden_size": d_model,
            "num_hidden_layers": n_layers,
            "num_attention_heads": n_heads,
            "num_key_value_heads": n_kv_heads,
            "intermediate_size": d_ff,
            "rope_theta": base,
        }

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build(
    *,
    n_layers: int = 12,
    n_heads: int = 12,
    d_model: int = 768,
    n_kv_heads: int | None = None,
    d_ff: int | None = None,
    rope_base: float = 10000.0,
    seed: int = 0,
) -> LlamaShaped:
    """A Llama-shaped model with seeded random weights (normal, std 0.02), in eval mode."""
    if d_model % n_heads or (d_model // n_heads) % 2:
        raise ValueError(f"d_model {d_model} must split into {n_heads} heads of an even size")
    kv = n_kv_heads or n_heads
    if n_heads % kv:
        raise ValueError(f"{n_heads} heads do not split into {kv} key/value heads")
    g = torch.random.fork_rng()
    with g:
        torch.manual_seed(seed)
        model = LlamaShaped(d_model, n_layers, n_heads, kv, d_ff or (8 * d_model) // 3, rope_base)
        for p in model.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)
    return model.eval()


__all__ = ["LlamaShaped", "build", "tokenizer", "rotate", "VOCAB"]
