"""A small encoder-decoder trained on a parallel corpus with known word alignments.

The translator's textbook architecture (models/translator.py: post-norm sublayers, sinusoid
positions with an all-zero pad row, -1e9 masking, Conv1d FFN), shrunk to d_model 64, 4 heads and
3 + 3 layers (268,544 parameters), and trained on the German-like -> English-like pairs of
`models.aligner_data` (verb-second and verb-final word order, compounds, merged words, dropped and
inserted articles), whose gold word alignments are known by construction.

    source   das kind ging nach hause          (compounds arrive as pieces: hunde ##haus)
    decoder  S the child went home
    target   the child went home E

Tokens: the source side cuts every compound into WordPiece-style pieces (`blumengarten` ->
`blumen ##garten`), so word alignments need subword merging; `P` pads (id 0) on both sides, `S`
starts and `E` ends the target, exactly like the translator.

Training (`python -m models.train aligner`, 500 steps, a few minutes on 2 CPU cores): Adam with
warm-up, batches of 64 pairs, cross-entropy on the next target word only. The shipped model is
trained WITHOUT any alignment supervision: its attention learns to align from translation alone
(`benchmarks/alignment.py` scores every layer and head against the gold links). `train(...,
align_weight=1.0)` adds a Garg et al. (2019)-style supervised alignment loss on one head (decoder
layer 1, head 0: its cross-attention row where target word j is the decoder input is pulled, by
cross-entropy, towards j's gold sure links spread over their source pieces); it is not used for
the shipped checkpoint. The checkpoint (~1.1 MB) ships in models/checkpoints/aligner.safetensors.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from . import aligner_data
from . import translator as textbook
from .checkpoint import TrainStats
from .tokenizers import WordTokenizer

NAME = "aligner"
PAD = textbook.PAD  # "P" (id 0) on both sides, as in the translator
SUPERVISED = (1, 0)  # (decoder layer, head) whose cross-attention learns from gold links


def _vocabs() -> tuple[dict[str, int], dict[str, int]]:
    src, tgt = aligner_data.vocabularies()
    src_vocab = {"P": 0} | {w: i + 1 for i, w in enumerate(src)}
    tgt_vocab = {"P": 0, "S": 1, "E": 2} | {w: i + 3 for i, w in enumerate(tgt)}
    return src_vocab, tgt_vocab


@dataclass
class Config:
    src_vocab: dict[str, int] = field(default_factory=lambda: _vocabs()[0])
    tgt_vocab: dict[str, int] = field(default_factory=lambda: _vocabs()[1])
    d_model: int = 64
    d_ff: int = 128
    d_k: int = 16
    d_v: int = 16
    n_layers: int = 3
    n_heads: int = 4
    max_len: int = 24


class PieceTokenizer(WordTokenizer):
    """Whitespace words, with every known compound cut into pieces: `hundehaus` -> `hunde ##haus`."""

    def __init__(self, name: str, vocab: dict[str, int], pad_id: int = PAD):
        super().__init__(name, vocab, pad_id=pad_id)
        self.compounds = aligner_data.compounds()

    def _split(self, text: str) -> list[str]:
        out = []
        for w in text.split():
            if w in self.compounds:
                head, tail = self.compounds[w]
                out += [head, "##" + tail]
            else:
                out.append(w)
        return out

    def decode(self, ids) -> str:
        return super().decode(ids).replace(" ##", "")


class AlignerTokenizer(PieceTokenizer):
    """Source-side pieces (`encode("das hundehaus ist alt")`); `.target` numbers the English side."""

    def __init__(self, src_vocab: dict[str, int], tgt_vocab: dict[str, int]):
        super().__init__(NAME, src_vocab)
        self.target = WordTokenizer(f"{NAME} target", tgt_vocab, pad_id=PAD)
        self.bos_id = tgt_vocab["S"]
        self.eos_id = tgt_vocab["E"]


class Transformer(textbook.Transformer):
    """The translator's encoder-decoder at aligner size; forward(enc (B, S), dec (B, T)) ->
    (logits (B, T, tgt_vocab), enc_self_attns, dec_self_attns, dec_enc_attns)."""

    name = NAME

    def __init__(self, config: Config):
        nn.Module.__init__(self)
        self.config = config
        self.context_length = config.max_len
        self.tokenizer = AlignerTokenizer(config.src_vocab, config.tgt_vocab)
        self.encoder = textbook.Encoder(config)
        self.decoder = textbook.Decoder(config)
        self.projection = nn.Linear(config.d_model, len(config.tgt_vocab), bias=False)


def build(config: Config | None = None) -> Transformer:
    """An untrained model (weights from the global RNG)."""
    return Transformer(config or Config())


def from_config(config: dict) -> Transformer:
    return Transformer(Config(**config))


def encode_pairs(tok: AlignerTokenizer, pairs: list[aligner_data.Pair]):
    """Batched tensors for `pairs`: enc (B, S), dec (B, T), target (B, T) padded with P, and the
    gold attention (B, T, S): row t = 1 + j (where target word j is the decoder input) holds the
    sure links of word j spread evenly over the pieces of its source words (zero rows elsewhere)."""
    src = [tok.encode(" ".join(p.source)) for p in pairs]
    tgt = [tok.target.encode(" ".join(p.target)) for p in pairs]
    S = max(map(len, src))
    T = max(map(len, tgt)) + 1
    enc = torch.zeros(len(pairs), S, dtype=torch.long)
    dec = torch.zeros(len(pairs), T, dtype=torch.long)
    out = torch.zeros(len(pairs), T, dtype=torch.long)
    gold = torch.zeros(len(pairs), T, S)
    for b, (p, s, t) in enumerate(zip(pairs, src, tgt, strict=True)):
        enc[b, : len(s)] = torch.tensor(s)
        dec[b, : len(t) + 1] = torch.tensor([tok.bos_id] + t)
        out[b, : len(t) + 1] = torch.tensor(t + [tok.eos_id])
        pieces = []  # source word index -> its piece positions
        for pos, piece in enumerate(tok.tokenize(" ".join(p.source))):
            if piece.startswith("##"):
                pieces[-1].append(pos)
            else:
                pieces.append([pos])
        for i, j in p.sure:
            gold[b, 1 + j, pieces[i]] += 1.0 / len(pieces[i])
    gold = gold / gold.sum(-1, keepdim=True).clamp(min=1e-9)
    return enc, dec, out, gold


def train(
    config: Config | None = None,
    *,
    seed: int = 2026,
    lr: float = 2e-3,
    warmup: int = 100,
    steps: int = 500,
    batch_size: int = 64,
    align_weight: float = 0.0,
    log: Callable[[str], None] | None = None,
    log_every: int = 100,
    progress: bool = False,
) -> tuple[Transformer, TrainStats]:
    """Adam with linear warm-up then inverse-sqrt decay on the generated training pairs;
    loss = cross-entropy (pads ignored) [+ align_weight * alignment cross-entropy of one head,
    off by default]. Returns (model in eval mode, stats)."""
    if isinstance(config, dict):
        config = Config(**config)
    config = config or Config()
    t0 = time.perf_counter()
    train_pairs, _ = aligner_data.split()
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        rng = random.Random(seed)
        model = build(config)
        criterion = nn.CrossEntropyLoss(ignore_index=PAD)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98))
        sched = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min((s + 1) / warmup, math.sqrt(warmup / (s + 1)))
        )
        layer, head = SUPERVISED
        model.train()
        for step in tqdm(range(steps), desc=f"{NAME}: training", unit="step", disable=not progress):
            enc, dec, out, gold = encode_pairs(model.tokenizer, rng.sample(train_pairs, batch_size))
            logits, _, _, cross = model(enc, dec)
            loss = criterion(logits.reshape(-1, logits.shape[-1]), out.reshape(-1))
            if align_weight:
                rows = gold.sum(-1) > 0  # (B, T): positions with a gold sure link
                attn = cross[layer][:, head]  # (B, T, S)
                align = -(gold * attn.clamp(min=1e-9).log()).sum(-1)[rows].mean()
                loss = loss + align_weight * align
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sched.step()
            losses.append(loss.item())
            if log and (step % log_every == 0 or step == steps - 1):
                log(f"step {step:4d} | loss {losses[-1]:.4f}")
    seconds = time.perf_counter() - t0
    recipe = {
        "seed": seed,
        "optimizer": "Adam(0.9, 0.98), warm-up then inverse sqrt",
        "lr": lr,
        "warmup": warmup,
        "steps": steps,
        "batch_size": batch_size,
        "align_weight": align_weight,
        "supervised_head": list(SUPERVISED) if align_weight else None,
        "data": "models.aligner_data.split(seed=13): 6000 train / 300 held-out pairs",
    }
    return model.eval(), TrainStats(losses[-1], steps, seconds, recipe, losses)
