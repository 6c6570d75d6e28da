"""Find the induction heads of a model.

An induction head, at the second occurrence of a token A in "... A B ... A", attends to the B that
followed A the first time, and so predicts B again (Olsson et al. 2022). This script trains a toy
two-layer attention-only transformer on repeated random sequences (about 10 s on a laptop CPU),
scores every head with ``probe.induction_scores`` and shows where the best head looks.

    python examples/induction_heads.py                 # the toy model
    python examples/induction_heads.py --model minigpt # a zoo model (it has no induction heads)

For your own model: pass it to ``find_induction_heads`` (it needs ``model.config.vocab_size``, a
tokenizer with ``vocab_size``, or ``vocab_size=`` given to ``probe.induction_scores``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import probe


@dataclass
class Config:
    vocab_size: int = 32
    d_model: int = 64
    n_heads: int = 4
    block_size: int = 48  # [BOS] r r with |r| up to 23
    bos_token_id: int = 0


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv, self.out = nn.Linear(cfg.d_model, 3 * cfg.d_model), nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.ln, self.attn = nn.LayerNorm(cfg.d_model), Attention(cfg)

    def forward(self, x):
        return x + self.attn(self.ln(x))


class AttentionOnly(nn.Module):
    """Two attention-only layers: the smallest model in which induction heads form."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg), Block(cfg)])
        self.ln, self.unembed = nn.LayerNorm(cfg.d_model), nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, ids):
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.ln(x))


def repeated(cfg: Config, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, 1 + 2·length] ids: BOS, then `length` random tokens, then the same tokens again."""
    r = torch.randint(1, cfg.vocab_size, (batch, length), generator=generator)
    return torch.cat([torch.full((batch, 1), cfg.bos_token_id), r, r], 1)


def train_toy(steps: int = 300, seed: int = 0) -> AttentionOnly:
    """The toy model, trained to predict the second copy; the copy length varies so that no fixed
    positional offset can solve the task."""
    torch.manual_seed(seed)
    cfg = Config()
    model = AttentionOnly(cfg)
    opt = torch.optim.Adam(model.parameters(), 5e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        length = int(torch.randint(4, 24, (), generator=g))
        ids = repeated(cfg, 32, length, g)
        logits = model(ids)[:, length:-1]  # second copy: predict the token after each one
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), ids[:, length + 1 :].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def find_induction_heads(model: nn.Module, threshold: float = 0.3):
    """Heads whose prefix-matching induction score is at least `threshold`, best first."""
    scores = probe.induction_scores(model, progress=False).to_pandas()
    print(scores[["layer", "head", "induction_prefix", "prev_score"]].round(2).to_string(index=False))
    found = scores[scores.induction_prefix >= threshold].sort_values("induction_prefix", ascending=False)
    return [(int(r.layer), int(r.head)) for r in found.itertuples()]


def show_where_it_looks(model: AttentionOnly, layer: int, head: int) -> None:
    """On one repeated sequence, the key each second-copy query reads most."""
    ids = repeated(model.config, 1, 8, torch.Generator().manual_seed(1))
    pattern = probe.capture(model, ids).pattern("decoder", layer, head=head, batch=0)
    print(f"layer {layer} head {head} on {ids[0].tolist()}:")
    for q in range(10, 17):
        k = int(pattern[q].argmax())
        token, key_token = int(ids[0, q]), int(ids[0, k])
        print(f"  query {q} (token {token}) -> key {k} (token {key_token}), weight {pattern[q, k]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a zoo model name instead of the toy (e.g. minigpt)")
    args = parser.parse_args()
    if args.model:
        import models

        model = models.load(args.model)
    else:
        model = train_toy()
    heads = find_induction_heads(model)
    print(f"induction heads: {heads or 'none'}")
    if heads and not args.model:
        show_where_it_looks(model, *heads[0])


if __name__ == "__main__":
    main()
