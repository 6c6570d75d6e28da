"""Which tokens label which axis, which positions are real, and how labels stay legible.

A pattern ``[query, key]`` of a cache row has padding positions (``attention_mask`` 0) that
figures crop. For encoder-decoders the decoder stack's queries (and its self-attention keys) are
the target tokens; cross-attention keys are the source tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from probe.errors import ProbeError

MAX_LABEL_CHARS = 12


@dataclass(frozen=True)
class Side:
    """One axis of a pattern: the real positions (indices into the cached axis) and their tokens."""

    positions: np.ndarray  # int, [n_real]
    tokens: list[str]  # len n_real


def _side(meta: dict, target: bool, batch: int, length: int) -> Side:
    prefix = "target_" if target else ""
    tokens = meta.get(f"{prefix}tokens") or []
    masks = meta.get(f"{prefix}attention_mask") or []
    if batch < len(masks) and len(masks[batch]) == length:
        positions = np.flatnonzero(np.asarray(masks[batch]) != 0)
    else:
        positions = np.arange(length)
    row = list(tokens[batch]) if batch < len(tokens) else []
    if len(row) != len(positions):  # no (or inconsistent) token metadata: label by position
        row = [str(int(p)) for p in positions]
    return Side(positions, row)


def sides(meta: dict, stack: str, kind: str, batch: int, shape: tuple[int, int]) -> tuple[Side, Side]:
    """(query side, key side) for a pattern of ``shape`` = (queries, keys) in ``stack``/``kind``.

    Decoder queries are target tokens when the cache has ``target_tokens`` (an encoder-decoder);
    cross-attention keys are then the source tokens.
    """
    n_texts = len(meta.get("tokens") or []) or None
    if n_texts is not None and not 0 <= batch < n_texts:
        raise ProbeError(f"batch {batch} is out of range: the cache holds {n_texts} text(s)")
    encdec = meta.get("target_tokens") is not None
    q_target = encdec and stack == "decoder"
    k_target = q_target and kind == "self"
    return _side(meta, q_target, batch, shape[0]), _side(meta, k_target, batch, shape[1])


def display(token: str) -> str:
    """A token as a tick label: whitespace made visible, long tokens shortened."""
    if token == "":
        return "∅"
    shown = token.replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍")
    if shown.strip() == "":
        shown = "␣" * len(shown)
    if len(shown) > MAX_LABEL_CHARS:
        shown = shown[: MAX_LABEL_CHARS - 1] + "…"
    return shown


def font_size(n: int) -> float:
    """Tick label size (points) for an axis of ``n`` labels."""
    return 9.0 if n <= 32 else 8.0 if n <= 64 else 7.0 if n <= 128 else 6.0


def step(n: int, length_pt: float, size_pt: float) -> int:
    """Show every ``step``-th of ``n`` labels so that they fit ``length_pt`` points of axis."""
    if n <= 1 or length_pt <= 0:
        return 1
    return max(1, math.ceil(n * size_pt * 1.3 / length_pt))


__all__ = ["Side", "sides", "display", "font_size", "step"]
