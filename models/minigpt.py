"""A character-level mini GPT (tutorial 001, "从零实现一个迷你 Transformer").

A decoder-only Transformer small enough to read in one sitting and to train on a CPU in seconds:
token + learned position embeddings, `n_layer` pre-norm blocks (`x + attn(ln1(x))`,
`x + ffwd(ln2(x))`), a final LayerNorm and a linear `lm_head`. Multi-head attention is a
`ModuleList` of separate heads, each with its own key/query/value and `tril` mask, each returning
`(out, weights)`: the place to read the attention pattern.

The corpus is three sentences repeated 80 times (8,480 characters, 22 distinct). With
n_embd=64, n_head=4, n_layer=2, block_size=32 the model has 104,598 parameters; AdamW at 3e-3
with seed 7 brings the loss below 0.1 within 200 steps, after which sampling from "at" recites
the corpus.

The vocabulary has no padding character, so `tokenizer.pad_id` is None: every sequence this
model sees is a real window of text, never padded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F
from tqdm.auto import tqdm

from .checkpoint import TrainStats
from .tokenizers import CharTokenizer

NAME = "minigpt"

CORPUS = (
    "graph neural networks pass messages. "
    "attention lets tokens read context. "
    "transformers use self attention. "
) * 80
CHARS = "".join(sorted(set(CORPUS)))  # " .acdefghiklmnoprstuwx"


@dataclass
class Config:
    vocab_size: int = len(CHARS)  # 22
    n_embd: int = 64
    n_head: int = 4
    n_layer: int = 2
    block_size: int = 32  # the longest context, and the length of a training window


def tokenizer() -> CharTokenizer:
    """Characters of the corpus, ids by sorted order: encode("attention") == [2, 18, 18, ...]."""
    return CharTokenizer(NAME, CHARS, pad_id=None)


class CausalSelfAttentionHead(nn.Module):
    """One head: forward(x) -> (out (B, T, head_size), weights (B, T, T))."""

    def __init__(self, n_embd: int, head_size: int, block_size: int):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        k = self.key(x)  # (B, T, hs)
        q = self.query(x)  # (B, T, hs)
        v = self.value(x)  # (B, T, hs)

        scores = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5  # (B, T, T), scaled by 1/sqrt(hs)
        scores = scores.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        weights = F.softmax(scores, dim=-1)
        out = weights @ v  # (B, T, hs)
        return out, weights


class MultiHeadAttention(nn.Module):
    """n_head heads side by side, concatenated, then projected back to n_embd."""

    def __init__(self, n_embd: int, num_heads: int, block_size: int):
        super().__init__()
        assert n_embd % num_heads == 0
        head_size = n_embd // num_heads
        self.heads = nn.ModuleList(
            [CausalSelfAttentionHead(n_embd, head_size, block_size) for _ in range(num_heads)]
        )
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor, return_weights: bool = False):
        """x (B, T, C) -> out (B, T, C); with return_weights also weights (B, n_head, T, T)."""
        outs, weights = zip(*(head(x) for head in self.heads), strict=True)
        out = self.proj(torch.cat(outs, dim=-1))  # (B, T, n_head * hs) -> (B, T, C)
        if return_weights:
            return out, torch.stack(weights, dim=1)
        return out


class FeedForward(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.ReLU(),
            nn.Linear(4 * n_embd, n_embd),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TransformerBlock(nn.Module):
    """Pre-norm: LayerNorm first, then the sublayer, then the residual add."""

    def __init__(self, n_embd: int, num_heads: int, block_size: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = MultiHeadAttention(n_embd, num_heads, block_size)
        self.ln2 = nn.LayerNorm(n_embd)
        self.ffwd = FeedForward(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.ffwd(self.ln2(x))
        return x


class MiniTransformerLanguageModel(nn.Module):
    """forward(idx (B, T), targets (B, T) | None) -> (logits (B, T, vocab), loss | None)."""

    name = NAME
    is_encoder_decoder = False

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.block_size = config.block_size
        self.context_length = config.block_size
        self.tokenizer = tokenizer()
        self.token_embedding_table = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding_table = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.Sequential(
            *[
                TransformerBlock(config.n_embd, config.n_head, config.block_size)
                for _ in range(config.n_layer)
            ]
        )
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.block_size:
            raise ValueError(f"{NAME}: {T} tokens, the context holds at most {self.block_size}")
        token_emb = self.token_embedding_table(idx)  # (B, T, C)
        pos_emb = self.position_embedding_table(torch.arange(T, device=idx.device))  # (T, C)
        x = token_emb + pos_emb
        x = self.blocks(x)
        x = self.ln_f(x)
        logits = self.lm_head(x)  # (B, T, vocab)

        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))
        return logits, loss

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Sample max_new_tokens after idx (B, T); returns (B, T + max_new_tokens)."""
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.block_size :]  # the context is at most block_size long
            logits, _ = self(idx_cond)
            probs = F.softmax(logits[:, -1, :], dim=-1)  # (B, vocab), the next character
            idx_next = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat([idx, idx_next], dim=1)
        return idx

    def generate_text(self, prompt: str, max_new_tokens: int = 160, seed: int = 7) -> str:
        """prompt plus max_new_tokens sampled characters, reproducible through `seed`."""
        idx = torch.tensor([self.tokenizer.encode(prompt)], dtype=torch.long)
        g = torch.Generator().manual_seed(seed)
        return self.tokenizer.decode(self.generate(idx, max_new_tokens, generator=g)[0])


def build(config: Config | None = None) -> MiniTransformerLanguageModel:
    """An untrained model (weights from the global RNG)."""
    return MiniTransformerLanguageModel(config or Config())


def from_config(config: dict) -> MiniTransformerLanguageModel:
    """An untrained model shaped by a checkpoint's config dict (load_state_dict comes next)."""
    return build(Config(**config))


def get_batch(
    data: torch.Tensor, block_size: int, batch_size: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of the corpus: x (batch, block_size) and y, the same windows one later."""
    starts = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=generator)
    x = torch.stack([data[i : i + block_size] for i in starts])
    y = torch.stack([data[i + 1 : i + block_size + 1] for i in starts])
    return x, y


def train(
    config: Config | None = None,
    *,
    steps: int = 200,
    seed: int = 7,
    lr: float = 3e-3,
    batch_size: int = 54,
    log: Callable[[str], None] | None = None,
    log_every: int = 50,
    progress: bool = False,
) -> tuple[MiniTransformerLanguageModel, TrainStats]:
    """The tutorial's recipe: AdamW, `steps` random batches. Returns (model in eval mode, stats).

    Deterministic: seed 7 draws the initial weights, then every batch, from one RNG stream.
    """
    if isinstance(config, dict):
        config = Config(**config)
    config = config or Config()
    tok = tokenizer()
    data = torch.tensor(tok.encode(CORPUS), dtype=torch.long)
    losses = []
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        for step in tqdm(range(1, steps + 1), desc=NAME, disable=not progress):
            xb, yb = get_batch(data, config.block_size, batch_size)
            _, loss = model(xb, yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if log and (step % log_every == 0 or step == 1):
                log(f"step {step:4d} | loss {losses[-1]:.4f}")
    seconds = time.perf_counter() - t0
    recipe = {
        "seed": seed,
        "optimizer": "AdamW",
        "lr": lr,
        "batch_size": batch_size,
        "steps": steps,
    }
    stats = TrainStats(losses[-1] if losses else None, steps, seconds, recipe, losses)
    return model.eval(), stats
