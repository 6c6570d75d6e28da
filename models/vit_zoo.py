"""A small vision transformer that names the shape in a picture (ViT, Dosovitskiy et al. 2020).

The textbook ViT at toy scale: the 64 x 64 picture is cut into an 8 x 8 grid of 8-pixel patches by
one convolution (kernel = stride = 8, `patch_embed`), a learned class token (`cls_token`) and two
register tokens (`register_tokens`, Darcet et al. 2024) go before the patches, learned position
embeddings are added, then `n_layer` pre-norm blocks (`x + attn(ln1(x))`, `x + mlp(ln2(x))`) of
multi-head self-attention (fused `qkv`, `F.scaled_dot_product_attention`), a final LayerNorm and
a linear head on the class token. Sequence: `[CLS]`, `reg 0`, `reg 1`, then the patches row by row.

It is trained on `models.shapes` pictures (circle, square, triangle, cross, ring, diamond on
textured, noisy backgrounds; the object's box and mask known by construction), so where its
attention looks can be checked against where the object is (`benchmarks/pointing_zoo.py`).

`model.processor` turns pictures into its input the way a Hugging Face image processor does:
`processor(images=[...], return_tensors="pt")["pixel_values"]` (resized to 64 x 64, scaled to
[0, 1], normalised with `image_mean`/`image_std`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.nn import functional as F
from tqdm.auto import tqdm

from . import shapes
from .checkpoint import TrainStats

NAME = "vit_zoo"
RECIPE_SUMMARY = "3,000 AdamW steps on generated shape pictures, 10-25 minutes on two cores"


@dataclass
class Config:
    image_size: int = 64
    patch_size: int = 8
    channels: int = 3
    n_embd: int = 64
    n_head: int = 4
    n_layer: int = 4
    n_registers: int = 2
    mlp_ratio: int = 4
    n_classes: int = len(shapes.CLASSES)
    image_mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    image_std: list[float] = field(default_factory=lambda: [0.25, 0.25, 0.25])


class ImageProcessor:
    """Pictures to ``pixel_values``, called like a Hugging Face image processor.

    ``processor(images=[...], return_tensors="pt")`` takes PIL images, ``[H, W(, C)]`` numpy arrays
    (uint8 in 0..255, floats in [0, 1]) or ``[3, H, W]`` tensors in [0, 1] (a ``[n, 3, H, W]``
    tensor is ``n`` pictures), resizes each to
    ``size`` x ``size`` (bilinear, antialiased), and returns ``{"pixel_values": [n, 3, size,
    size]}`` normalised as ``(x - image_mean) / image_std``.
    """

    def __init__(self, size: int, image_mean: list[float], image_std: list[float]):
        self.size = size
        self.image_mean = list(image_mean)
        self.image_std = list(image_std)

    def __repr__(self) -> str:
        return f"ImageProcessor(size={self.size}, image_mean={self.image_mean}, image_std={self.image_std})"

    def _tensor(self, img) -> torch.Tensor:
        import numpy as np

        if isinstance(img, torch.Tensor):
            x = img.detach().float()
            if x.dim() != 3 or x.shape[0] not in (1, 3):
                raise ValueError(f"a tensor picture is [3, height, width] in [0, 1], not {list(x.shape)}")
        else:
            if type(img).__module__.startswith("PIL."):
                img = img.convert("RGB")
            arr = np.asarray(img)
            if arr.ndim == 2:
                arr = arr[:, :, None]
            if arr.ndim != 3 or arr.shape[-1] not in (1, 3, 4):
                raise ValueError(f"a picture is [height, width(, channels)], not {list(arr.shape)}")
            arr = arr[..., :3]
            x = torch.from_numpy(np.array(arr)).permute(2, 0, 1).float()  # a copy: PIL's are read-only
            if arr.dtype == np.uint8:
                x = x / 255
        if x.shape[0] == 1:
            x = x.expand(3, -1, -1)
        if tuple(x.shape[1:]) != (self.size, self.size):
            x = F.interpolate(x[None], size=(self.size, self.size), mode="bilinear", antialias=True)[0]
        return x.clamp(0, 1)

    def __call__(self, images=None, return_tensors: str | None = "pt", **kwargs) -> dict:
        if images is None:
            raise ValueError("no images given; call processor(images=[...], return_tensors='pt')")
        if return_tensors not in ("pt", None):
            raise ValueError(
                f"return_tensors={return_tensors!r}: this processor returns torch tensors ('pt')"
            )
        many = isinstance(images, (list, tuple)) or (isinstance(images, torch.Tensor) and images.dim() == 4)
        items = list(images) if many else [images]
        if not items:
            raise ValueError("no images given (an empty list)")
        x = torch.stack([self._tensor(img) for img in items])
        mean = torch.tensor(self.image_mean).view(1, -1, 1, 1)
        std = torch.tensor(self.image_std).view(1, -1, 1, 1)
        return {"pixel_values": (x - mean) / std}


class Attention(nn.Module):
    """Multi-head self-attention over the whole sequence (no mask): fused qkv, then SDPA."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        assert n_embd % n_head == 0
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)  # [B, heads, T, hs]
        return self.proj(out.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """Pre-norm: LayerNorm first, then the sublayer, then the residual add."""

    def __init__(self, config: Config):
        super().__init__()
        d = config.n_embd
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, config.n_head)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(
            nn.Linear(d, config.mlp_ratio * d), nn.GELU(), nn.Linear(config.mlp_ratio * d, d)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class VisionTransformer(nn.Module):
    """forward(pixel_values [B, 3, 64, 64]) -> logits [B, n_classes] (read off the class token)."""

    name = NAME
    is_encoder_decoder = False
    tokenizer = None  # it reads pictures: `processor` makes its inputs

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        d, p = config.n_embd, config.patch_size
        self.grid = config.image_size // p
        self.context_length = 1 + config.n_registers + self.grid**2
        self.processor = ImageProcessor(config.image_size, config.image_mean, config.image_std)
        self.patch_embed = nn.Conv2d(config.channels, d, kernel_size=p, stride=p)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.register_tokens = nn.Parameter(torch.zeros(1, config.n_registers, d))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.context_length, d))
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, config.n_classes)
        for t in (self.cls_token, self.register_tokens, self.pos_embed):
            nn.init.trunc_normal_(t, std=0.02)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        size = self.config.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (self.config.channels, size, size):
            raise ValueError(
                f"{NAME}: pixel_values of {list(pixel_values.shape)}; it takes [batch, "
                f"{self.config.channels}, {size}, {size}] (use model.processor on pictures)"
            )
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)  # [B, grid*grid, d]
        B = x.shape[0]
        prefix = torch.cat([self.cls_token, self.register_tokens], dim=1).expand(B, -1, -1)
        x = torch.cat([prefix, x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x[:, 0]))

    @torch.no_grad()
    def classify(self, images) -> list[str]:
        """The class name of each picture (PIL images, arrays or [3, H, W] tensors in [0, 1])."""
        logits = self(self.processor(images=images, return_tensors="pt")["pixel_values"])
        return [shapes.CLASSES[i] for i in logits.argmax(-1).tolist()]


def build(config: Config | None = None) -> VisionTransformer:
    """An untrained model (weights from the global RNG)."""
    return VisionTransformer(config or Config())


def from_config(config: dict) -> VisionTransformer:
    """An untrained model shaped by a checkpoint's config dict (load_state_dict comes next)."""
    return build(Config(**config))


def normalise(images: torch.Tensor, config: Config) -> torch.Tensor:
    """Generated pictures ``[n, 3, H, W]`` in [0, 1] as ``pixel_values`` (what the processor does
    to pictures already at the model's size)."""
    mean = torch.tensor(config.image_mean).view(1, -1, 1, 1)
    std = torch.tensor(config.image_std).view(1, -1, 1, 1)
    return (images - mean) / std


@torch.no_grad()
def accuracy(model: VisionTransformer, n: int = 600, seed: int = 10_000) -> float:
    """The share of ``n`` held-out generated pictures (``seed`` far from the training seeds)
    whose class the model names."""
    data = shapes.generate(n, size=model.config.image_size, seed=seed)
    logits = model(normalise(data.images, model.config))
    return float((logits.argmax(-1) == data.labels).float().mean())


def train(
    config: Config | None = None,
    *,
    steps: int = 3000,
    seed: int = 2026,
    lr: float = 2e-3,
    batch_size: int = 64,
    warmup: int = 100,
    weight_decay: float = 0.05,
    log: Callable[[str], None] | None = None,
    log_every: int = 100,
    progress: bool = False,
) -> tuple[VisionTransformer, TrainStats]:
    """AdamW with linear warm-up and cosine decay; each step a fresh batch of generated pictures
    (batch ``i`` from seed ``seed * 100_000 + i``). Returns (model in eval mode, stats).

    Deterministic: ``seed`` draws the initial weights; the data depend only on the step.
    """
    if isinstance(config, dict):
        config = Config(**config)
    config = config or Config()
    losses = []
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build(config)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

        def rate(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (
                1 + torch.cos(torch.tensor((step - warmup) / max(1, steps - warmup) * torch.pi)).item()
            )

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
        for step in tqdm(range(1, steps + 1), desc=NAME, disable=not progress):
            data = shapes.generate(batch_size, size=config.image_size, seed=seed * 100_000 + step)
            loss = F.cross_entropy(model(normalise(data.images, config)), data.labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            if log and (step % log_every == 0 or step == 1):
                log(f"step {step:5d} | loss {losses[-1]:.4f}")
    seconds = time.perf_counter() - t0
    model.eval()
    recipe = {
        "seed": seed,
        "optimizer": "AdamW",
        "lr": lr,
        "weight_decay": weight_decay,
        "warmup": warmup,
        "schedule": "linear warm-up, cosine decay",
        "batch_size": batch_size,
        "steps": steps,
        "data": "models.shapes.generate(batch_size, seed=seed * 100000 + step)",
    }
    stats = TrainStats(losses[-1] if losses else None, steps, seconds, recipe, losses)
    return model, stats
