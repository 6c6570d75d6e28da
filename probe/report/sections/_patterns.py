"""Attention patterns packed for the page: quantised, deflated, base64 (decoded by report.js).

Weights lie in [0, 1]; each is stored as ``round(w * scale)`` in uint16 (``scale = 65535``) when
the whole report holds few cells, else uint8 (``scale = 255``), so the page states every weight to
within half a quantisation step ``1 / scale``. Heads beyond :data:`FULL_BUDGET` cells are embedded
only as max-pooled thumbnails (the overview stays complete; the explorer says which heads are
downsampled), which keeps a 12 x 12-head model at T = 128 well under 5 MB.
"""

from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from probe.cache import Cache
from probe.report.sections._tokens import batch_size, query_key_sides, real_positions, side_tokens

FULL_BUDGET = 16 * 2**20  # cells embedded at full resolution, over the whole report (uint8)
U16_BUDGET = 5 * 2**19  # up to this many cells the page uses uint16 (step 1/65535)
THUMB = 64  # overview thumbnails of downsampled heads are at most THUMB x THUMB


@dataclass
class PatternSet:
    """All heads of one pattern kind (e.g. decoder self-attention) for one text of one cache."""

    cache: Cache
    cache_index: int
    batch: int
    stack: str
    kind: str
    layers: list[int]
    n_heads: int
    q_tokens: list[str]
    k_tokens: list[str]
    q_pos: list[int]
    k_pos: list[int]
    head_labels: list[int] = field(default_factory=list)

    @property
    def cells(self) -> int:
        return len(self.layers) * self.n_heads * len(self.q_pos) * len(self.k_pos)

    def label(self, multi_cache: bool, multi_text: bool) -> str:
        parts = []
        if multi_cache:
            parts.append(f"cache {self.cache_index + 1}")
        if multi_text:
            parts.append(f"text {self.batch + 1}")
        parts.append(f"{self.stack} {'cross-' if self.kind == 'cross' else 'self-'}attention")
        return ", ".join(parts)

    def head(self, li: int) -> torch.Tensor:
        """Layer index ``li`` (into ``layers``): ``[head, query, key]`` float32, real tokens only."""
        p = self.cache.pattern(self.stack, self.layers[li], self.kind, batch=self.batch).float()
        return p[:, self.q_pos][:, :, self.k_pos]


def pattern_sets(caches: list[Cache], kinds: tuple[str, ...]) -> list[PatternSet]:
    """The pattern sets of ``kinds`` (``"self"``/``"cross"``) in every cache and text, in order."""
    sets = []
    for ci, cache in enumerate(caches):
        heads_meta = cache.metadata.get("heads_captured")
        for b in range(batch_size(cache)):
            for stack in cache.stacks:
                for kind in kinds:
                    name = f"{kind}_attn.pattern"
                    keys = [k for k in cache.keys() if k.startswith(f"{stack}.") and k.endswith(name)]
                    layers = sorted({int(k.split(".")[2]) for k in keys})
                    if not layers:
                        continue
                    shape = cache.shape(f"{stack}.blocks.{layers[0]}.{name}")
                    qs, ks = query_key_sides(cache, stack, kind)
                    q_tok, q_mask = side_tokens(cache, b, qs)
                    k_tok, k_mask = side_tokens(cache, b, ks)
                    q_pos = real_positions(q_mask, len(q_tok), shape[2])
                    k_pos = real_positions(k_mask, len(k_tok), shape[3])
                    q_tok = q_tok or [str(i) for i in q_pos]
                    k_tok = k_tok or [str(i) for i in k_pos]
                    labels = list(range(shape[1]))
                    if heads_meta and len(heads_meta) == shape[1]:
                        labels = list(heads_meta)
                    toks = (q_tok, k_tok, q_pos, k_pos)
                    sets.append(PatternSet(cache, ci, b, stack, kind, layers, shape[1], *toks, labels))
    return sets


def _b64_deflate(raw: bytes) -> str:
    return base64.b64encode(zlib.compress(raw, 6)).decode("ascii")


def quantise(p: torch.Tensor, scale: int) -> bytes:
    """``p`` (weights in [0, 1]) as little-endian uint8/uint16 bytes of ``round(p * scale)``."""
    q = (p.clamp(0, 1).nan_to_num(0.0) * scale).round()
    if scale == 255:
        return q.to(torch.uint8).contiguous().numpy().tobytes()
    return q.to(torch.int32).numpy().astype("<u2").tobytes()


def thumbnail(p: torch.Tensor, size: int = THUMB) -> torch.Tensor:
    """``p`` ``[..., q, k]`` max-pooled to at most ``size`` x ``size`` (adaptive blocks)."""
    tq, tk = min(p.shape[-2], size), min(p.shape[-1], size)
    lead = p.shape[:-2]
    flat = p.reshape(-1, 1, p.shape[-2], p.shape[-1])
    return F.adaptive_max_pool2d(flat, (tq, tk)).reshape(*lead, tq, tk)


def pack(sets: list[PatternSet], progress=None, budget: int = FULL_BUDGET) -> tuple[list[dict], dict]:
    """The JSON-ready description of ``sets`` and the page-wide encoding facts.

    Each set gets ``full``: base64 deflate of ``[n_full, q, k]`` quantised weights for its first
    ``n_full`` heads (layer-major), and, when some heads do not fit the budget, ``thumbs``: the
    rest as max-pooled uint8 thumbnails ``[n_rest, tq, tk]``.
    """
    total = sum(s.cells for s in sets)
    scale = 65535 if total <= U16_BUDGET else 255
    left = budget
    out = []
    for s in sets:
        if progress is not None:
            progress(s.label(True, True))
        nq, nk = len(s.q_pos), len(s.k_pos)
        per_head = nq * nk
        n_heads = len(s.layers) * s.n_heads
        n_full = min(n_heads, max(0, left // per_head)) if per_head else n_heads
        left -= n_full * per_head
        full, thumbs = [], []
        for li in range(len(s.layers)):
            p = s.head(li)
            for h in range(s.n_heads):
                if li * s.n_heads + h < n_full:
                    full.append(quantise(p[h], scale))
                else:
                    thumbs.append(thumbnail(p[h]))
        entry = {
            "stack": s.stack,
            "kind": s.kind,
            "layers": s.layers,
            "heads": s.head_labels,
            "nq": nq,
            "nk": nk,
            "qTokens": s.q_tokens,
            "kTokens": s.k_tokens,
            "nFull": n_full,
            "full": _b64_deflate(b"".join(full)),
            "thumbs": None,
        }
        if thumbs:
            t = torch.stack(thumbs)
            entry["thumbs"] = _b64_deflate(quantise(t, 255))
            entry["tq"], entry["tk"] = t.shape[-2], t.shape[-1]
        out.append(entry)
    multi_cache = len({s.cache_index for s in sets}) > 1
    multi_text = len({(s.cache_index, s.batch) for s in sets}) > len({s.cache_index for s in sets})
    for e, s in zip(out, sets, strict=True):
        e["label"] = s.label(multi_cache, multi_text)
    return out, {"scale": scale, "bytes": 1 if scale == 255 else 2, "total": total}


def colour_lut(name: str = "viridis") -> str:
    """A 256-entry colour map as a hex string of RGB bytes (matplotlib's ``name``)."""
    import matplotlib
    import numpy as np

    rgb = (matplotlib.colormaps[name](np.linspace(0, 1, 256))[:, :3] * 255).round().astype("uint8")
    return rgb.tobytes().hex()
