"""Caches for the report tests, written here (the patterns are the tests' own oracle).

``synthetic`` builds a :class:`probe.Cache` directly from softmax patterns computed in this file,
with whatever tokens a test needs (hostile HTML, Chinese), so every number the report shows can
be checked against the tensor the test wrote.
"""

from __future__ import annotations

import torch

import probe

HOSTILE = "<img src=x onerror=alert(1)>"
SCRIPT_END = "</script><script>alert(2)</script>"
CHINESE = ["注意", "力", "机制", "让", "词元"]


def softmax_patterns(
    n_layers: int,
    n_heads: int,
    nq: int,
    nk: int,
    *,
    seed: int = 0,
    causal: bool = True,
    sharpness: float = 2.0,
) -> torch.Tensor:
    """``[layer, head, query, key]`` rows that sum to 1 (causal: zero above the diagonal)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_layers, n_heads, nq, nk, generator=g) * sharpness
    if causal:
        logits = logits.masked_fill(torch.ones(nq, nk, dtype=torch.bool).triu(1), float("-inf"))
    return logits.softmax(-1)


def synthetic(
    tokens: list[str],
    *,
    n_layers: int = 2,
    n_heads: int = 3,
    seed: int = 0,
    name: str = "toy",
    text: str | None = None,
    resid: bool = False,
    sharpness: float = 2.0,
) -> probe.Cache:
    """A decoder-only cache of one text with ``tokens``; patterns from :func:`softmax_patterns`."""
    T = len(tokens)
    p = softmax_patterns(n_layers, n_heads, T, T, seed=seed, sharpness=sharpness)
    tensors = {f"decoder.blocks.{layer}.self_attn.pattern": p[layer][None] for layer in range(n_layers)}
    if resid:
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(1, T, 8, generator=g)
        for layer in range(n_layers):
            a, m = torch.randn(1, T, 8, generator=g), torch.randn(1, T, 8, generator=g)
            tensors[f"decoder.blocks.{layer}.resid_pre"] = x
            tensors[f"decoder.blocks.{layer}.self_attn.delta"] = a
            tensors[f"decoder.blocks.{layer}.mlp.delta"] = m
            x = x + a + m
            tensors[f"decoder.blocks.{layer}.resid_post"] = x
    meta = {
        "texts": [text if text is not None else "".join(tokens)],
        "tokens": [list(tokens)],
        "attention_mask": [[1] * T],
        "model": {"name": name, "class": "tests.Synthetic", "parameters": 0, "config": {}},
        "dtype": "float32",
        "stacks": {"decoder": {"layers": n_layers}},
        "layers": [
            {
                "stack": "decoder",
                "layer": i,
                "module": f"h.{i}",
                "self_attn": {"impl": ["softmax"], "heads": n_heads},
            }
            for i in range(n_layers)
        ],
        "attention_implementations": ["softmax"],
    }
    return probe.Cache(tensors, meta)


def hostile() -> probe.Cache:
    """Tokens that would run script if a report inserted them as HTML; the model name too."""
    return synthetic(["a", HOSTILE, "b", SCRIPT_END, "&amp;", "c"], name=HOSTILE, text=HOSTILE + SCRIPT_END)


def chinese() -> probe.Cache:
    """Chinese tokens (several characters each and single characters)."""
    return synthetic(CHINESE, name="中文模型")


SOURCE = ["ich", "mochte", "ein", "bier"]
TARGET = ["S", "i", "want", "a", "beer"]


def encoder_decoder() -> probe.Cache:
    """A tiny ``nn.Transformer`` (2 + 2 layers, 2 heads) traced on random embeddings, with the
    German source and English target tokens as metadata: rectangular 5 x 4 cross-attention."""
    torch.manual_seed(0)
    mt = torch.nn.Transformer(16, 2, 2, 2, 32, dropout=0.0, batch_first=True).eval()
    meta = {
        "tokens": [SOURCE],
        "target_tokens": [TARGET],
        "texts": [" ".join(SOURCE)],
        "target_texts": [" ".join(TARGET)],
    }
    with probe.trace(mt, metadata=meta) as t:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(5)
        mt(torch.randn(1, 4, 16), torch.randn(1, 5, 16), tgt_mask=mask, tgt_is_causal=True)
    return t.cache
