"""A fused-QKV masked multi-head decoder (tutorial 003, "解码器的掩码注意力机制").

embedding -> one masked multi-head attention -> Linear(E, vocab). The attention computes q, k and
v with a single fused `qkv = Linear(E, 3E)`, splits them into 8 heads of 8 dims, scales by
1/sqrt(head_dim), hides the future with `torch.triu(ones(T, T), diagonal=1).bool()` filled with
-inf, and returns `(out, attn)` so the weights can be drawn.

The task is the tutorial's: "predict the next value" of random digit sequences (vocab 10,
seq_len 10, 1,000 samples). Because the digits are drawn independently and uniformly, the next
digit cannot be predicted from the previous ones: the best achievable loss is ln(10) ~ 2.303,
and the trained model sits close to it (it can only memorise a little of its 1,000 samples). The
point of the tutorial is the mask and the heatmap, not the accuracy.

There are no position embeddings, so the model accepts sequences of any length:
`context_length` is None (it was trained on length 10). All ten digits are real tokens, so
`tokenizer.pad_id` is None.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from einops import rearrange
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from .checkpoint import TrainStats
from .tokenizers import CharTokenizer

NAME = "fused_decoder"
SEED = 3  # any fixed seed works; 3 after the tutorial's number


@dataclass
class Config:
    vocab_size: int = 10
    emb_size: int = 64
    num_heads: int = 8


def tokenizer() -> CharTokenizer:
    """Each character a digit; its id is its value: encode("314") == [3, 1, 4]."""
    return CharTokenizer(NAME, "0123456789", pad_id=None)


def causal_mask(seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """(seq_len, seq_len) bool, True above the diagonal: the future positions to hide."""
    return torch.triu(torch.ones(seq_len, seq_len, device=device), diagonal=1).bool()


class MaskedMultiHeadAttention(nn.Module):
    """forward(x (B, T, E)) -> (out (B, T, E), attn (B, heads, T, T))."""

    def __init__(self, emb_size: int, num_heads: int):
        super().__init__()
        assert emb_size % num_heads == 0
        self.num_heads = num_heads
        self.head_dim = emb_size // num_heads
        self.qkv = nn.Linear(emb_size, emb_size * 3)
        self.fc_out = nn.Linear(emb_size, emb_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, E = x.shape
        qkv = self.qkv(x)  # (B, T, 3E)
        # the fused projection is [q | k | v] along the last dim; each part holds the heads in turn
        q, k, v = rearrange(qkv, "b t (three h d) -> three b h t d", three=3, h=self.num_heads)

        scores = (q @ k.transpose(-2, -1)) / (self.head_dim**0.5)  # (B, heads, T, T)
        mask = causal_mask(T, device=scores.device)
        scores = scores.masked_fill(mask, float("-inf"))  # (T, T) broadcasts over batch and heads
        attn = torch.softmax(scores, dim=-1)

        out = attn @ v  # (B, heads, T, head_dim)
        out = rearrange(out, "b h t d -> b t (h d)")  # heads side by side again: (B, T, E)
        return self.fc_out(out), attn


class SimpleDecoder(nn.Module):
    """forward(x (B, T) digit ids) -> (logits (B, T, vocab), attn (B, heads, T, T))."""

    name = NAME
    is_encoder_decoder = False
    context_length = None  # no positions: any length works

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer()
        self.embedding = nn.Embedding(config.vocab_size, config.emb_size)
        self.attn = MaskedMultiHeadAttention(config.emb_size, config.num_heads)
        self.fc = nn.Linear(config.emb_size, config.vocab_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embedding(x)  # (B, T, E)
        attn_out, attn_weights = self.attn(x)
        logits = self.fc(attn_out)  # (B, T, vocab)
        return logits, attn_weights

    @torch.no_grad()
    def predict(self, digits: str) -> str:
        """The model's guess for the digit after each prefix of `digits` (same length)."""
        x = torch.tensor([self.tokenizer.encode(digits)], dtype=torch.long)
        logits, _ = self(x)
        return self.tokenizer.decode(logits[0].argmax(dim=-1))


def build(config: Config | None = None) -> SimpleDecoder:
    """An untrained model (weights from the global RNG)."""
    return SimpleDecoder(config or Config())


def from_config(config: dict) -> SimpleDecoder:
    """An untrained model shaped by a checkpoint's config dict (load_state_dict comes next)."""
    return build(Config(**config))


class SeqDataset(Dataset):
    """`size` random digit sequences; sample i is (seq[:-1], seq[1:]), each of length seq_len."""

    def __init__(self, seq_len: int, size: int, generator: torch.Generator | None = None):
        self.data = torch.randint(0, 10, (size, seq_len + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[idx, :-1], self.data[idx, 1:]


def train(
    config: Config | None = None,
    *,
    epochs: int = 20,
    seed: int = SEED,
    lr: float = 1e-3,
    seq_len: int = 10,
    size: int = 1000,
    batch_size: int = 32,
    log: Callable[[str], None] | None = None,
    progress: bool = False,
) -> tuple[SimpleDecoder, TrainStats]:
    """The tutorial's recipe: Adam, shuffled batches, cross-entropy. Returns (model in eval mode,
    stats); stats.final_loss is the mean loss of the last epoch, as the tutorial prints it."""
    if isinstance(config, dict):
        config = Config(**config)
    config = config or Config()
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dataset = SeqDataset(seq_len, size)
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=True)
        model = build(config)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        criterion = nn.CrossEntropyLoss()
        epoch_losses, steps = [], 0
        for epoch in tqdm(range(1, epochs + 1), desc=NAME, disable=not progress):
            total = 0.0
            for seq, target in loader:
                optimizer.zero_grad()
                logits, _ = model(seq)
                loss = criterion(logits.view(-1, config.vocab_size), target.view(-1))
                loss.backward()
                optimizer.step()
                total += loss.item()
                steps += 1
            epoch_losses.append(total / len(loader))
            if log:
                log(f"epoch {epoch:2d} | loss {epoch_losses[-1]:.4f}")
    seconds = time.perf_counter() - t0
    recipe = {
        "seed": seed,
        "optimizer": "Adam",
        "lr": lr,
        "epochs": epochs,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "samples": size,
    }
    final = epoch_losses[-1] if epoch_losses else None
    return model.eval(), TrainStats(final, steps, seconds, recipe, epoch_losses)
