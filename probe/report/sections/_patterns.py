"""Attention patterns packed for the page: quantised, deflated, base64 (decoded by report.js).

Weights lie in [0, 1]; each is stored as ``round(w * scale)`` in uint16 (``scale = 65535``) when
the whole report holds few cells and they compress well, else uint8 (``scale = 255``), so the page
states every weight to within half a quantisation step ``1 / scale``. Heads beyond the budgets
(:data:`FULL_BUDGET` cells, :data:`FULL_BYTES` compressed bytes) are embedded only as max-pooled
thumbnails (the overview stays complete; the explorer says which heads are downsampled), so
the page stays under about 5 MB at any length, and one head is always exact.
"""

from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from probe.cache import Cache
from probe.report.labels import display

FULL_BUDGET = 16 * 2**20  # cells embedded at full resolution, over the whole report
FULL_BYTES = 3 * 2**20  # compressed bytes of full-resolution heads, over the whole report
U16_BUDGET = 5 * 2**19  # up to this many cells the page tries uint16 (step 1/65535) ...
U16_BYTES = 2 * 2**20  # ... and keeps it if it compresses to at most this many bytes
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
    layer_heads: list[list[int]]  # the model's head number of each head of each layer (own count)
    q_tokens: list[str]
    k_tokens: list[str]
    q_pos: list[int]
    k_pos: list[int]
    by: str = "weight"  # or "contribution": each row renormalised to sum 1, shown like weights

    @property
    def head_labels(self) -> list[int]:
        """The overview's columns: every head number some layer has, ascending (layers may differ)."""
        return sorted({h for heads in self.layer_heads for h in heads})

    @property
    def n_heads(self) -> int:
        """How many heads the set holds, over all its layers."""
        return sum(len(heads) for heads in self.layer_heads)

    @property
    def cells(self) -> int:
        return self.n_heads * len(self.q_pos) * len(self.k_pos)

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
        p = self.cache.pattern(self.stack, self.layers[li], self.kind, batch=self.batch, by=self.by).float()
        p = p[:, self.q_pos][:, :, self.k_pos]
        if self.by == "weight":
            return p
        total = p.sum(-1, keepdim=True)
        return torch.where(total > 0, p / total.clamp_min(1e-30), p)


def pattern_sets(caches: list[Cache], kinds: tuple[str, ...], by: str = "weight") -> list[PatternSet]:
    """The pattern sets of ``kinds`` (``"self"``/``"cross"``) in every cache and text, in order;
    ``by="contribution"``: the layers holding contributions, read as such (rows renormalised)."""
    sets = []
    for ci, cache in enumerate(caches):
        for b in range(cache.n_texts):
            for stack in cache.stacks:
                for kind in kinds:
                    layers = cache.pattern_layers(stack, kind)
                    if by != "weight":
                        layers = [i for i in layers if f"{stack}.blocks.{i}.{kind}_attn.{by}" in cache]
                    if not layers:
                        continue
                    q, k = cache.axes(stack, kind, b)
                    heads = [cache.head_ids(stack, layer, kind) for layer in layers]  # each layer's own
                    # tokens as everything probe draws shows them (whitespace visible: ␣ ↵ ⇥)
                    shown = [display(t, None) for t in q.tokens], [display(t, None) for t in k.tokens]
                    toks = (*shown, q.positions, k.positions)
                    sets.append(PatternSet(cache, ci, b, stack, kind, layers, heads, *toks, by))
    return sets


def _b64_deflate(raw: bytes) -> str:
    return base64.b64encode(zlib.compress(raw, 6)).decode("ascii")


def quantise(p: torch.Tensor, scale: int) -> bytes:
    """``p`` (weights in [0, 1]) as little-endian uint8/uint16 bytes of ``round(p * scale)``."""
    # float64, so the rounding error is the quantisation's alone (<= 0.5 / scale)
    q = (p.double().clamp(0, 1).nan_to_num(0.0) * scale).round()
    if scale == 255:
        return q.to(torch.uint8).contiguous().numpy().tobytes()
    return q.to(torch.int32).numpy().astype("<u2").tobytes()


def thumbnail(p: torch.Tensor, size: int = THUMB) -> torch.Tensor:
    """``p`` ``[..., q, k]`` max-pooled to at most ``size`` x ``size`` (adaptive blocks)."""
    tq, tk = min(p.shape[-2], size), min(p.shape[-1], size)
    lead = p.shape[:-2]
    flat = p.reshape(-1, 1, p.shape[-2], p.shape[-1])
    return F.adaptive_max_pool2d(flat, (tq, tk)).reshape(*lead, tq, tk)


class _Packer:
    """Deflates heads one by one, tracking the compressed size so far (a sync flush per head)."""

    def __init__(self) -> None:
        self.z = zlib.compressobj(6)
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, raw: bytes) -> int:
        out = self.z.compress(raw) + self.z.flush(zlib.Z_SYNC_FLUSH)
        self.parts.append(out)
        self.size += len(out)
        return len(out)

    def finish(self) -> str:
        self.parts.append(self.z.flush())
        return base64.b64encode(b"".join(self.parts)).decode("ascii")


def _pack(sets: list[PatternSet], scale: int, progress, cells: int, nbytes: int) -> tuple[list[dict], int]:
    left_cells, used = cells, 0
    out = []
    for s in sets:
        if progress is not None:
            progress(s.label(True, True))
        nq, nk = len(s.q_pos), len(s.k_pos)
        per_head = nq * nk
        full, thumbs, n_full, room = _Packer(), [], 0, True
        last = per_head * (1 if scale == 255 else 2)  # predicted compressed size of the next head
        for li in range(len(s.layers)):
            p = s.head(li)
            for h in range(len(s.layer_heads[li])):
                # The first head of the report always fits: one head is explorable at any length.
                fits = per_head <= left_cells and used + last <= nbytes
                if room and (fits or (used == 0 and n_full == 0)):
                    last = full.add(quantise(p[h], scale))
                    used += last
                    left_cells -= per_head
                    n_full += 1
                else:
                    room = False  # keep full heads a prefix (layer-major), the rest thumbnails
                    thumbs.append(thumbnail(p[h]))
        entry = {
            "stack": s.stack,
            "kind": s.kind,
            "layers": s.layers,
            "heads": s.head_labels,
            "layerHeads": s.layer_heads,
            "nq": nq,
            "nk": nk,
            "qTokens": s.q_tokens,
            "kTokens": s.k_tokens,
            "nFull": n_full,
            "full": full.finish(),
            "thumbs": None,
        }
        if thumbs:
            t = torch.stack(thumbs)
            entry["thumbs"] = _b64_deflate(quantise(t, 255))
            entry["tq"], entry["tk"] = t.shape[-2], t.shape[-1]
        out.append(entry)
    return out, used


def pack(
    sets: list[PatternSet], progress=None, *, cells: int = FULL_BUDGET, nbytes: int = FULL_BYTES
) -> tuple[list[dict], dict]:
    """The JSON-ready description of ``sets`` and the page-wide encoding facts.

    Each set gets ``layerHeads``: each layer's own heads (the model's numbers; layers may have
    different counts), ``heads``: the overview's columns (every number some layer has), ``full``:
    base64 deflate of ``[n_full, q, k]`` quantised weights for its first ``n_full`` heads
    (layer-major, each layer's own heads only), and, when the rest do not fit ``cells`` cells or ``nbytes``
    compressed bytes, ``thumbs``: those as max-pooled uint8 thumbnails ``[n_rest, tq, tk]``.
    uint16 is used when it fits in :data:`U16_BYTES`, else uint8.
    """
    total = sum(s.cells for s in sets)
    scale = 65535 if total <= U16_BUDGET else 255
    out, used = _pack(sets, scale, progress, cells, nbytes)
    if scale == 65535 and (used > U16_BYTES or any(e["thumbs"] for e in out)):
        scale = 255
        out, used = _pack(sets, scale, progress, cells, nbytes)
    multi_cache = len({s.cache_index for s in sets}) > 1
    multi_text = len({(s.cache_index, s.batch) for s in sets}) > len({s.cache_index for s in sets})
    for e, s in zip(out, sets, strict=True):
        e["label"] = s.label(multi_cache, multi_text)
    return out, {"scale": scale, "bytes": 1 if scale == 255 else 2, "total": total, "compressed": used}


def colour_lut(name: str = "viridis") -> str:
    """A 256-entry colour map as a hex string of RGB bytes (matplotlib's ``name``)."""
    import matplotlib
    import numpy as np

    rgb = (matplotlib.colormaps[name](np.linspace(0, 1, 256))[:, :3] * 255).round().astype("uint8")
    return rgb.tobytes().hex()


def half_view(ctx, cache: Cache, key: str, kinds: tuple[str, ...], by: str = "weight") -> dict | None:
    """One head explorer of ``cache`` (``by`` weight or contribution) on half the page's budget,
    for the sections that show two in step (compare, weights and contributions)."""
    sets = pattern_sets([cache], kinds, by=by)
    if not sets:
        return None
    packed, enc = pack(sets, progress=ctx.progress, cells=FULL_BUDGET // 2, nbytes=FULL_BYTES // 2)
    return {
        "id": key,
        "data": {"sets": packed, "scale": enc["scale"], "bytes": enc["bytes"], "lut": colour_lut()},
        "scale": enc["scale"],
    }
