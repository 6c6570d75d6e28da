"""Which stacks of a cache run over pictures: the one place analysis and report ask.

A capture of pictures records what each stack's positions are (``metadata["stacks"][stack]
["positions"]``, docs/cache-format.md): an image grid of the stack's own (``grid``: an image
model, a vision-language model's vision tower, one sequence per picture or tile) or a
vision-language text whose image tokens lie on grids (``rows``). The vision tower's sequences
are not the texts: a LLaVA runs one per picture (``image_shape``), Idefics3 one per tile
(``tiles``), Qwen2-VL one packed sequence for all (``image_grid_thw``).
"""

from __future__ import annotations

from typing import Any


def stack_positions(meta: dict[str, Any], stack: str) -> dict[str, Any] | None:
    """The recorded positions of ``stack``, None when it has none."""
    pos = ((meta.get("stacks") or {}).get(stack) or {}).get("positions")
    return pos if isinstance(pos, dict) else None


def picture_stacks(meta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(stack, positions)`` of each stack laid on pictures (a ``grid`` or a text's ``rows``),
    in the metadata's order."""
    out = []
    for s in meta.get("stacks") or {}:
        pos = stack_positions(meta, s)
        if pos is not None and (pos.get("grid") or pos.get("rows")):
            out.append((s, pos))
    return out


def _tower_batch(meta: dict[str, Any]) -> int | None:
    """Sequences of a vision tower that runs one per picture or tile; None otherwise."""
    if meta.get("image_shape"):
        return int(meta["image_shape"][0])
    if meta.get("tiles"):
        return len(meta["tiles"])
    return None


def picture_count(meta: dict[str, Any]) -> int | None:
    """How many sequences a vision tower runs: one per picture (``image_shape``) or tile
    (``tiles``), or Qwen2-VL's one packed sequence (``image_grid_thw``); None without pictures."""
    n = _tower_batch(meta)
    if n is not None:
        return n
    return 1 if meta.get("image_grid_thw") else None


def runs_over_pictures(meta: dict[str, Any], stack: str, batch: int, length: int, mask: Any) -> bool:
    """Whether ``stack``'s ``batch`` sequences of ``length`` positions are a vision tower's
    pictures (prefix tokens and a patch grid, none padded), not the texts the attention ``mask``
    describes."""
    if len(mask) == batch and all(len(m) == length for m in mask):
        return False
    pos = stack_positions(meta, stack)
    if pos is not None and "grid" in pos:
        return len(pos.get("kinds", [])) == length
    thw = meta.get("image_grid_thw")  # Qwen2-VL's tower: every picture's patches packed in one
    if thw and batch == 1 and length == sum(t * h * w for t, h, w in thw):
        return True
    # while the model runs the stacks are not named yet: one sequence per picture or tile
    return pos is None and _tower_batch(meta) == batch


__all__ = ["picture_count", "picture_stacks", "runs_over_pictures", "stack_positions"]
