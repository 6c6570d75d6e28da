"""A 2-layer attention-only transformer that grows an induction circuit (Olsson et al. 2022).

The model of "In-context Learning and Induction Heads" at toy scale, small enough to read the
circuit off its weights: token embeddings plus fixed sinusoidal position embeddings, 2 layers of
causal multi-head attention with NO MLP and NO LayerNorm (`x = x + attn(x)`), then a linear
unembedding `lm_head`. The residual stream is a plain sum, embeddings plus every head's write, so
the logits are exactly `lm_head(tok_emb + pos_emb + the heads' writes)`. Layer 0 has 4 heads,
layer 1 one; every head is 64 wide. Each attention keeps separate `q`, `k`, `v` projections
`Linear(64, n_head * 64)` (head h in columns h*64:(h+1)*64) and an output projection `o` that
reads the heads side by side; no biases anywhere. 90,240 parameters.

It is trained on random tokens over which segments are copied (`repeated_batch`): a token before
its segment's copy cannot be predicted (chance is 1/64), a token of the copy can, by looking
back. The shipped model solves it with two heads: a previous-token head in layer 0 (head 3)
writes into each position the token before it, and the induction head in layer 1 (head 0) matches
its query (the current token) against those keys (K-composition), attends to the token that
followed the current token's earlier occurrence and copies it to the logits. The other three
layer-0 heads rest on BOS. `docs/zoo.md` gives the measured scores.

The vocabulary is the 64 characters of base64 (`A-Z a-z 0-9 + /`) after a beginning-of-sequence
token `^` (id 0, `tokenizer.bos_id`); there is no padding (`tokenizer.pad_id` is None). The context
holds 64 tokens: `^` and 63 more, e.g. `^` + a segment of 31 + the same 31 again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.nn import functional as F
from tqdm.auto import tqdm

from .checkpoint import TrainStats
from .tokenizers import CharTokenizer

NAME = "induction"
BOS = "^"
CHARS = BOS + "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"  # id 0 is BOS
RECIPE_SUMMARY = "1,500 AdamW steps on random tokens with repeated segments, 1-3 minutes on one core"


@dataclass
class Config:
    vocab_size: int = len(CHARS)  # 65: BOS + 64 random tokens
    d_model: int = 64
    n_head: list[int] = field(default_factory=lambda: [4, 1])  # heads in each layer
    d_head: int = 64
    context_length: int = 64
    position_scale: float = 3.0  # amplitude of the sinusoidal position embeddings

    @property
    def n_layer(self) -> int:
        return len(self.n_head)


class InductionTokenizer(CharTokenizer):
    """One token per character; `^` (id 0) begins a sequence: encode("^AB") == [0, 1, 2]."""

    bos_id = 0
    bos_token = BOS


def tokenizer() -> InductionTokenizer:
    """`^` then base64's 64 characters, ids in that order."""
    return InductionTokenizer(NAME, CHARS, pad_id=None)


class SinusoidalPositions(nn.Module):
    """Fixed position embeddings (Vaswani et al. 2017): forward(positions (T,)) -> (T, d_model).

    Row p holds sin(p / 10000^(2i/d)) in column 2i and cos(...) in column 2i+1, times `scale`. A
    fixed linear map takes row p to row p-1 for every p at once, so a head that learns to attend
    to the previous token does so at every position (learned per-position embeddings let several
    heads share that job, each for some positions). Not a parameter: nothing of it is trained or
    saved.
    """

    def __init__(self, context_length: int, d_model: int, scale: float):
        super().__init__()
        pos = torch.arange(context_length, dtype=torch.float32)[:, None]
        freq = 10000 ** (-torch.arange(0, d_model, 2, dtype=torch.float32) / d_model)
        table = torch.zeros(context_length, d_model)
        table[:, 0::2] = torch.sin(pos * freq)
        table[:, 1::2] = torch.cos(pos * freq)
        self.register_buffer("table", table * scale, persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.table[positions]


class Attention(nn.Module):
    """Causal multi-head attention: forward(x (B, T, d_model)) -> (B, T, d_model).

    q, k, v: Linear(d_model, n_head * d_head), head h in columns h*d_head:(h+1)*d_head;
    o: Linear(n_head * d_head, d_model) reads the heads side by side.
    """

    def __init__(self, d_model: int, n_head: int, d_head: int):
        super().__init__()
        self.n_head, self.d_head = n_head, d_head
        self.q = nn.Linear(d_model, n_head * d_head, bias=False)
        self.k = nn.Linear(d_model, n_head * d_head, bias=False)
        self.v = nn.Linear(d_model, n_head * d_head, bias=False)
        self.o = nn.Linear(n_head * d_head, d_model, bias=False)

    def forward(self, x: torch.Tensor, return_weights: bool = False):
        """x (B, T, d_model) -> out (B, T, d_model); with return_weights also (B, n_head, T, T)."""
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_head, self.d_head).transpose(1, 2)  # (B, H, T, dh)
        k = self.k(x).view(B, T, self.n_head, self.d_head).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_head, self.d_head).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) * self.d_head**-0.5  # (B, H, T, T)
        future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=1)
        weights = F.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        heads = (weights @ v).transpose(1, 2).reshape(B, T, self.n_head * self.d_head)
        out = self.o(heads)
        return (out, weights) if return_weights else out


class Block(nn.Module):
    """One layer: the residual stream plus what the attention writes, nothing else."""

    def __init__(self, config: Config, n_head: int):
        super().__init__()
        self.attn = Attention(config.d_model, n_head, config.d_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x)


class AttentionOnlyTransformer(nn.Module):
    """forward(idx (B, T), targets (B, T) | None) -> (logits (B, T, vocab), loss | None)."""

    name = NAME
    is_encoder_decoder = False

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.context_length = config.context_length
        self.tokenizer = tokenizer()
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = SinusoidalPositions(config.context_length, config.d_model, config.position_scale)
        self.blocks = nn.ModuleList([Block(config, h) for h in config.n_head])
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.context_length:
            raise ValueError(f"{NAME}: {T} tokens, the context holds at most {self.context_length}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss

    @torch.no_grad()
    def predict(self, text: str) -> str:
        """The model's guess for the token after each prefix of `text` (as many characters)."""
        idx = torch.tensor([self.tokenizer.encode(text)], dtype=torch.long)
        return self.tokenizer.decode(self(idx)[0][0].argmax(dim=-1))


def build(config: Config | None = None) -> AttentionOnlyTransformer:
    """An untrained model (weights from the global RNG)."""
    return AttentionOnlyTransformer(config or Config())


def from_config(config: dict) -> AttentionOnlyTransformer:
    """An untrained model shaped by a checkpoint's config dict (load_state_dict comes next)."""
    return build(Config(**config))


def repeated_batch(
    batch_size: int,
    context_length: int = 64,
    *,
    vocab_size: int = len(CHARS),
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A training batch: BOS, then the tokens (ids 1..vocab-1) in a random order, no token twice,
    over which three segments are copied. Returns x (batch, context_length), y (the next tokens: x
    shifted by one) and repeat (batch, context_length, bool): True where looking back predicts
    y[t], i.e. where the token after an earlier occurrence of x[t] is y[t].

    Per row, in this order (a later copy may overwrite an earlier one):

    1. a long repeat: L in [8, n/2] tokens at a, copied whole to b >= a + L (as in Olsson et al.);
    2. twice, a repeat anywhere: L in [4, n/2] tokens at any a, copied to b = a + 4 .. a + L + 8,
       cut at the end of the context; a copy that starts before its original ends repeats the
       tokens a..b-1 periodically (token b+k is token a+k, for every k).

    The long repeats make the task learnable fast; the repeats anywhere make late positions keys
    too, so the previous-token head learns every position, not only the early ones. Since no token
    repeats by chance, the current token's earlier occurrences always predict the next token:
    matching the current token is all it takes (with repeats by chance, the model also grows a
    head that attends two tokens back, to match two tokens at once).
    """
    n, g = context_length, generator
    if n > vocab_size - 1:
        raise ValueError(f"{n} positions need {n} distinct tokens; the vocabulary has {vocab_size - 1}")
    order = torch.rand(batch_size, vocab_size - 1, generator=g).argsort(dim=-1)[:, :n] + 1
    tokens = torch.cat([torch.zeros(batch_size, 1, dtype=torch.long), order], dim=1)  # BOS first
    source = torch.arange(n + 1).expand(batch_size, n + 1)  # position t shows tokens[source[t]]
    length = _uniform(8, n // 2, batch_size, g)
    a = _uniform(1, n + 1 - 2 * length, batch_size, g)
    source = _copy(source, a, _uniform(a + length, n + 1 - length, batch_size, g), length)
    for _ in range(2):
        length = _uniform(4, n // 2, batch_size, g)
        a = _uniform(1, n - 4, batch_size, g)
        source = _copy(source, a, _uniform(a + 4, torch.clamp(a + length + 8, max=n), batch_size, g), length)
    seq = tokens.gather(1, source)
    x, y = seq[:, :-1], seq[:, 1:]
    earlier = torch.ones(n, n, dtype=torch.bool).tril(-1)  # [t, j]: j < t
    same = (x[:, :, None] == x[:, None, :]) & (y[:, :, None] == y[:, None, :])
    return x, y, (same & earlier).any(-1)


def _uniform(low, high, size: int, generator: torch.Generator | None) -> torch.Tensor:
    """`size` integers, each uniform in [low, high] (ints or per-row tensors, both ends included)."""
    u = torch.rand(size, generator=generator, dtype=torch.float64)
    return low + (u * (torch.as_tensor(high - low) + 1)).long()


def _copy(source: torch.Tensor, a: torch.Tensor, b: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Per row, position b + k shows what position a + k shows, for k < length (in order: a copy
    that overlaps its original repeats a..b-1), up to the end of the row."""
    t = torch.arange(source.shape[1])
    a, b, length = a[:, None], b[:, None], length[:, None]
    inside = (t >= b) & (t < b + length)
    origin = (a + (t - b) % (b - a)).clamp(0, source.shape[1] - 1)
    return torch.where(inside, source.gather(1, origin), source)


def repeated_tokens(
    sequences: int, length: int, *, seed: int = 0, vocab_size: int = len(CHARS)
) -> torch.Tensor:
    """Olsson et al.'s test input, `[BOS] r r`: (sequences, 1 + 2 * length) ids, each r `length`
    distinct random tokens (ids 1..vocab-1) drawn with `seed`."""
    if not 1 <= length <= vocab_size - 1:
        raise ValueError(f"length must be 1..{vocab_size - 1} (distinct tokens), got {length}")
    g = torch.Generator().manual_seed(seed)
    r = torch.rand(sequences, vocab_size - 1, generator=g).argsort(dim=-1)[:, :length] + 1
    return torch.cat([torch.zeros(sequences, 1, dtype=torch.long), r, r], dim=1)


@torch.no_grad()
def accuracy(model: AttentionOnlyTransformer, sequences: int = 64, length: int = 31, seed: int = 0) -> dict:
    """Next-token accuracy on `repeated_tokens(sequences, length, seed=seed)`: `first` over the
    targets of the first copy (r's tokens after its first; chance is 1/64), `second` over those of
    the second copy after its first token (what induction predicts)."""
    ids = repeated_tokens(sequences, length, seed=seed, vocab_size=model.config.vocab_size)
    logits, _ = model(ids[:, :-1])
    hit = (logits.argmax(-1) == ids[:, 1:]).float()  # hit[:, t]: the token at t + 1
    return {"first": hit[:, 1:length].mean().item(), "second": hit[:, length + 1 :].mean().item()}


def train(
    config: Config | None = None,
    *,
    steps: int = 1500,
    seed: int = 2022,
    lr: float = 3e-3,
    batch_size: int = 32,
    weight_decay: float = 0.01,
    log: Callable[[str], None] | None = None,
    log_every: int = 250,
    progress: bool = False,
) -> tuple[AttentionOnlyTransformer, TrainStats]:
    """AdamW on fresh batches of `repeated_batch`, next-token loss at every position. Returns
    (model in eval mode, stats).

    Deterministic: `seed` draws the initial weights, then every batch, from one RNG stream. It runs
    on one CPU thread (restored afterwards): faster than several for a model this small, and the
    result does not depend on the machine's core count.
    """
    if isinstance(config, dict):
        config = Config(**config)
    config = config or Config()
    losses = []
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    try:
        torch.set_num_threads(1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = build(config)
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
            for step in tqdm(range(1, steps + 1), desc=NAME, disable=not progress):
                x, y, _ = repeated_batch(batch_size, config.context_length, vocab_size=config.vocab_size)
                _, loss = model(x, y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                if log and (step % log_every == 0 or step == 1):
                    log(f"step {step:5d} | loss {losses[-1]:.4f}")
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - t0
    recipe = {
        "seed": seed,
        "optimizer": "AdamW",
        "lr": lr,
        "weight_decay": weight_decay,
        "batch_size": batch_size,
        "steps": steps,
        "threads": 1,
        "data": "repeated_batch: BOS + random tokens with three repeated segments, fresh each step",
    }
    stats = TrainStats(losses[-1] if losses else None, steps, seconds, recipe, losses)
    return model.eval(), stats
