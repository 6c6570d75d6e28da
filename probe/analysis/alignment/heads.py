"""Which cross-attention heads word timestamps read (:func:`probe.word_timestamps`).

* ``heads=[(layer, head), ...]``: as given (``choice="given"``).
* With gold timings (``"gold"``): every head is scored alone (its raw recipe's boundaries against
  the gold); from the best, each of the next best :data:`SEARCH` heads joins the set when it lowers
  the set's mean boundary error.
* Without gold, when the cache kept the sound (``"sound"``): the words' spans the refinement finds
  (:mod:`.refine`, reading the monotone heads below) stand in for the gold, and the heads are
  chosen against them the same way. The spans come mostly from the sound, which marks where each
  stretch of speech starts and ends, so a head whose peaks march in order but on the wrong words
  (a monotone head off by a word) no longer passes.
* Without gold or sound (``"monotone"``): the heads whose cross-attention is monotone and
  diagonal, the criterion :func:`probe.align`'s candidates rank by: per head, the frame each row
  attends to most must rise with the row (Kendall tau-b >= :data:`MONOTONE`) and lie near the
  diagonal (diagonality >= :data:`DIAGONAL`), averaged over inputs; if no head passes, the best
  one by (monotonicity, diagonality) alone, with a note.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from probe.analysis.alignment.reading import Item, starts_of, word_spans
from probe.analysis.alignment.timing import GoldWord, boundary_errors, error_summary
from probe.errors import ProbeError

MONOTONE = 0.9
DIAGONAL = 0.75
SEARCH = 16


def set_error(Z: list[torch.Tensor], items: list[Item], idx: list[int], t, golds) -> float:
    """The mean boundary error (ms) of the raw recipe on the heads ``idx`` against ``golds``
    (``Z``: per input the heads' filtered weights, :func:`.reading.starts_of`)."""
    errs: list[float] = []
    for b, s in enumerate(starts_of(Z, idx)):
        errs += boundary_errors(word_spans(items[b], s, t), golds[b])
    return error_summary(errs)["mean_error_ms"]


def best_set(Z, items, t, golds, alone: list[float]) -> list[int]:
    """The heads fit to ``golds``: the best alone (``alone``: each head's error), then each of the
    next best :data:`SEARCH` joining while the set's error falls."""
    ranked = sorted(range(len(alone)), key=lambda k: (math.isnan(alone[k]), alone[k]))
    chosen, best = [ranked[0]], alone[ranked[0]]
    for k in ranked[1:SEARCH]:
        e = set_error(Z, items, chosen + [k], t, golds)
        if e < best - 1e-9:
            chosen, best = chosen + [k], e
    return chosen


def monotone(rows: list[dict[str, Any]], names: list[tuple[int, int]]) -> tuple[list[int], str | None]:
    """The monotone, diagonal heads (most monotone first), or the most monotone head alone with a
    note when none passes."""
    passing = [
        k for k, r in enumerate(rows) if r["monotonicity"] >= MONOTONE and r["diagonality"] >= DIAGONAL
    ]

    def key(k: int) -> tuple:
        return tuple(
            -(rows[k][m] if not math.isnan(rows[k][m]) else -math.inf)
            for m in ("monotonicity", "diagonality")
        )

    if passing:
        return sorted(passing, key=key), None
    best = min(range(len(rows)), key=key)
    return [best], (
        f"no head's cross-attention is monotone (tau >= {MONOTONE}) and diagonal (>= {DIAGONAL}); "
        f"the most monotone one ({names[best][0]}.{names[best][1]}) is used alone: its times are a guess"
    )


def given(heads: Any, names: list[tuple[int, int]]) -> list[int]:
    """The indices of the ``heads`` the caller gave, checked against the cache's."""
    try:
        want = [(int(layer), int(head)) for layer, head in heads]
    except (TypeError, ValueError):
        raise ProbeError("heads= should be a list of (layer, head) pairs") from None
    missing = [h for h in want if h not in names]
    if not want or missing:
        raise ProbeError(
            f"heads {missing or '[]'} are not in the cache's decoder cross-attention: layers "
            f"{sorted({n[0] for n in names})}, heads {sorted({n[1] for n in names})}"
        )
    return [names.index(h) for h in want]


def choose(
    heads: Any,
    names: list[tuple[int, int]],
    rows: list[dict[str, Any]],
    fit: tuple[list[torch.Tensor], list[Item], Any],
    golds: list[list[GoldWord]] | None,
    refined: Callable[[list[int]], list[list[tuple[float, float]]] | None] | None,
    notes: list[str],
) -> tuple[list[int], str]:
    """``(chosen head indices, choice)`` as the module docstring says. ``rows`` hold each head's
    scores (with gold its ``mean_error_ms``; the sound's choice adds ``sound_error_ms``); ``fit``
    is ``(Z, items, t)`` (:func:`set_error`); ``refined(idx)`` the refined spans per input read with the heads
    ``idx`` (None without the sound)."""
    if heads is not None:
        return given(heads, names), "given"
    Z, items, t = fit
    if golds is not None:
        return best_set(Z, items, t, golds, [r["mean_error_ms"] for r in rows]), "gold"
    first, note = monotone(rows, names)
    spans = refined(first) if refined is not None else None
    if spans is None:
        notes += [note] if note else []
        return first, "monotone"
    stand_in = [[GoldWord("", s, e) for s, e in per] for per in spans]
    for k, r in enumerate(rows):
        r["sound_error_ms"] = set_error(Z, items, [k], t, stand_in)
    return best_set(Z, items, t, stand_in, [r["sound_error_ms"] for r in rows]), "sound"


__all__ = ["DIAGONAL", "MONOTONE", "SEARCH", "best_set", "choose", "given", "monotone", "set_error"]
