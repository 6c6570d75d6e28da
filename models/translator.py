"""The encoder-decoder Transformer of "Attention Is All You Need" (tutorial 004), on one pair.

The tutorial teaches it on a single sentence pair:

    source   ich mochte ein bier P        (P pads the source to 5 words)
    decoder  S i want a beer              (S starts the target, teacher forcing)
    target   i want a beer E              (E ends it)

The paper's sizes: d_model 512, d_ff 2048, 8 heads of d_k = d_v = 64, 6 encoder and 6 decoder
layers (~44 M parameters). Sublayers are post-norm, `LayerNorm(out + residual)`, with the
LayerNorm inside `MultiHeadAttention` and `PoswiseFeedForwardNet` as in the tutorial; the FFN is
two kernel-size-1 Conv1d with a ReLU between. Masked scores are filled with -1e9 before softmax:
keys equal to the pad id 0 everywhere, plus the future (`triu(ones, k=1)`) in decoder
self-attention.

Positions. The tutorial hard-codes its position lists ([1, 2, 3, 4, 0] and [5, 1, 2, 3, 4]);
here they are computed from the input: the tokens of a sequence get positions 0..n-1, and every
pad token gets position `max_len`, the last row of the frozen sinusoid table, which is all zeros,
so a pad adds nothing but its (masked) word embedding. The table has `max_len + 1` rows and
`context_length == max_len` tokens fit in a sequence.

Training (about 30 Adam steps at 1e-4, seed 2026, full batch on the one sentence, stop once the
loss < 1e-4) runs on first use of `models.load("translator")`, with a progress bar; the 177 MB
checkpoint (44 M float32 parameters) goes to the cache directory, not into git.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from tqdm.auto import tqdm

from .checkpoint import TrainStats
from .tokenizers import WordTokenizer

NAME = "translator"

SRC_VOCAB = {"P": 0, "ich": 1, "mochte": 2, "ein": 3, "bier": 4}
TGT_VOCAB = {"P": 0, "i": 1, "want": 2, "a": 3, "beer": 4, "S": 5, "E": 6}
PAD = 0  # "P" in both vocabularies
SENTENCES = ("ich mochte ein bier P", "S i want a beer", "i want a beer E")
# What the recipe took with torch 2.13 on x86-64 CPUs (31 steps); other builds and thread counts
# round differently and may stop a step or two earlier or later. Sets the progress bar's length.
EXPECTED_STEPS = 31
RECIPE_SUMMARY = (
    f"Adam on the tutorial's one sentence until the loss is below 1e-4, about {EXPECTED_STEPS} steps"
)


@dataclass
class Config:
    src_vocab: dict[str, int] = field(default_factory=lambda: dict(SRC_VOCAB))
    tgt_vocab: dict[str, int] = field(default_factory=lambda: dict(TGT_VOCAB))
    d_model: int = 512  # embedding size, the width of the residual stream
    d_ff: int = 2048  # feed-forward inner size
    d_k: int = 64  # per-head size of queries and keys
    d_v: int = 64  # per-head size of values
    n_layers: int = 6  # in the encoder, and again in the decoder
    n_heads: int = 8
    max_len: int = 16  # longest source or target sequence; one more table row serves pads


class TranslatorTokenizer(WordTokenizer):
    """Source-side words (`encode("ich mochte ein bier")`); `.target` numbers the English side."""

    def __init__(self, src_vocab: dict[str, int], tgt_vocab: dict[str, int]):
        super().__init__(NAME, src_vocab, pad_id=PAD)
        self.target = WordTokenizer(f"{NAME} target", tgt_vocab, pad_id=PAD)
        self.bos_id = tgt_vocab["S"]
        self.eos_id = tgt_vocab["E"]


def sinusoid_table(n_position: int, d_model: int) -> torch.Tensor:
    """(n_position, d_model): PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(same)."""
    pos = torch.arange(n_position, dtype=torch.float64)[:, None]  # (n_position, 1)
    i = torch.arange(d_model, dtype=torch.float64)[None, :]  # (1, d_model)
    angle = pos / torch.pow(10000.0, 2 * (i // 2) / d_model)
    table = torch.empty_like(angle)
    table[:, 0::2] = torch.sin(angle[:, 0::2])
    table[:, 1::2] = torch.cos(angle[:, 1::2])
    return table.float()


def positions(seq: torch.Tensor, pad_position: int) -> torch.Tensor:
    """(B, T) position ids: 0..T-1, with every pad token sent to the all-zero row `pad_position`."""
    B, T = seq.shape
    pos = torch.arange(T, device=seq.device).expand(B, T)
    return pos.masked_fill(seq.eq(PAD), pad_position)


def get_attn_pad_mask(seq_q: torch.Tensor, seq_k: torch.Tensor) -> torch.Tensor:
    """(B, len_q, len_k) bool, True where the key is a pad: no query may read a pad."""
    B, len_q = seq_q.shape
    len_k = seq_k.shape[1]
    return seq_k.eq(PAD).unsqueeze(1).expand(B, len_q, len_k)


def get_attn_subsequent_mask(seq: torch.Tensor) -> torch.Tensor:
    """(B, T, T) bool, True above the diagonal: position i may not read positions after i."""
    B, T = seq.shape
    return torch.triu(torch.ones(T, T, device=seq.device), diagonal=1).bool().expand(B, T, T)


class ScaledDotProductAttention(nn.Module):
    """softmax(Q K^T / sqrt(d_k), masked) V. forward -> (context, attn (B, H, len_q, len_k))."""

    def __init__(self, d_k: int):
        super().__init__()
        self.d_k = d_k

    def forward(self, Q, K, V, attn_mask):
        scores = Q @ K.transpose(-1, -2) / math.sqrt(self.d_k)  # (B, H, len_q, len_k)
        scores = scores.masked_fill(attn_mask, -1e9)  # exp(-1e9) is exactly 0 after softmax
        attn = torch.softmax(scores, dim=-1)
        context = attn @ V  # (B, H, len_q, d_v)
        return context, attn


class MultiHeadAttention(nn.Module):
    """Q, K, V (B, len, d_model), mask (B, len_q, len_k) -> (LayerNorm(out + Q), attn)."""

    def __init__(self, config: Config):
        super().__init__()
        c = config
        self.n_heads = c.n_heads
        self.W_Q = nn.Linear(c.d_model, c.d_k * c.n_heads)
        self.W_K = nn.Linear(c.d_model, c.d_k * c.n_heads)
        self.W_V = nn.Linear(c.d_model, c.d_v * c.n_heads)
        self.attention = ScaledDotProductAttention(c.d_k)
        self.linear = nn.Linear(c.n_heads * c.d_v, c.d_model)
        self.layer_norm = nn.LayerNorm(c.d_model)

    def forward(self, Q, K, V, attn_mask):
        residual = Q
        q_s = rearrange(self.W_Q(Q), "b t (h d) -> b h t d", h=self.n_heads)  # (B, H, len_q, d_k)
        k_s = rearrange(self.W_K(K), "b t (h d) -> b h t d", h=self.n_heads)  # (B, H, len_k, d_k)
        v_s = rearrange(self.W_V(V), "b t (h d) -> b h t d", h=self.n_heads)  # (B, H, len_k, d_v)

        attn_mask = attn_mask.unsqueeze(1)  # (B, 1, len_q, len_k), the same mask for every head
        context, attn = self.attention(q_s, k_s, v_s, attn_mask)
        context = rearrange(context, "b h t d -> b t (h d)")  # heads stitched: (B, len_q, H*d_v)
        output = self.linear(context)
        return self.layer_norm(output + residual), attn


class PoswiseFeedForwardNet(nn.Module):
    """(B, T, d_model) -> LayerNorm(conv2(relu(conv1(x))) + x), applied to each position alone."""

    def __init__(self, config: Config):
        super().__init__()
        self.conv1 = nn.Conv1d(in_channels=config.d_model, out_channels=config.d_ff, kernel_size=1)
        self.conv2 = nn.Conv1d(in_channels=config.d_ff, out_channels=config.d_model, kernel_size=1)
        self.layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        residual = inputs  # (B, T, d_model)
        # A kernel-size-1 Conv1d is one matrix product per position: apply the convs' own weights
        # (d_out, d_in, 1) with F.linear. Same parameters and sums, without the CPU convolution's
        # unfold path, which dominated the translator's training time.
        output = torch.relu(F.linear(inputs, self.conv1.weight.squeeze(-1), self.conv1.bias))
        output = F.linear(output, self.conv2.weight.squeeze(-1), self.conv2.bias)  # (B, T, d_model)
        return self.layer_norm(output + residual)


class EncoderLayer(nn.Module):
    """forward(x (B, S, d_model), mask) -> (x, self-attention (B, H, S, S))."""

    def __init__(self, config: Config):
        super().__init__()
        self.enc_self_attn = MultiHeadAttention(config)
        self.pos_ffn = PoswiseFeedForwardNet(config)

    def forward(self, enc_inputs, enc_self_attn_mask):
        enc_outputs, attn = self.enc_self_attn(enc_inputs, enc_inputs, enc_inputs, enc_self_attn_mask)
        enc_outputs = self.pos_ffn(enc_outputs)
        return enc_outputs, attn


class DecoderLayer(nn.Module):
    """forward(y (B, T, d_model), memory (B, S, d_model), masks) -> (y, self-attn, cross-attn)."""

    def __init__(self, config: Config):
        super().__init__()
        self.dec_self_attn = MultiHeadAttention(config)
        self.dec_enc_attn = MultiHeadAttention(config)
        self.pos_ffn = PoswiseFeedForwardNet(config)

    def forward(self, dec_inputs, enc_outputs, dec_self_attn_mask, dec_enc_attn_mask):
        # look back at the English written so far, then look up the German it should translate
        dec_outputs, dec_self_attn = self.dec_self_attn(
            dec_inputs, dec_inputs, dec_inputs, dec_self_attn_mask
        )
        dec_outputs, dec_enc_attn = self.dec_enc_attn(
            dec_outputs, enc_outputs, enc_outputs, dec_enc_attn_mask
        )
        dec_outputs = self.pos_ffn(dec_outputs)
        return dec_outputs, dec_self_attn, dec_enc_attn


def _position_embedding(config: Config) -> nn.Embedding:
    table = sinusoid_table(config.max_len + 1, config.d_model)
    table[config.max_len] = 0.0  # the pad row
    return nn.Embedding.from_pretrained(table, freeze=True, padding_idx=config.max_len)


def _check_length(seq: torch.Tensor, max_len: int, side: str) -> None:
    if seq.shape[1] > max_len:
        raise ValueError(f"{NAME}: {side} of {seq.shape[1]} tokens; at most {max_len} fit")


class Encoder(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.max_len = config.max_len
        self.src_emb = nn.Embedding(len(config.src_vocab), config.d_model)
        self.pos_emb = _position_embedding(config)
        self.layers = nn.ModuleList([EncoderLayer(config) for _ in range(config.n_layers)])

    def forward(self, enc_inputs: torch.Tensor):
        """enc_inputs (B, S) -> (enc_outputs (B, S, d_model), [attn (B, H, S, S)] per layer)."""
        _check_length(enc_inputs, self.max_len, "source")
        pos = positions(enc_inputs, pad_position=self.max_len)
        enc_outputs = self.src_emb(enc_inputs) + self.pos_emb(pos)  # word meaning + position
        enc_self_attn_mask = get_attn_pad_mask(enc_inputs, enc_inputs)
        enc_self_attns = []
        for layer in self.layers:
            enc_outputs, enc_self_attn = layer(enc_outputs, enc_self_attn_mask)
            enc_self_attns.append(enc_self_attn)
        return enc_outputs, enc_self_attns


class Decoder(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.max_len = config.max_len
        self.tgt_emb = nn.Embedding(len(config.tgt_vocab), config.d_model)
        self.pos_emb = _position_embedding(config)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.n_layers)])

    def forward(self, dec_inputs, enc_inputs, enc_outputs):
        """dec_inputs (B, T), enc_inputs (B, S), enc_outputs (B, S, d_model) ->
        (dec_outputs (B, T, d_model), [self-attn (B, H, T, T)], [cross-attn (B, H, T, S)])."""
        _check_length(dec_inputs, self.max_len, "target")
        pos = positions(dec_inputs, pad_position=self.max_len)
        dec_outputs = self.tgt_emb(dec_inputs) + self.pos_emb(pos)
        dec_self_attn_mask = get_attn_pad_mask(dec_inputs, dec_inputs) | get_attn_subsequent_mask(dec_inputs)
        dec_enc_attn_mask = get_attn_pad_mask(dec_inputs, enc_inputs)  # only the source pads

        dec_self_attns, dec_enc_attns = [], []
        for layer in self.layers:
            dec_outputs, dec_self_attn, dec_enc_attn = layer(
                dec_outputs, enc_outputs, dec_self_attn_mask, dec_enc_attn_mask
            )
            dec_self_attns.append(dec_self_attn)
            dec_enc_attns.append(dec_enc_attn)
        return dec_outputs, dec_self_attns, dec_enc_attns


class Transformer(nn.Module):
    """forward(enc_inputs (B, S), dec_inputs (B, T)) ->
    (logits (B, T, tgt_vocab), enc_self_attns, dec_self_attns, dec_enc_attns), the attention
    lists holding one (B, H, len_q, len_k) tensor per layer."""

    name = NAME
    is_encoder_decoder = True

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.context_length = config.max_len
        self.tokenizer = TranslatorTokenizer(config.src_vocab, config.tgt_vocab)
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.projection = nn.Linear(config.d_model, len(config.tgt_vocab), bias=False)

    def forward(self, enc_inputs: torch.Tensor, dec_inputs: torch.Tensor):
        enc_outputs, enc_self_attns = self.encoder(enc_inputs)
        dec_outputs, dec_self_attns, dec_enc_attns = self.decoder(dec_inputs, enc_inputs, enc_outputs)
        logits = self.projection(dec_outputs)  # (B, T, tgt_vocab)
        return logits, enc_self_attns, dec_self_attns, dec_enc_attns

    @torch.no_grad()
    def greedy_decode(self, enc_inputs: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
        """Target ids (1, n) after S, most likely word each step, stopping after E or max_len."""
        tok = self.tokenizer
        max_len = max_len or self.context_length
        enc_outputs, _ = self.encoder(enc_inputs)
        dec_inputs = torch.tensor([[tok.bos_id]], dtype=torch.long, device=enc_inputs.device)
        while dec_inputs.shape[1] < max_len:
            dec_outputs, _, _ = self.decoder(dec_inputs, enc_inputs, enc_outputs)
            next_word = self.projection(dec_outputs[:, -1]).argmax(dim=-1, keepdim=True)  # (1, 1)
            dec_inputs = torch.cat([dec_inputs, next_word], dim=1)
            if next_word.item() == tok.eos_id:
                break
        return dec_inputs[:, 1:]

    def translate(self, text: str) -> str:
        """Greedy translation: "ich mochte ein bier" -> "i want a beer E"."""
        enc_inputs = torch.tensor([self.tokenizer.encode(text)], dtype=torch.long)
        return self.tokenizer.target.decode(self.greedy_decode(enc_inputs)[0])


def build(config: Config | None = None) -> Transformer:
    """An untrained model (weights from the global RNG)."""
    return Transformer(config or Config())


def from_config(config: dict) -> Transformer:
    return Transformer(Config(**config))


def make_batch(tokenizer: TranslatorTokenizer, sentences=SENTENCES):
    """(enc_inputs, dec_inputs, target), each (1, 5): the tutorial's sentence as ids."""
    src, dec, tgt = sentences
    return (
        torch.tensor([tokenizer.encode(src)]),
        torch.tensor([tokenizer.target.encode(dec)]),
        torch.tensor([tokenizer.target.encode(tgt)]),
    )


def _adam(params, lr: float) -> torch.optim.Adam:
    """Adam with the fused kernel (one pass over each tensor per step) where this torch has it on
    CPU; the same update as the default loop, which makes ~13 passes over 44 M parameters."""
    params = list(params)
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except (RuntimeError, ValueError):  # torch < 2.4 has no fused Adam for CPU tensors
        return torch.optim.Adam(params, lr=lr)


def train(
    config: Config | None = None,
    *,
    seed: int = 2026,
    lr: float = 1e-4,
    stop_loss: float = 1e-4,
    max_steps: int = 200,
    log: Callable[[str], None] | None = None,
    log_every: int = 10,
    progress: bool = False,
) -> tuple[Transformer, TrainStats]:
    """The tutorial's recipe: Adam, full batch on the one sentence, cross-entropy ignoring pads,
    stop as soon as a forward pass gives loss < stop_loss. Returns (model in eval mode, stats);
    stats.steps counts the optimizer updates, stats.final_loss is the loss that stopped it."""
    if isinstance(config, dict):
        config = Config(**config)
    config = config or Config()
    t0 = time.perf_counter()
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build(config)
        enc_inputs, dec_inputs, target = make_batch(model.tokenizer)
        criterion = nn.CrossEntropyLoss(ignore_index=PAD)
        optimizer = _adam(model.parameters(), lr)
        bar = tqdm(
            desc=f"{NAME}: steps until loss < {stop_loss:g}",
            total=EXPECTED_STEPS,
            unit="step",
            disable=not progress,
        )
        steps = 0
        while True:
            optimizer.zero_grad()
            logits, *_ = model(enc_inputs, dec_inputs)
            loss = criterion(logits.view(-1, logits.shape[-1]), target.view(-1))
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.6f}")
            if log and (steps % log_every == 0):
                log(f"step {steps:3d} | loss {losses[-1]:.6f}")
            if losses[-1] < stop_loss or steps == max_steps:
                break
            loss.backward()
            optimizer.step()
            steps += 1
            if steps > bar.total:  # a build that rounds differently: let the bar grow with it
                bar.total = steps
            bar.update()
        bar.total = steps  # stopped: the bar ends full, whether early or late
        bar.refresh()
        bar.close()
    if log:
        log(f"stopped after {steps} steps, loss {losses[-1]:.6f}")
    seconds = time.perf_counter() - t0
    recipe = {
        "seed": seed,
        "optimizer": "Adam",
        "lr": lr,
        "stop_loss": stop_loss,
        "max_steps": max_steps,
        "sentences": list(SENTENCES),
    }
    return model.eval(), TrainStats(losses[-1], steps, seconds, recipe, losses)
