"""One masked self-attention head, line by line (tutorial 000, "手写带掩码的自注意力机制").

The textbook's stage: 4 sentences (B) of 8 tokens (T), each token a 32-dim vector (C), drawn with
`torch.manual_seed(1337); x = torch.randn(B, T, C)`. One head of size 16 projects x to keys,
queries and values, scores every pair with `q @ k^T` (this tutorial does not divide by
sqrt(head_size)), masks the future with a lower-triangular `tril`, softmaxes, and mixes values.

Nothing is trained: the weights are the ones PyTorch draws right after that x, with seed 1337,
so they match the tutorial's numbers. The input is a float tensor, not text; `example_input()`
returns the tutorial's x.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from .checkpoint import TrainStats
from .tokenizers import TensorInput

NAME = "single_head"


@dataclass
class Config:
    n_embd: int = 32  # C, channels per token
    head_size: int = 16
    block_size: int = 8  # T, the longest sequence the mask covers
    batch_size: int = 4  # B, only used to replay the tutorial's x before the weights are drawn
    seed: int = 1337


class Head(nn.Module):
    """One head of masked self-attention: forward(x) -> (out, wei)."""

    name = NAME
    is_encoder_decoder = False

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.context_length = config.block_size
        self.key = nn.Linear(config.n_embd, config.head_size, bias=False)
        self.query = nn.Linear(config.n_embd, config.head_size, bias=False)
        self.value = nn.Linear(config.n_embd, config.head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(config.block_size, config.block_size)))
        self.tokenizer = TensorInput(
            NAME,
            shape=f"(B, T, {config.n_embd}) with T <= {config.block_size}",
            hint="use models.single_head.example_input() for the tutorial's (4, 8, 32) x",
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C) -> out (B, T, head_size), wei (B, T, T) with zeros above the diagonal."""
        B, T, C = x.shape
        if T > self.context_length:
            raise ValueError(f"{NAME}: sequence of {T} positions, the mask covers {self.context_length}")
        k = self.key(x)  # (B, T, 16)
        q = self.query(x)  # (B, T, 16)
        v = self.value(x)  # (B, T, 16), what each token hands over when it is read

        wei = q @ k.transpose(-2, -1)  # (B, T, 16) @ (B, 16, T) -> (B, T, T)
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))  # row i sees columns 0..i
        wei = F.softmax(wei, dim=-1)

        out = wei @ v  # (B, T, T) @ (B, T, 16) -> (B, T, 16)
        return out, wei


def example_input(config: Config | None = None) -> torch.Tensor:
    """The tutorial's x: torch.randn(4, 8, 32) right after seed 1337. Shape (B, T, C)."""
    config = config or Config()
    g = torch.Generator().manual_seed(config.seed)  # same stream as torch.manual_seed(1337)
    return torch.randn(config.batch_size, config.block_size, config.n_embd, generator=g)


def build(config: Config | None = None) -> Head:
    """The head with the tutorial's weights (seeded; no training)."""
    config = config or Config()
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
        torch.manual_seed(config.seed)
        torch.randn(config.batch_size, config.block_size, config.n_embd)  # the tutorial draws x first
        return Head(config)


def train(config: Config | None = None, log=None, progress: bool = False) -> tuple[Head, TrainStats]:
    """The "recipe" of a model that is not trained: the seeded init. Returns (model, stats)."""
    config = config or Config()
    t0 = time.perf_counter()
    model = build(config)
    if log:
        log(f"{NAME}: no training; weights are the seeded init (seed {config.seed})")
    recipe = {"seed": config.seed, "training": "none (deterministic init)"}
    return model, TrainStats(final_loss=None, steps=0, seconds=time.perf_counter() - t0, recipe=recipe)


def from_config(config: dict) -> Head:
    """An untrained model shaped by a checkpoint's config dict (load_state_dict comes next)."""
    return Head(Config(**config))
