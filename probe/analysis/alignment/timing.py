"""What word timestamps are read from and measured against: the cache's frames and text tokens,
words given by the caller, gold timings, and the boundary error.

* The frames: the stack whose positions are the cross-attention's keys carries, in the cache
  metadata, ``positions["frames"]`` (seconds per position ``hop``, ``offset``, and per input
  ``audio``: how many positions hold its sound; see docs/cache-format.md).
* The text tokens of input ``b``: the decoder positions that are neither special nor padding.
* ``words=``: per input the words as spelled; the tokens are matched to them by their letters and
  digits (case, spaces and punctuation ignored), a token of punctuation only joining the word
  before it.
* Gold timings: per input, per word ``(start, end)`` in seconds, ``(word, start, end)`` or
  ``{"word", "start", "end"}``. A word's two boundaries are its start and its end; the error of a
  boundary is the absolute difference in milliseconds.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from probe.analysis.alignment.words import Words, group_words, special_positions
from probe.errors import ProbeError

TOLERANCES_MS = (20, 50, 100)


@dataclass
class GoldWord:
    """One word's true timing in seconds (``word`` empty when the gold gives none)."""

    word: str
    start: float
    end: float


def frames_of(meta: dict[str, Any], keys: int) -> dict[str, Any]:
    """The ``frames`` entry of the stack whose positions are the ``keys`` cross-attention keys."""
    for s, info in (meta.get("stacks") or {}).items():
        frames = (info.get("positions") or {}).get("frames")
        if frames and frames.get("count") == keys:
            if frames.get("hop") is None:
                raise ProbeError(
                    f"the {s} stack's frames have no time in seconds (the sampling rate was not known): "
                    "capture with processor= (the feature extractor) or sampling_rate="
                )
            return frames
    raise ProbeError(
        f"the cache does not say what time its {keys} encoder positions stand for (no stack with "
        "positions['frames']); capture the audio with probe.capture(model, audio, processor=...)"
    )


def text_positions(meta: dict[str, Any], b: int) -> list[int]:
    """The decoder positions of input ``b``'s text tokens (not special, not padding)."""
    special = special_positions(meta, "target", b)
    return [p for p, s in enumerate(special) if not s]


def token_words(meta: dict[str, Any], b: int) -> Words:
    """The tokenizer's words of input ``b`` (:func:`probe.analysis.alignment.words.group_words`)."""
    return group_words(meta["target_tokens"][b], special_positions(meta, "target", b))


def _letters(s: str) -> str:
    return "".join(ch.lower() for ch in s if ch.isalnum())


def given_words(tokens: list[str], positions: list[int], words: Sequence[str], b: int) -> Words:
    """``words`` (spelled) laid on the text tokens at ``positions`` (see the module docstring)."""
    owner: list[int] = []  # per letter of the joined words: its word
    for w, word in enumerate(words):
        owner += [w] * len(_letters(str(word)))
    joined = "".join(_letters(tokens[p]) for p in positions)
    spelled = "".join(_letters(str(w)) for w in words)
    if joined != spelled:
        at = next((k for k, (x, y) in enumerate(zip(joined, spelled, strict=False)) if x != y), None)
        at = min(len(joined), len(spelled)) if at is None else at
        raise ProbeError(
            f"input {b}: the words do not spell the transcript's tokens (they part at letter {at}: "
            f"tokens {joined[at : at + 12]!r}, words {spelled[at : at + 12]!r}); give words= that "
            "spell the target text"
        )
    pieces: list[list[int]] = [[] for _ in words]
    k, last, starts = 0, 0, set()
    for p in positions:
        n = len(_letters(tokens[p]))
        w = owner[k] if n else last  # punctuation joins the word before it
        pieces[w].append(p)
        starts.add(k)
        k += n
        last = w
    first = 0
    for word in words:
        if _letters(str(word)) and first not in starts:
            raise ProbeError(
                f"input {b}: the word {str(word)!r} starts inside a token; a token belongs to one word, "
                "so merge it with its neighbour in words="
            )
        first += len(_letters(str(word)))
    empty = [str(words[w]) for w, ps in enumerate(pieces) if not ps]
    if empty:
        raise ProbeError(f"input {b}: the words {empty} have no letters or digits to find them by")
    return Words([str(w) for w in words], pieces)


def per_input(x: Any, n: int, what: str) -> list[Any]:
    """``x`` as one entry per input: a list of ``n`` lists, or (``n == 1``) one flat list."""
    if x is None:
        return [None] * n
    if not isinstance(x, (list, tuple)) or not x:
        raise ProbeError(f"{what} should be a non-empty list (one per input, or one input's)")
    nested = all(isinstance(e, (list, tuple)) and not _is_entry(e) for e in x)
    if n == 1 and not nested:
        return [list(x)]
    if not nested or len(x) != n:
        raise ProbeError(f"{what}: the cache holds {n} inputs; give one list per input")
    return [list(e) for e in x]


def _is_entry(e: Any) -> bool:
    """Whether ``e`` is one word or one timing (a string, a dict, ``(start, end)``,
    ``(word, start, end)``), not one input's list of them."""
    if isinstance(e, (str, Mapping)):
        return True
    return isinstance(e, (list, tuple)) and len(e) in (2, 3) and isinstance(e[-1], numbers.Real)


def parse_gold(entries: list[Any], b: int) -> list[GoldWord]:
    """One input's gold timings (see the module docstring) as :class:`GoldWord`, checked."""
    out = []
    for k, g in enumerate(entries):
        if isinstance(g, Mapping):
            word, start, end = g.get("word", ""), g.get("start"), g.get("end")
        elif isinstance(g, (list, tuple)) and len(g) == 3:
            word, start, end = g
        elif isinstance(g, (list, tuple)) and len(g) == 2:
            word, (start, end) = "", g
        else:
            raise ProbeError(f"gold input {b} word {k}: give (start, end), (word, start, end) or a dict")
        try:
            start, end = float(start), float(end)
        except (TypeError, ValueError):
            raise ProbeError(f"gold input {b} word {k}: start and end should be seconds, not {g!r}") from None
        if not (math.isfinite(start) and math.isfinite(end)) or end < start or start < 0:
            raise ProbeError(f"gold input {b} word {k}: {start}-{end} s is not a time span")
        out.append(GoldWord(str(word), start, end))
    return out


def boundary_errors(pred: list[tuple[float, float]], gold: list[GoldWord]) -> list[float]:
    """Each word's start and end error in milliseconds, in word order (start, end, start, ...)."""
    out = []
    for (s, e), g in zip(pred, gold, strict=True):
        out += [abs(s - g.start) * 1000.0, abs(e - g.end) * 1000.0]
    return out


def error_summary(errors: list[float]) -> dict[str, float]:
    """``mean_error_ms`` and the share of boundaries within each tolerance (``within_20ms``, ...)."""
    if not errors:
        return {"mean_error_ms": math.nan, **{f"within_{t}ms": math.nan for t in TOLERANCES_MS}}
    out = {"mean_error_ms": sum(errors) / len(errors)}
    for t in TOLERANCES_MS:
        out[f"within_{t}ms"] = sum(e <= t + 1e-9 for e in errors) / len(errors)
    return out


__all__ = [
    "GoldWord",
    "TOLERANCES_MS",
    "boundary_errors",
    "error_summary",
    "frames_of",
    "given_words",
    "parse_gold",
    "per_input",
    "text_positions",
    "token_words",
]
