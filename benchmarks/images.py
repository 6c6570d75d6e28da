"""Benchmark: what an image capture costs against the plain forward, in one process.

Two models, random weights built from their configs (transformers' default attention, SDPA):

* ``vit``: a ViT-B/16-shaped ``ViTModel`` (12 layers, 12 heads, hidden 768) on one 224 x 224
  picture: 196 patches + [CLS] = 197 positions;
* ``llava``: a LLaVA-shaped ``LlavaForConditionalGeneration``: a CLIP ViT-L/14-shaped tower at
  336 px (24 layers, 16 heads, hidden 1024; 576 patches + [CLS]) and a language model of
  ``--lm-layers`` Llama layers (hidden 1024, 16 heads) over a text with the 576 image tokens and
  16 words: 592 positions. The language model is narrower than LLaVA-7B's (4096 wide, 32 layers)
  so that it fits and runs on a laptop CPU; the cost that capture adds grows with the patterns
  (heads x positions²), which are the real model's per layer.

It times ``plain`` (the forward under ``torch.no_grad()``) and ``capture``
(``probe.capture(model, inputs)``, the cache in memory) interleaved round-robin (the machine's
speed drifts: every repeat times both back to back) and prints the medians and the median over
rounds of capture / plain.

    python benchmarks/images.py                     # both models, 5 repeats
    python benchmarks/images.py --models vit --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import probe  # noqa: E402

IMAGE_TOKEN = 32000


def vit():
    import transformers as tf

    cfg = tf.ViTConfig(image_size=224, patch_size=16)  # the ViT-B/16 defaults: 12 x 12 heads, 768
    model = tf.ViTModel(cfg, add_pooling_layer=False).eval()
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    return model, {"pixel_values": x}


def llava(lm_layers: int):
    import transformers as tf

    vision = tf.CLIPVisionConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
        image_size=336, patch_size=14,
    )  # fmt: skip
    text = tf.LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=lm_layers, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=IMAGE_TOKEN + 64, max_position_embeddings=2048,
    )  # fmt: skip
    cfg = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    model = tf.LlavaForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(0)
    words = torch.randint(1, 1000, (16,), generator=g).tolist()
    ids = torch.tensor([words[:4] + [IMAGE_TOKEN] * 576 + words[4:]])
    x = torch.randn(1, 3, 336, 336, generator=g)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": x}


def once(mode: str, model, inputs) -> float:
    t0 = time.perf_counter()
    if mode == "plain":
        with torch.no_grad():
            model(**inputs)
    else:
        cache = probe.capture(model, inputs)
        del cache
    return time.perf_counter() - t0


def bench(name: str, model, inputs, repeats: int) -> dict:
    for mode in ("plain", "capture"):  # warm-up: first-call allocations and lazy imports
        once(mode, model, inputs)
    times: dict[str, list[float]] = {"plain": [], "capture": []}
    for _ in range(repeats):
        for mode in ("plain", "capture"):
            times[mode].append(once(mode, model, inputs))
    plain, cap = statistics.median(times["plain"]), statistics.median(times["capture"])
    # each round's capture over the plain forward timed just before it: the machine's drift
    # between rounds cancels
    paired = statistics.median(c / p for p, c in zip(times["plain"], times["capture"], strict=True))
    return {"model": name, "plain_s": plain, "capture_s": cap, "ratio": paired}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["vit", "llava"], choices=["vit", "llava"])
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per mode (default 5)")
    ap.add_argument("--lm-layers", type=int, default=4, help="llava: language model layers (default 4)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians of {args.repeats}")
    print(f"{'model':<32}{'plain':>10}{'capture':>10}{'ratio':>8}")
    for name in args.models:
        model, inputs = vit() if name == "vit" else llava(args.lm_layers)
        label = "ViT-B/16, 224 px, 197 tokens" if name == "vit" else "LLaVA-shaped, 576 image tokens"
        r = bench(name, model, inputs, args.repeats)
        print(f"{label:<32}{r['plain_s']:>9.3f}s{r['capture_s']:>9.3f}s{r['ratio']:>7.2f}x")
        del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
