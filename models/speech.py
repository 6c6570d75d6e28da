"""A small Whisper-shaped speech recognizer, trained on synthesized sentences with known word timings.

Whisper's encoder-decoder (Radford et al. 2022) at toy scale. The front end
(`models.speech_features`, carried as `model.processor`) turns 16 kHz audio into 40 log-mel
features every 10 ms; the encoder runs two 1-D convolutions over them (`conv1`: kernel 3; `conv2`:
kernel 3, stride 2, so one encoder position per 20 ms), adds fixed sinusoidal positions and runs
`n_enc_layer` pre-LN blocks (`x + self_attn(ln1(x))`, `x + mlp(ln2(x))`) and a final LayerNorm;
the decoder embeds words, adds learned positions and runs `n_dec_layer` pre-LN blocks of causal
self-attention, cross-attention over the encoder's output and an MLP, with the output projection
tied to the word embedding. Every attention is `F.scaled_dot_product_attention` over separate
query/key/value projections, so probe captures it.

Tokens are whole words (`SpeechTokenizer`): `<pad>` (0), `<s>` (1, the decoder's start), `</s>`
(2, the end) and the 24 words of `models.speech_data`. The decoder reads `<s> w1 w2 ...` and
predicts `w1 w2 ... </s>`. Trained by `python -m models.train speech` on sentences from
`models.speech_data` (each word synthesized alone by espeak-ng and joined with silences of known
length), with no timing supervision: where its cross-attention looks is learned from transcripts
alone, and `benchmarks/speech_timestamps.py` measures it against the known word boundaries.

The processor pads every waveform with silence to 6 s (Whisper pads to 30 s); training batches are
padded to their longest sentence (`padding="longest"`), so the model learned to end a transcript
where the padding's silence begins: give it the padding. `transcribe(audio)` decodes greedily;
`generate(input_features=...)` does the same, called like transformers' (probe's capture uses it
when no transcript is given).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F
from tqdm.auto import tqdm

from . import speech_data
from .checkpoint import TrainStats
from .speech_features import FeatureExtractor, SpeechProcessor
from .tokenizers import WordTokenizer

NAME = "speech"
RECIPE_SUMMARY = "2,000 AdamW steps on synthesized sentences, 10-40 minutes on two cores"
SPECIALS = ("<pad>", "<s>", "</s>")


def _vocab() -> dict[str, int]:
    return {t: i for i, t in enumerate((*SPECIALS, *speech_data.WORDS))}


@dataclass
class Config:
    vocab: dict[str, int] = field(default_factory=_vocab)
    sampling_rate: int = speech_data.SAMPLE_RATE
    n_fft: int = 400
    hop_length: int = 160
    n_mels: int = 40
    d_model: int = 64
    n_head: int = 4
    n_enc_layer: int = 3
    n_dec_layer: int = 3
    d_ff: int = 256
    max_source_positions: int = 1500  # encoder positions: 30 s at 20 ms each, as Whisper
    max_target_positions: int = 16
    # what a Hugging Face encoder-decoder's config says (class attributes: not saved, not options)
    is_encoder_decoder = True
    pad_token_id = 0
    decoder_start_token_id = bos_token_id = 1
    eos_token_id = 2


class SpeechTokenizer(WordTokenizer):
    """One token per word; `bos_id` starts the decoder, `eos_id` ends a transcript."""

    def __init__(self, vocab: dict[str, int]):
        super().__init__(NAME, vocab, pad_id=vocab["<pad>"])
        self.bos_id = vocab["<s>"]
        self.eos_id = vocab["</s>"]
        self.target = self  # the decoder's side reads the same words

    def decode_words(self, ids, skip_special_tokens: bool = True) -> str:
        """The words of `ids`, the special tokens left out when `skip_special_tokens`."""
        ids = [int(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
        if skip_special_tokens:
            ids = [i for i in ids if self.itos.get(i) not in SPECIALS]
        return self.decode(ids)


def sinusoids(length: int, channels: int, max_timescale: float = 10_000.0) -> torch.Tensor:
    """Whisper's encoder positions ``[length, channels]``: sines then cosines of geometric rates."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-increment * torch.arange(channels // 2, dtype=torch.float32))
    t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


class Attention(nn.Module):
    """Multi-head attention with separate q/k/v projections and SDPA; cross-attention when
    `forward` gets `xa` (the encoder's output) to read keys and values from."""

    def __init__(self, d: int, n_head: int, causal: bool = False):
        super().__init__()
        self.n_head, self.causal = n_head, causal
        self.query = nn.Linear(d, d)
        self.key = nn.Linear(d, d, bias=False)
        self.value = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        return x.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)

    def forward(self, x: torch.Tensor, xa: torch.Tensor | None = None) -> torch.Tensor:
        src = x if xa is None else xa
        q, k, v = self.split(self.query(x)), self.split(self.key(src)), self.split(self.value(src))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        B, _, T, _ = out.shape
        return self.out(out.transpose(1, 2).reshape(B, T, -1))


def _mlp(d: int, d_ff: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, d_ff), nn.GELU(), nn.Linear(d_ff, d))


class EncoderLayer(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.ln1, self.self_attn = nn.LayerNorm(c.d_model), Attention(c.d_model, c.n_head)
        self.ln2, self.mlp = nn.LayerNorm(c.d_model), _mlp(c.d_model, c.d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.ln1, self.self_attn = nn.LayerNorm(c.d_model), Attention(c.d_model, c.n_head, causal=True)
        self.ln2, self.cross_attn = nn.LayerNorm(c.d_model), Attention(c.d_model, c.n_head)
        self.ln3, self.mlp = nn.LayerNorm(c.d_model), _mlp(c.d_model, c.d_ff)

    def forward(self, x: torch.Tensor, xa: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.ln1(x))
        x = x + self.cross_attn(self.ln2(x), xa)
        return x + self.mlp(self.ln3(x))


class Encoder(nn.Module):
    """input_features [B, n_mels, frames] -> [B, ceil(frames / 2), d_model]."""

    def __init__(self, c: Config):
        super().__init__()
        self.conv1 = nn.Conv1d(c.n_mels, c.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(c.d_model, c.d_model, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positions", sinusoids(c.max_source_positions, c.d_model), persistent=False)
        self.layers = nn.ModuleList([EncoderLayer(c) for _ in range(c.n_enc_layer)])
        self.ln_post = nn.LayerNorm(c.d_model)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv2(F.gelu(self.conv1(features)))).transpose(1, 2)
        x = x + self.positions[: x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.ln_post(x)


class Decoder(nn.Module):
    """ids [B, T] and the encoder's output -> logits [B, T, vocab]."""

    def __init__(self, c: Config):
        super().__init__()
        self.token_embedding = nn.Embedding(len(c.vocab), c.d_model)
        nn.init.normal_(self.token_embedding.weight, std=0.1)  # tied output: logits start near 0
        self.positions = nn.Parameter(torch.randn(c.max_target_positions, c.d_model) * 0.01)
        self.layers = nn.ModuleList([DecoderLayer(c) for _ in range(c.n_dec_layer)])
        self.ln = nn.LayerNorm(c.d_model)

    def forward(self, ids: torch.Tensor, xa: torch.Tensor) -> torch.Tensor:
        x = self.token_embedding(ids) + self.positions[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x, xa)
        return self.ln(x) @ self.token_embedding.weight.T


class SpeechModel(nn.Module):
    """forward(input_features [B, n_mels, frames], decoder_input_ids [B, T]) -> logits [B, T, vocab]."""

    name = NAME
    is_encoder_decoder = True

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.context_length = config.max_target_positions
        self.tokenizer = SpeechTokenizer(config.vocab)
        extractor = FeatureExtractor(config.sampling_rate, config.n_fft, config.hop_length, config.n_mels)
        self.processor = SpeechProcessor(extractor, self.tokenizer)
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)

    def forward(self, input_features: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        c = self.config
        if input_features.dim() != 3 or input_features.shape[1] != c.n_mels:
            raise ValueError(
                f"{NAME}: input_features of {list(input_features.shape)}; it takes [batch, {c.n_mels}, "
                "frames] (use model.processor on 16 kHz audio)"
            )
        if input_features.shape[-1] > 2 * c.max_source_positions:
            raise ValueError(
                f"{NAME}: {input_features.shape[-1]} feature frames; at most {2 * c.max_source_positions} "
                f"({2 * c.max_source_positions * c.hop_length // c.sampling_rate} s of audio)"
            )
        if decoder_input_ids.shape[-1] > c.max_target_positions:
            raise ValueError(
                f"{NAME}: {decoder_input_ids.shape[-1]} decoder tokens; at most {c.max_target_positions}"
            )
        return self.decoder(decoder_input_ids, self.encoder(input_features))

    @torch.no_grad()
    def greedy_decode(self, input_features: torch.Tensor, max_tokens: int | None = None) -> torch.Tensor:
        """Greedy word ids [B, n] after `<s>`, up to and including `</s>` (then padded with `</s>`)."""
        tok = self.tokenizer
        xa = self.encoder(input_features)
        ids = torch.full((input_features.shape[0], 1), tok.bos_id, dtype=torch.long)
        limit = max_tokens or self.config.max_target_positions - 1
        for _ in range(limit):
            nxt = self.decoder(ids, xa)[:, -1].argmax(-1, keepdim=True)
            nxt[ids[:, 1:].eq(tok.eos_id).any(-1)] = tok.eos_id
            ids = torch.cat([ids, nxt], dim=1)
            if bool(nxt.eq(tok.eos_id).all()):
                break
        return ids[:, 1:]

    @property
    def generation_config(self) -> Config:
        """What `generate` reads its special ids from (the config, as in transformers)."""
        return self.config

    @torch.no_grad()
    def generate(
        self, input_features: torch.Tensor, max_new_tokens: int | None = None, **kwargs
    ) -> torch.Tensor:
        """Greedy decoding called like transformers' `generate` (sampling and beams are not
        offered): ids [B, 1 + n], the start token first, each row ending at `</s>`."""
        if kwargs.get("do_sample") or kwargs.get("num_beams", 1) != 1:
            raise ValueError(f"{NAME}.generate decodes greedily: do_sample=False, num_beams=1")
        limit = min(max_new_tokens or self.context_length, self.context_length - 1)
        ids = self.greedy_decode(input_features, limit)
        start = torch.full((ids.shape[0], 1), self.tokenizer.bos_id, dtype=torch.long)
        return torch.cat([start, ids], dim=1)

    def transcribe(self, audio) -> list[str]:
        """The transcript of each waveform (16 kHz float arrays, or one array)."""
        feats = self.processor(audio, sampling_rate=self.config.sampling_rate)["input_features"]
        return self.processor.batch_decode(self.greedy_decode(feats))


def build(config: Config | None = None) -> SpeechModel:
    """An untrained model (weights from the global RNG)."""
    return SpeechModel(config or Config())


def from_config(config: dict) -> SpeechModel:
    """An untrained model shaped by a checkpoint's config dict (load_state_dict comes next)."""
    return build(Config(**config))


def batch(model: SpeechModel, sentences: list[speech_data.Sentence]):
    """(input_features, decoder_input_ids, targets) for `sentences`; targets pad with -100."""
    tok = model.tokenizer
    feats = model.processor([s.audio for s in sentences], padding="longest")["input_features"]
    width = max(len(s.words) for s in sentences) + 1
    dec = torch.full((len(sentences), width), tok.pad_id, dtype=torch.long)
    out = torch.full((len(sentences), width), -100, dtype=torch.long)
    for b, s in enumerate(sentences):
        ids = tok.encode(s.text)
        dec[b, : len(ids) + 1] = torch.tensor([tok.bos_id, *ids])
        out[b, : len(ids) + 1] = torch.tensor([*ids, tok.eos_id])
    return feats, dec, out


def accuracy(model: SpeechModel, sentences: list[speech_data.Sentence] | None = None) -> tuple[float, float]:
    """(share of sentences transcribed exactly, share of words right in place) on `sentences`
    (default: the held-out `speech_data.test_set()`)."""
    sentences = speech_data.test_set() if sentences is None else sentences
    said = model.transcribe([s.audio for s in sentences])
    exact = np.mean([a == s.text for a, s in zip(said, sentences, strict=True)])
    words = [(a.split() + [""] * len(s.words))[: len(s.words)] for a, s in zip(said, sentences, strict=True)]
    right = sum(
        x == y for w, s in zip(words, sentences, strict=True) for x, y in zip(w, s.words, strict=True)
    )
    return float(exact), right / sum(len(s.words) for s in sentences)


def train(
    config: Config | None = None,
    *,
    steps: int = 2000,
    seed: int = 2026,
    lr: float = 2e-3,
    batch_size: int = 32,
    warmup: int = 100,
    weight_decay: float = 0.01,
    log: Callable[[str], None] | None = None,
    log_every: int = 100,
    progress: bool = False,
    device: str = "cpu",
) -> tuple[SpeechModel, TrainStats]:
    """AdamW with linear warm-up and cosine decay; batch `step` holds sentences
    `speech_data.train_seed(step, i)`. Deterministic: `seed` draws the initial weights, the data
    depend only on the step. `device` runs the steps there (features are computed on the CPU).
    Returns (model in eval mode, on the CPU, stats)."""
    if isinstance(config, dict):
        config = Config(**config)
    config = config or Config()
    sounds = speech_data.word_sounds()
    losses = []
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build(config).to(device)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

        def rate(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
        for step in tqdm(range(1, steps + 1), desc=NAME, disable=not progress):
            sents = [speech_data.sentence(speech_data.train_seed(step, i), sounds) for i in range(batch_size)]
            feats, dec, out = (t.to(device) for t in batch(model, sents))
            logits = model(feats, dec)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), out.reshape(-1), ignore_index=-100)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            if log and (step % log_every == 0 or step == 1):
                log(f"step {step:5d} | loss {losses[-1]:.4f}")
    seconds = time.perf_counter() - t0
    model.to("cpu").eval()
    recipe = {
        "seed": seed,
        "optimizer": "AdamW",
        "lr": lr,
        "weight_decay": weight_decay,
        "warmup": warmup,
        "schedule": "linear warm-up, cosine decay",
        "batch_size": batch_size,
        "steps": steps,
        "device": device,
        "data": "models.speech_data.sentence(train_seed(step, i)) on the bundled word sounds",
    }
    return model, TrainStats(losses[-1] if losses else None, steps, seconds, recipe, losses)
