"""What each generated token of an encoder-decoder read of the source: its cross-attention rows.

The decoder's row that wrote generated token ``t`` attends over the source through each layer's
cross-attention; :func:`source_reads` keeps, per layer, head and step, the ``top`` source tokens
it read most (and the same over each layer's head mean, and over every layer and head): the
alignment as it was written, read the way :func:`probe.lookback` reads the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from probe.analysis.generation.rows import writer_rows
from probe.analysis.generation.steps import Steps


@dataclass
class SourceReads:
    """``layers``: the decoder layers with cross-attention; ``positions``/``tokens``: the
    source's real positions and tokens; ``index``/``weight`` ``[layer, head, step, k]``,
    ``mean_index``/``mean_weight`` ``[layer, step, k]`` (each layer's head mean) and
    ``all_index``/``all_weight`` ``[step, k]`` (every layer and head): source positions read most
    and their weights (``-1``/NaN where fewer are known)."""

    layers: list[int]
    positions: list[int]
    tokens: list[str]
    index: torch.Tensor
    weight: torch.Tensor
    mean_index: torch.Tensor
    mean_weight: torch.Tensor
    all_index: torch.Tensor
    all_weight: torch.Tensor


def _top(w: torch.Tensor, k: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    vals, idx = torch.nan_to_num(w, nan=float("-inf")).topk(k, dim=-1)
    known = torch.isfinite(vals)
    return torch.where(known, positions[idx], -1), torch.where(known, vals, float("nan"))


def source_reads(cache: Any, st: Steps, layers: list[int], top: int) -> SourceReads | None:
    """The source tokens each generated token read most through ``layers``' cross-attention
    (None when there is none)."""
    if not layers:
        return None
    _, src = cache.axes(st.stack, "cross", st.batch)
    pos = torch.tensor(src.positions, dtype=torch.long)
    k = min(top, len(src.positions))
    index, weight, mean_index, mean_weight, total = [], [], [], [], None
    for layer in layers:
        r = writer_rows(cache, st, layer, "cross")[:, :, pos]  # [H, N, S]
        i, w = _top(r, k, pos)
        index.append(i)
        weight.append(w)
        mean = r.mean(0)
        i, w = _top(mean, k, pos)
        mean_index.append(i)
        mean_weight.append(w)
        total = mean if total is None else total + mean
    all_index, all_weight = _top(total / len(layers), k, pos)
    return SourceReads(
        list(layers),
        list(src.positions),
        list(src.tokens),
        torch.stack(index),
        torch.stack(weight),
        torch.stack(mean_index),
        torch.stack(mean_weight),
        all_index,
        all_weight,
    )


__all__ = ["SourceReads", "source_reads"]
