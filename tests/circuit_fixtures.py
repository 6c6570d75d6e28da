"""Tiny models for the circuit tests, and an oracle that assembles every edge by hand.

:class:`Tiny` is a small causal transformer written here: token + position embeddings, ``layers``
layers of multi-head (or grouped-query) attention with separate ``q``/``k``/``v``/``o`` Linear
layers, optionally a pre-norm LayerNorm before the attention and the MLP, optionally an MLP,
optionally a final LayerNorm, and an unembedding. Its ordinary :meth:`Tiny.forward` is what probe
hooks. :meth:`Tiny.edges_forward` is the oracle: the same weights, computed head by head from
explicit slices, where every target's input is assembled as the sum of the node outputs it reads
plus the output biases before it, and any edge ``(node, target)`` can be given another value (the
node's output on the corrupted input, say). Nothing in it comes from probe.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class Tiny(nn.Module):
    """See the module docstring. ``forward(ids [B, T]) -> logits [B, T, vocab]``."""

    def __init__(
        self,
        vocab: int = 11,
        d: int = 16,
        heads: int = 2,
        kv_heads: int | None = None,
        d_head: int = 8,
        layers: int = 2,
        ctx: int = 16,
        norm: bool = False,
        mlp: bool = False,
        bias: bool = True,
        seed: int = 0,
    ):
        super().__init__()
        torch.manual_seed(seed)
        self.H, self.G, self.dh, self.d = heads, kv_heads or heads, d_head, d
        self.use_norm, self.use_mlp = norm, mlp
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(_Layer(self, bias) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d) if norm else None
        self.unembed = nn.Linear(d, vocab, bias=False)
        for p in self.parameters():  # larger than the default init: patterns far from uniform
            nn.init.normal_(p, std=0.3)

    def embed(self, ids):
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1]))

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.unembed(self.ln_f(x) if self.ln_f is not None else x)

    # -- the oracle ------------------------------------------------------------------------------
    def node_names(self):
        names = ["input"]
        for l in range(len(self.blocks)):
            names += [f"L{l}.H{h}" for h in range(self.H)]
            if self.use_mlp:
                names.append(f"L{l}.MLP")
        return names

    def kv_name(self, l, g, r):
        return f"L{l}.KV{g}.{r}" if self.G != self.H else f"L{l}.H{g}.{r}"

    def edges_forward(self, ids, given=None, record=None, embed=None, added=None):
        """Logits with every target's input assembled from the node outputs; ``given[(node,
        target)]`` replaces that edge's value; ``added[(node, target)]`` is added to it;
        ``record``, a dict, receives every node's output; ``embed`` replaces the embedding (the
        input node's output)."""
        given, added = given or {}, added or {}
        outs, const = {"input": self.embed(ids) if embed is None else embed}, 0.0

        def read(target):
            return (
                sum(given.get((u, target), v) + added.get((u, target), 0.0) for u, v in outs.items()) + const
            )

        for l, blk in enumerate(self.blocks):
            b = blk.attn
            new, n1 = {}, (blk.ln1 if self.use_norm else (lambda x: x))
            qs = [_rows(n1(read(f"L{l}.H{h}.q")), b.q, h, self.dh) for h in range(self.H)]
            ks = [_rows(n1(read(self.kv_name(l, g, "k"))), b.k, g, self.dh) for g in range(self.G)]
            vs = [_rows(n1(read(self.kv_name(l, g, "v"))), b.v, g, self.dh) for g in range(self.G)]
            for h in range(self.H):
                g = h * self.G // self.H
                z = _attend(qs[h], ks[g], vs[g])
                W = b.o.weight[:, h * self.dh : (h + 1) * self.dh]  # [d, dh]
                new[f"L{l}.H{h}"] = z @ W.T
            outs.update(new)
            const = const + (b.o.bias if b.o.bias is not None else 0.0)
            if self.use_mlp:
                x = read(f"L{l}.MLP")
                outs[f"L{l}.MLP"] = blk.mlp(blk.ln2(x) if self.use_norm else x)
        if record is not None:
            record.update(outs)
        x = read("logits")
        return self.unembed(self.ln_f(x) if self.ln_f is not None else x)


def _rows(x, lin, h, dh):
    """Head ``h``'s block of ``lin(x)``, from the weight's rows."""
    W = lin.weight[h * dh : (h + 1) * dh]
    b = lin.bias[h * dh : (h + 1) * dh] if lin.bias is not None else 0.0
    return x @ W.T + b


def _attend(q, k, v):
    T = q.shape[1]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    return s.softmax(-1) @ v


class _Attention(nn.Module):
    def __init__(self, m: Tiny, bias: bool):
        super().__init__()
        self.H, self.G, self.dh = m.H, m.G, m.dh
        self.q = nn.Linear(m.d, m.H * m.dh, bias=bias)
        self.k = nn.Linear(m.d, m.G * m.dh, bias=bias)
        self.v = nn.Linear(m.d, m.G * m.dh, bias=bias)
        self.o = nn.Linear(m.H * m.dh, m.d, bias=bias)

    def forward(self, y):
        B, T, _ = y.shape
        q = self.q(y).view(B, T, self.H, self.dh).transpose(1, 2)
        k = self.k(y).view(B, T, self.G, self.dh).transpose(1, 2)
        v = self.v(y).view(B, T, self.G, self.dh).transpose(1, 2)
        rep = self.H // self.G
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(z.transpose(1, 2).reshape(B, T, self.H * self.dh))


class _Layer(nn.Module):
    def __init__(self, m: Tiny, bias: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(m.d) if m.use_norm else None
        self.attn = _Attention(m, bias)
        self.ln2 = nn.LayerNorm(m.d) if m.use_norm and m.use_mlp else None
        self.mlp = (
            nn.Sequential(nn.Linear(m.d, 2 * m.d), nn.GELU(), nn.Linear(2 * m.d, m.d)) if m.use_mlp else None
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x) if self.ln1 is not None else x)
        if self.mlp is not None:
            x = x + self.mlp(self.ln2(x) if self.ln2 is not None else x)
        return x


def ids_pair(B: int = 4, T: int = 8, vocab: int = 11, seed: int = 1):
    """Clean and corrupted id tensors ``[B, T]`` (the corrupted: the first half redrawn)."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, vocab, (B, T), generator=g)
    corrupt = clean.clone()
    corrupt[:, : T // 2] = torch.randint(0, vocab, (B, T // 2), generator=g)
    return clean, corrupt


def logit_diff(logits, answers):
    """The oracle's metric: mean over rows of ``logit[correct] - logit[wrong]`` at the last position."""
    last = logits[:, -1]
    rows = torch.arange(last.shape[0])
    return (last[rows, answers[:, 0]] - last[rows, answers[:, 1]]).mean()
