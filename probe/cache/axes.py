"""A pattern's two axes: which token side its queries and keys come from, which positions are real.

A pattern ``[batch, head, query, key]`` of one text has padding positions (``attention_mask`` 0)
that figures, the report and exports leave out. For encoder-decoders the decoder stack's queries
(and its self-attention keys) are the target tokens; cross-attention keys are the source tokens.
Everything here reads the cache's JSON metadata only; :class:`probe.Cache` exposes it as
:meth:`~probe.Cache.axes`, :meth:`~probe.Cache.head_pattern` and friends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SOURCE, TARGET = "source", "target"


@dataclass(frozen=True)
class Axis:
    """One axis of a pattern for one text.

    ``positions``: indices into the cached axis of the real (unpadded) tokens, ascending;
    ``tokens``: their display strings, one per position (position numbers when the cache holds no
    consistent tokens); ``side``: ``"source"`` (the input text) or ``"target"`` (an
    encoder-decoder's decoder text).
    """

    positions: list[int]
    tokens: list[str]
    side: str = SOURCE


def is_encoder_decoder(meta: Mapping[str, Any], stacks: list[str]) -> bool:
    """Whether the captured model has an encoder and a decoder (from the metadata or the keys)."""
    return (
        meta.get("target_tokens") is not None
        or meta.get("target_ids") is not None
        or "encoder" in (meta.get("stacks") or {})
        or "encoder" in stacks
    )


def sides(meta: Mapping[str, Any], stacks: list[str], stack: str, kind: str) -> tuple[str, str]:
    """``(query side, key side)`` of a ``stack``/``kind`` pattern: ``"source"`` or ``"target"``."""
    if stack != "decoder" or not is_encoder_decoder(meta, stacks):
        return SOURCE, SOURCE
    return TARGET, (SOURCE if kind == "cross" else TARGET)


def n_texts(meta: Mapping[str, Any]) -> int | None:
    """The number of texts the metadata describes (None when it holds no tokens)."""
    n = len(meta.get("tokens") or [])
    return n or None


def axis(meta: Mapping[str, Any], side: str, batch: int, length: int) -> Axis:
    """The real positions and tokens of text ``batch`` on ``side`` for an axis of ``length``.

    Positions come from the side's attention mask when it has one entry per position, else every
    position is real. Tokens are the side's tokens when there is one per real position, else the
    position numbers (a cache without, or with inconsistent, token metadata).
    """
    prefix = "target_" if side == TARGET else ""
    masks = meta.get(f"{prefix}attention_mask") or []
    mask = list(masks[batch]) if batch < len(masks) else []
    positions = [i for i, m in enumerate(mask) if m] if len(mask) == length else list(range(length))
    rows = meta.get(f"{prefix}tokens") or []
    tokens = [str(t) for t in rows[batch]] if batch < len(rows) else []
    if len(tokens) != len(positions):
        tokens = [str(p) for p in positions]
    return Axis(positions, tokens, side)


__all__ = ["Axis", "axis", "sides", "is_encoder_decoder", "n_texts", "SOURCE", "TARGET"]
