"""Audit my model's mask: does any position read a later token?

A small decoder written the way people write them, with two bugs people actually ship behind
switches: one head of layer 1 that forgets the causal mask, and a token shift before the MLP in
the wrong direction (``roll(-1)``: each position sees the next token, outside attention, where no
attention pattern shows it). ``probe.check_causal`` proves the fixed model causal and names the
kind, layer, head and positions of each bug.

    python examples/audit_mask.py

For your own model: ``probe.check_causal(model, ids, expect="causal")`` (ids: [batch, T] token
ids, or texts with ``tokenizer=``); ``probe check --hf FOLDER "some text"`` on the command line.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import probe

VOCAB, D, HEADS = 40, 32, 4


class Attention(nn.Module):
    def __init__(self, unmasked_head: int | None = None):
        super().__init__()
        self.unmasked_head = unmasked_head
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / (D // HEADS) ** 0.5
        hide = torch.ones(T, T, dtype=torch.bool).triu(1).expand(HEADS, T, T).clone()
        if self.unmasked_head is not None:
            hide[self.unmasked_head] = False  # bug 1: this head was left out of the mask
        weights = F.softmax(scores.masked_fill(hide, float("-inf")), dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, unmasked_head: int | None = None, shift_bug: bool = False):
        super().__init__()
        self.shift_bug = shift_bug
        self.ln1, self.attn = nn.LayerNorm(D), Attention(unmasked_head)
        self.ln2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        if self.shift_bug:  # bug 2: meant roll(+1) (mix in the previous token), wrote roll(-1)
            h = h + torch.roll(h, shifts=-1, dims=1)
        return x + self.mlp(h)


class TinyDecoder(nn.Module):
    def __init__(self, unmasked_head: int | None = None, shift_bug: bool = False, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(64, D)
        self.blocks = nn.ModuleList([Block(), Block(unmasked_head, shift_bug)])  # the bugs sit in layer 1
        self.unembed = nn.Linear(D, VOCAB)
        self.eval()

    def forward(self, ids):
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.unembed(x)


def main() -> None:
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    for name, model in [
        ("fixed", TinyDecoder()),
        ("head 2 of layer 1 unmasked", TinyDecoder(unmasked_head=2)),
        ("token shift the wrong way", TinyDecoder(shift_bug=True)),
    ]:
        # expect="causal": this is a decoder. Without it, a model whose heads see ahead could be
        # an encoder by design, and probe would hold it to bidirectional attention instead.
        report = probe.check_causal(model, ids, expect="causal")
        print(f"== {name}: {'causal' if report.ok else 'LEAK'}")
        print(report)
        print()


if __name__ == "__main__":
    main()
