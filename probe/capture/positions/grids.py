"""Image tokens laid on patch grids, labelled, and attached to the stacks that read them.

A vision-language model's text holds one image token per position its vision tower hands on; a
run of them is one or more pictures' grids, row-major, back to back. Every picture layout lays
them the same way (:func:`lay_text`: a picture's grid taken for each run of image tokens, in
order, until the run is used up; a run that is not whole grids is not laid, rather than guessed)
and names them the same way (:func:`grid_labels`: ``patch (r, c)`` for one grid, ``img g (r, c)``
for several, ``<unit> g (r, c)`` with a unit: ``tile``, ``img``). :func:`text_stacks` finds the
stacks whose self-attention runs over the text, and :func:`attach` hands them each text's laid
positions and writes the labels into the cache's display tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from probe.capture.calls import LayerRecord


def lay_grids(
    ids: list[int], token: int, grid: Callable[[int], dict[str, Any] | None]
) -> tuple[list[str], list[dict[str, Any]]] | None:
    """``(kinds, grids)`` of one text: each position ``image`` or ``text``, and for each run of
    ``token`` the grids ``grid(0)``, ``grid(1)``, ... laid from its start (each at its
    ``offset``), as many as the run holds. None when a run is not whole grids, or ``grid(k)``
    is None (no picture left)."""
    kinds = ["image" if t == token else "text" for t in ids]
    laid: list[dict[str, Any]] = []
    i = 0
    while i < len(ids):
        if kinds[i] != "image":
            i += 1
            continue
        g = grid(len(laid))
        if g is None:
            return None
        n = g["rows"] * g["cols"]
        if i + n > len(ids) or any(k != "image" for k in kinds[i : i + n]):
            return None
        laid.append({**g, "offset": i})
        i += n
    return kinds, laid


def grid_labels(length: int, grids: list[dict[str, Any]], unit: str | None = None) -> list[str | None]:
    """The display label of each of ``length`` positions: on grid ``g``, ``<unit> g (r, c)``, or
    without a unit ``patch (r, c)`` (one grid) or ``img g (r, c)``; None off the grids."""
    labels: list[str | None] = [None] * length
    for g, at in enumerate(grids):
        name = f"{unit} {g}" if unit else "patch" if len(grids) == 1 else f"img {g}"
        for k in range(at["rows"] * at["cols"]):
            if at["offset"] + k < length:
                labels[at["offset"] + k] = f"{name} ({k // at['cols']}, {k % at['cols']})"
    return labels


def lay_text(
    ids: list[int], token: int, grid: Callable[[int], dict[str, Any] | None], unit: str | None = None
) -> dict[str, Any] | None:
    """``{"kinds", "labels", "grids"}`` of one text (:func:`lay_grids`, :func:`grid_labels`), None
    where its image tokens are not whole grids."""
    laid = lay_grids(ids, token, grid)
    if laid is None:
        return None
    kinds, grids = laid
    return {"kinds": kinds, "labels": grid_labels(len(ids), grids, unit), "grids": grids}


def relabel(tokens: list[str], labels: list[str | None]) -> list[str]:
    """A text's display tokens with the grid labels in place of the image tokens."""
    return [lab or tok for lab, tok in zip(labels, tokens, strict=True)]


def text_stacks(
    records: list[LayerRecord], stack_of: dict[str, str], found: dict[str, Any], length: int
) -> list[str]:
    """The stacks not named yet (not in ``found``) whose self-attention runs over ``length``
    positions (the text's), in the order their layers ran."""
    out: list[str] = []
    for r in records:
        s = stack_of[r.container]
        if s in found or s in out:
            continue
        if any(role == "self" and shape[3] == length for role, _h, shape, *_ in r.patterns):
            out.append(s)
    return out


def attach(
    meta: dict[str, Any], stacks: list[str], found: dict[str, Any], rows: list[dict[str, Any]]
) -> None:
    """Each of ``stacks`` gets the texts' laid positions (``{"rows": [{"kinds", "grids"}, ...]}``)
    and, when there is one, the cache's display tokens get the grid labels."""
    for s in stacks:
        found[s] = {"rows": [{"kinds": row["kinds"], "grids": row["grids"]} for row in rows]}
    if stacks:
        for b, row in enumerate(rows):
            meta["tokens"][b] = relabel(meta["tokens"][b], row["labels"])


__all__ = ["attach", "grid_labels", "lay_grids", "lay_text", "relabel", "text_stacks"]
