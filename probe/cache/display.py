"""How a :class:`probe.Cache` shows itself in a notebook: a static HTML summary with a thumbnail.

The thumbnail is a PNG written here with the standard library (zlib and a CRC), so the cache
package needs no plotting library: a greyscale-to-blue ramp of the first pattern, max-pooled to at
most 96 x 96 cells so a single strong weight stays visible.
"""

from __future__ import annotations

import base64
import html
import struct
import zlib
from typing import Any

import torch
import torch.nn.functional as F

THUMB = 96  # cells per side at most
# the ramp's ends: white for weight 0, matplotlib's "Blues" darkest blue (#08306b) for weight 1
_LOW, _HIGH = (255, 255, 255), (8, 48, 107)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_rgb(rgb: torch.Tensor) -> bytes:
    """A PNG file of ``rgb``, a uint8 tensor ``[height, width, 3]`` (8-bit truecolour, no alpha)."""
    h, w, _ = rgb.shape
    rows = torch.cat([torch.zeros(h, 1, dtype=torch.uint8), rgb.reshape(h, 3 * w)], dim=1)  # filter 0
    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(rows.contiguous().numpy().tobytes(), 6))
        + _chunk(b"IEND", b"")
    )


def ramp(weights: torch.Tensor) -> torch.Tensor:
    """``weights`` in [0, 1] ``[q, k]`` as uint8 RGB ``[q, k, 3]`` on the white-to-blue ramp."""
    x = weights.float().nan_to_num(0.0).clamp(0, 1)[..., None]
    low, high = torch.tensor(_LOW, dtype=torch.float32), torch.tensor(_HIGH, dtype=torch.float32)
    return (low + (high - low) * x).round().to(torch.uint8)


def thumbnail_uri(pattern: torch.Tensor) -> str:
    """One head's pattern ``[q, k]`` as a max-pooled ``data:image/png`` URI (at most 96 x 96)."""
    p = pattern.float().cpu()
    p = F.adaptive_max_pool2d(p[None, None], (min(p.shape[0], THUMB), min(p.shape[1], THUMB)))[0, 0]
    return "data:image/png;base64," + base64.b64encode(png_rgb(ramp(p))).decode("ascii")


def _first_pattern(cache: Any) -> tuple[str, torch.Tensor] | None:
    first = next((k for k in cache.keys() if k.endswith("attn.pattern")), None)
    if first is None:
        return None
    p = cache[first][0, 0]
    n = len(cache.tokens[0]) if cache.tokens and p.shape[0] == p.shape[1] else None
    return first, (p[:n, :n] if n else p)


def repr_html(cache: Any) -> str:
    """A static summary of ``cache``: model, per-stack layers and heads, the tokens, and a
    thumbnail of the first pattern (inline PNG). No scripts, no network; every string from the
    model or the user is escaped."""
    esc = html.escape
    meta = cache.metadata
    model = meta.get("model") or {}
    params = model.get("parameters")
    rows = [
        (
            "model",
            f"<b>{esc(str(model.get('name', '?')))}</b> <code>{esc(str(model.get('class', '?')))}</code>"
            + (f", {params:,} parameters" if isinstance(params, int) else ""),
        ),
        (
            "stored",
            f"{len(cache)} tensors, {esc(str(meta.get('dtype', '?')))}"
            + (f", <code>{esc(str(cache.path))}</code>" if cache.path else ""),
        ),
    ]
    for s in cache.stacks:
        heads = sorted(
            {e.get("self_attn", {}).get("heads") for e in meta.get("layers", []) if e.get("stack") == s}
            - {None}
        )
        rows.append((s, f"{cache.n_layers(s)} layers, {', '.join(map(str, heads)) or '?'} heads"))
    tok_style = "border:1px solid #ccc;border-radius:3px;padding:0 3px;margin:1px;white-space:pre"

    def strip(toks: list[str]) -> str:
        shown = "".join(f'<span style="{tok_style}">{esc(t)}</span>' for t in toks[:64])
        return shown + (f" … ({len(toks)} tokens)" if len(toks) > 64 else "")

    for i, toks in enumerate(cache.tokens[:4]):
        rows.append((f"text {i}", strip(toks)))
        if cache.target_tokens:
            rows.append(("target", strip(cache.target_tokens[i])))
    img = ""
    first = _first_pattern(cache)
    if first is not None:
        key, p = first
        img = (
            f'<figure style="margin:0 0 0 1em"><img src="{thumbnail_uri(p)}" alt="attention pattern" '
            f'style="width:128px;image-rendering:pixelated;border:1px solid #ccc">'
            f'<figcaption style="font-size:11px">{esc(key)}, head 0</figcaption></figure>'
        )
    body = "".join(
        f'<tr><th style="text-align:left;padding-right:1em">{esc(k)}</th>'
        f'<td style="text-align:left">{v}</td></tr>'
        for k, v in rows
    )
    return (
        f'<div style="display:flex;align-items:flex-start"><table><caption style="text-align:left">'
        f"probe.Cache</caption>{body}</table>{img}</div>"
    )
