"""Hand-written models for the architecture matrix: shapes real code uses that HF configs do not.

Each keeps what an independent oracle needs (``.weights`` as the module computed them).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

D, H, T, E = 32, 4, 7, 4  # width, heads, tokens, experts (T != E: a router is not a sequence)


class SoftmaxAttention(nn.Module):
    """Causal self-attention with an explicit softmax over ``[b, h, t, t]``; keeps ``.weights``."""

    def __init__(self, d: int = D, h: int = H):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / (d // self.h) ** 0.5
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        self.weights = w = s.softmax(-1)  # computed with the local w: threads may share the module
        return self.o((w @ v).transpose(1, 2).reshape(b, t, d))


class BaddbmmAttention(SoftmaxAttention):
    """Scores by ``torch.baddbmm`` laid out ``[b·h, t, t]``, softmax in float32 (BLOOM/GPT-NeoX style)."""

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.h
        q, k, v = self.qkv(x).view(b, t, 3, self.h, hd).permute(2, 0, 3, 1, 4).reshape(3, b * self.h, t, hd)
        bias = torch.zeros(b * self.h, t, t).masked_fill(
            torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")
        )
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), beta=1.0, alpha=hd**-0.5)
        w = F.softmax(scores, dim=-1, dtype=torch.float32)
        self.weights = w.view(b, self.h, t, t)
        y = torch.bmm(w, v).view(b, self.h, t, hd).transpose(1, 2).reshape(b, t, d)
        return self.o(y)


class SdpaAttention(SoftmaxAttention):
    def heads(self, x):
        b, t, d = x.shape
        return self.qkv(x).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)

    def forward(self, x):
        q, k, v = self.heads(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).flatten(2))


class FlexAttention(SdpaAttention):
    def forward(self, x):
        from torch.nn.attention.flex_attention import flex_attention

        q, k, v = self.heads(x)
        return self.o(flex_attention(q, k, v).transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Top-2 router softmaxed over ``[b, t, n_experts]``, experts combined by einsum, plus a shared
    expert added inside the MLP (the sums a residual tracker must not take for residual adds)."""

    def __init__(self, d: int = D, n: int = E):
        super().__init__()
        self.router = nn.Linear(d, n)
        self.w_in = nn.Parameter(torch.randn(n, d, 2 * d) * d**-0.5)
        self.w_out = nn.Parameter(torch.randn(n, 2 * d, d) * (2 * d) ** -0.5)
        self.shared = MLP(d)

    def forward(self, x):
        probs = torch.softmax(self.router(x), dim=-1)  # [b, t, E]
        top, idx = probs.topk(2, dim=-1)
        gate = torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        h = F.gelu(torch.einsum("btd,edf->btef", x, self.w_in))
        routed = torch.einsum("btef,efd,bte->btd", h, self.w_out, gate)
        return routed + self.shared(x)


class Block(nn.Module):
    """Pre-norm block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, d: int = D):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(d), attn, nn.LayerNorm(d), mlp

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Mixer(nn.Module):
    """A Mamba-like block without attention: gated causal depthwise convolution over time."""

    def __init__(self, d: int = D):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.inp = nn.Linear(d, 2 * d)
        self.conv = nn.Conv1d(d, d, 3, groups=d, padding=2)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        u, g = self.inp(self.norm(x)).chunk(2, dim=-1)
        u = self.conv(u.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return x + self.out(F.silu(u) * torch.sigmoid(g))


class LM(nn.Module):
    """Embedding, a ``ModuleList`` of blocks, a head; ``probs=True`` returns softmaxed outputs."""

    def __init__(self, blocks: list[nn.Module], vocab: int = 50, probs: bool = False, d: int = D):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(d, vocab)
        self.probs = probs

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        return logits.softmax(-1) if self.probs else logits


class Gate(nn.Module):
    """Blocks its forward until ``release`` is set (to hold a capture open in another thread)."""

    def __init__(self):
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def forward(self, x):
        self.entered.set()
        self.release.wait(timeout=60)
        return x


def seeded(build, seed: int = 0):
    torch.manual_seed(seed)
    return build().eval()


def baddbmm_lm():
    return seeded(lambda: LM([Block(BaddbmmAttention(), MLP()) for _ in range(2)]))


def moe_lm():
    return seeded(lambda: LM([Block(SoftmaxAttention(), MoE()) for _ in range(2)]), 1)


def router_lm():
    """MoE blocks and no attention: the router softmax must not be a pattern."""
    return seeded(lambda: LM([nn.Sequential(nn.LayerNorm(D), MoE()) for _ in range(2)]), 2)


def probs_lm():
    """An MLP LM that returns probabilities (a softmax over the vocabulary, no attention)."""
    return seeded(lambda: LM([nn.Sequential(nn.LayerNorm(D), MLP()) for _ in range(2)], probs=True), 3)


def hybrid_lm():
    """Mixer (no attention), attention, mixer, attention: layer indices must stay the model's."""
    blocks = [Mixer(), Block(SoftmaxAttention(), MLP()), Mixer(), Block(SdpaAttention(), MLP())]
    return seeded(lambda: LM(blocks), 4)


def flex_lm():
    """SDPA in layer 0, flex_attention in layer 1."""
    return seeded(lambda: LM([Block(SdpaAttention(), MLP()), Block(FlexAttention(), MLP())]), 5)


def dropout_lm():
    blocks = [Block(nn.Sequential(SoftmaxAttention(), nn.Dropout(0.5)), MLP()) for _ in range(2)]
    return seeded(lambda: LM(blocks), 6)


class Entangled(nn.Module):
    """``x + attn(ln x) * sigmoid(mlp(ln x))``: attention and MLP outputs multiplied, not separable."""

    def __init__(self, d: int = D):
        super().__init__()
        self.ln, self.attn, self.mlp = nn.LayerNorm(d), SoftmaxAttention(d), MLP(d)

    def forward(self, x):
        h = self.ln(x)
        return x + self.attn(h) * torch.sigmoid(self.mlp(h))


def entangled_lm():
    return seeded(lambda: LM([Entangled(), Block(SoftmaxAttention(), MLP())]), 7)


class DeepNormBlock(nn.Module):
    """Post-norm with the stream scaled before each residual add, ``ln(α·x + f(x))`` (DeepNet)."""

    def __init__(self, alpha: float = 2.0, d: int = D):
        super().__init__()
        self.alpha = alpha
        self.attn, self.ln1, self.mlp, self.ln2 = (
            SoftmaxAttention(d),
            nn.LayerNorm(d),
            MLP(d),
            nn.LayerNorm(d),
        )

    def forward(self, x):
        x = self.ln1(self.alpha * x + self.attn(x))
        return self.ln2(self.alpha * x + self.mlp(x))


class ScaledStreamBlock(Block):
    """Pre-norm whose second residual add takes the stream divided by a 0-d tensor constant."""

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x / torch.tensor(0.5) + self.mlp(self.ln2(x))


class InPlaceInputBlock(Block):
    """Pre-norm that doubles its input in place (``x.mul_(2)``) before the first residual add."""

    def forward(self, x):
        x.mul_(2.0)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def inplace_input_lm():
    """One :class:`InPlaceInputBlock`: its input is the embedding's output, nobody else's tensor."""
    return seeded(lambda: LM([InPlaceInputBlock(SoftmaxAttention(), MLP())]), 10)


def deepnorm_lm():
    return seeded(lambda: LM([DeepNormBlock(), DeepNormBlock()]), 8)


def scaled_stream_lm():
    return seeded(lambda: LM([ScaledStreamBlock(SoftmaxAttention(), MLP()) for _ in range(2)]), 9)
