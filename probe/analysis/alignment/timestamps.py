"""``probe.word_timestamps``: when each word of a transcript was said, read from cross-attention.

For every input of a cache of an audio encoder-decoder (Whisper-shaped: the encoder's positions
carry their time, :mod:`probe.capture.positions.frames`; the decoder holds the transcript), the chosen
heads' cross-attention goes through openai-whisper's ``find_alignment`` steps
(:mod:`.dtw`: z-score, median filter, mean over heads, dynamic time warping) to a start and end in
seconds for each text token and each word (tokens merged into words the tokenizer's way, or as
``words=`` spells them; :mod:`.timing`).

Which heads: ``heads=[(layer, head), ...]`` as given; else, with ``gold`` timings, the heads that
fit them best (every head scored alone; then, from the best, each of the next best
:data:`SEARCH` heads joins the set when it lowers the set's mean boundary error); without gold,
the heads whose cross-attention is monotone and diagonal (the criterion :func:`probe.align`'s
candidates rank by): per head, the frame each row attends to most (argmax over the frames that
hold audio) must rise with the row (Kendall tau-b >= :data:`MONOTONE`) and lie near the diagonal
(diagonality >= :data:`DIAGONAL`, 1 minus the mean distance of (frame, row) from it, both as
shares), averaged over inputs; if no head passes, the best one by (monotonicity, diagonality)
alone, with a note. Every head's scores are in ``heads``, the chosen ones marked.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from probe.analysis.alignment.core import cross_layers
from probe.analysis.alignment.dtw import MEDIAN_WIDTH, row_starts
from probe.analysis.alignment.metrics import kendall_tau_b
from probe.analysis.alignment.timing import (
    boundary_errors,
    error_summary,
    frames_of,
    given_words,
    parse_gold,
    per_input,
    text_positions,
    token_words,
)
from probe.analysis.table import Exports, Table
from probe.errors import ProbeError

MONOTONE = 0.9
DIAGONAL = 0.75
SEARCH = 16


@dataclass
class _Item:
    """One input: the cross-attention rows that predict its text tokens (and the one after), the
    tokens' decoder positions, its words as token indices, and the frames holding its audio."""

    rows: list[int]
    positions: list[int]
    words: list[str]
    word_tokens: list[list[int]]
    frames: int


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


@dataclass
class WordTimestamps(Exports):
    """Word and token times of every input of a cache, with the heads they came from.

    ``words`` (a Table: ``item``, ``word``, ``start``, ``end`` in seconds, its ``tokens``; with
    gold also ``gold_start``, ``gold_end``, ``start_error_ms``, ``end_error_ms``), ``tokens`` (per
    text token its ``position`` in the decoder, ``start``, ``end``), ``heads`` (per decoder layer
    and head ``monotonicity``, ``diagonality``; with gold ``mean_error_ms`` and ``within_20ms``,
    ``within_50ms``, ``within_100ms`` used alone; ``chosen``), ``chosen`` (the ``(layer, head)``
    pairs used), ``choice`` (``given``, ``gold`` or ``monotone``), ``metrics`` (the chosen set's
    boundary error against gold, None without gold), ``notes``."""

    _exported = "words"  # CSV and pandas: a row per word

    words: Table
    tokens: Table
    heads: Table
    chosen: list[tuple[int, int]]
    choice: str
    metrics: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready: the choice, the chosen heads, metrics, notes and the three tables."""
        return {
            "choice": self.choice,
            "chosen": [list(h) for h in self.chosen],
            "metrics": self.metrics,
            "notes": list(self.notes),
            "words": self.words.to_dict(),
            "tokens": self.tokens.to_dict(),
            "heads": self.heads.to_dict(),
        }

    def _heads_line(self) -> str:
        chosen = ", ".join(f"{layer}.{head}" for layer, head in self.chosen)
        line = f"heads ({self.choice}): {chosen}"
        if self.metrics:
            m = self.metrics
            line += (
                f"; mean boundary error {m['mean_error_ms']:.1f} ms, within 20/50/100 ms: "
                f"{m['within_20ms']:.0%} / {m['within_50ms']:.0%} / {m['within_100ms']:.0%}"
            )
        return line

    def to_text(self, max_rows: int = 40) -> str:
        """The chosen heads (and their error), the words table, and the notes."""
        parts = [self._heads_line(), self.words.to_text(max_rows=max_rows)]
        parts += [f"note: {n}" for n in self.notes]
        return "\n".join(parts)

    def __repr__(self) -> str:
        return f"<probe.WordTimestamps words={len(self.words)} {self._heads_line()}>"

    def _repr_html_(self) -> str:
        parts = [f"<div><b>{html.escape(self._heads_line())}</b>", self.words._repr_html_()]
        parts += [f"<p><small>{html.escape(n)}</small></p>" for n in self.notes]
        parts.append("</div>")
        return "".join(parts)


def _items(meta: dict[str, Any], frames: dict[str, Any], words: Any, gold: list[Any], B: int, S: int):
    out = []
    given = per_input(words, B, "words=")
    for b in range(B):
        pos = text_positions(meta, b)
        if not pos:
            raise ProbeError(f"input {b} has no text tokens in the decoder; give the transcript as target=")
        if pos[0] == 0:
            raise ProbeError(
                f"input {b}'s first text token is at decoder position 0, so no row predicts it; the "
                "decoder inputs should start with the start token"
            )
        spelled = given[b]
        if spelled is None and gold[b] is not None and all(g.word for g in gold[b]):
            spelled = [g.word for g in gold[b]]
        wd = (
            given_words(meta["target_tokens"][b], pos, spelled, b)
            if spelled is not None
            else token_words(meta, b)
        )
        index = {p: k for k, p in enumerate(pos)}
        n_audio = int((frames.get("audio") or [S] * B)[b])
        out.append(
            _Item(
                rows=[p - 1 for p in pos] + [pos[-1]],
                positions=pos,
                words=wd.words,
                word_tokens=[[index[p] for p in ps] for ps in wd.pieces],
                frames=max(1, min(n_audio, S)),
            )
        )
        if gold[b] is not None and len(gold[b]) != len(wd.words):
            raise ProbeError(
                f"gold input {b} has {len(gold[b])} words but the transcript has {len(wd.words)} "
                f"({' '.join(wd.words)}); give words= to group the tokens like the gold"
            )
    return out


def _starts(W: list[torch.Tensor], items: list[_Item], idx: list[int], width: int) -> list[list[int]]:
    """Per input, the frame each row starts at, for the heads ``idx`` of ``W[b]`` [head, row, frame]."""
    return [row_starts(W[b][idx], width) for b in range(len(items))]


def _word_spans(item: _Item, starts: list[int], t) -> list[tuple[float, float]]:
    return [(t(starts[ks[0]]), t(starts[ks[-1] + 1])) for ks in item.word_tokens]


def _shape_scores(w: torch.Tensor) -> tuple[float, float]:
    """``(monotonicity, diagonality)`` of one head's ``[row, frame]`` weights."""
    n, F = w.shape
    peak = w.argmax(-1).tolist()
    mono = kendall_tau_b(list(range(n)), peak) if n > 1 else math.nan
    diag = _mean([1 - abs((f + 0.5) / F - (k + 0.5) / n) for k, f in enumerate(peak)])
    return mono, diag


def _set_error(W, items, idx, width, t, golds) -> float:
    errs: list[float] = []
    for b, s in enumerate(_starts(W, items, idx, width)):
        errs += boundary_errors(_word_spans(items[b], s, t), golds[b])
    return error_summary(errs)["mean_error_ms"]


def word_timestamps(
    cache, heads: Any = None, words: Any = None, gold: Any = None, *, width: int = MEDIAN_WIDTH
) -> WordTimestamps:
    """Word and token timestamps from the decoder cross-attention of an audio ``cache`` (see the
    module docstring).

    ``heads``: ``[(layer, head), ...]``, or None to choose them (with ``gold``: the best fit;
    without: the monotone, diagonal heads). ``words``: the words as spelled, one list per input
    (or one input's list), matched to the tokens by their letters; by default the tokenizer's
    words (a word starts at a token with a leading space). ``gold``: per input per word ``(start,
    end)`` seconds, ``(word, start, end)`` (its words then group the tokens unless ``words`` is
    given) or ``{"word", "start", "end"}``. ``width``: the median filter's width (odd).
    Returns :class:`WordTimestamps`.
    """
    if width < 1 or width % 2 == 0:
        raise ProbeError(f"width={width}: the median filter's width should be a positive odd number")
    meta = cache.metadata
    layers = cross_layers(cache)
    if not layers:
        raise ProbeError(
            "this cache has no decoder cross-attention; capture an audio encoder-decoder (Whisper)"
        )
    if not meta.get("target_tokens"):
        raise ProbeError("the cache has no target tokens; capture with target= (the transcript)")
    P = {layer: cache.pattern("decoder", layer, "cross").float() for layer in layers}
    B, H, _T, S = P[layers[0]].shape
    captured = meta.get("heads_captured") or list(range(H))
    names = [(layer, int(captured[h])) for layer in layers for h in range(H)]
    frames = frames_of(meta, S)
    golds = [parse_gold(g, b) if g is not None else None for b, g in enumerate(per_input(gold, B, "gold"))]
    items = _items(meta, frames, words, golds, B, S)
    W = [
        torch.stack([P[layer][b, h][it.rows, : it.frames] for layer in layers for h in range(H)])
        for b, it in enumerate(items)
    ]

    def t(f: int) -> float:
        return round(frames["offset"] + f * frames["hop"], 6)

    rows = []
    for k, (layer, head) in enumerate(names):
        mono, diag = zip(*[_shape_scores(W[b][k]) for b in range(B)], strict=True)
        rows.append(
            {
                "layer": layer,
                "head": head,
                "monotonicity": _mean(list(mono)),
                "diagonality": _mean(list(diag)),
            }
        )
    has_gold = all(g is not None for g in golds)
    if gold is not None and not has_gold:
        raise ProbeError("gold: give the timings of every input")
    if has_gold:
        for k, r in enumerate(rows):
            errs: list[float] = []
            for b, s in enumerate(_starts(W, items, [k], width)):
                errs += boundary_errors(_word_spans(items[b], s, t), golds[b])
            r.update(error_summary(errs))
    notes: list[str] = []
    chosen_idx, choice = _choose(heads, names, rows, has_gold, W, items, width, t, golds, notes)
    for k, r in enumerate(rows):
        r["chosen"] = k in chosen_idx
    return _result(
        W, items, chosen_idx, names, rows, choice, width, t, golds if has_gold else None, meta, notes
    )


def _choose(heads, names, rows, has_gold, W, items, width, t, golds, notes) -> tuple[list[int], str]:
    if heads is not None:
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
        return [names.index(h) for h in want], "given"
    if has_gold:
        ranked = sorted(
            range(len(rows)), key=lambda k: (math.isnan(rows[k]["mean_error_ms"]), rows[k]["mean_error_ms"])
        )
        chosen = [ranked[0]]
        best = rows[ranked[0]]["mean_error_ms"]
        for k in ranked[1:SEARCH]:
            e = _set_error(W, items, chosen + [k], width, t, golds)
            if e < best - 1e-9:
                chosen, best = chosen + [k], e
        return chosen, "gold"
    passing = [
        k for k, r in enumerate(rows) if r["monotonicity"] >= MONOTONE and r["diagonality"] >= DIAGONAL
    ]

    def key(k: int) -> tuple:
        return tuple(
            -(rows[k][m] if not math.isnan(rows[k][m]) else -math.inf)
            for m in ("monotonicity", "diagonality")
        )

    if passing:
        return sorted(passing, key=key), "monotone"
    best = min(range(len(rows)), key=key)
    notes.append(
        f"no head's cross-attention is monotone (tau >= {MONOTONE}) and diagonal (>= {DIAGONAL}); "
        f"the most monotone one ({names[best][0]}.{names[best][1]}) is used alone: its times are a guess"
    )
    return [best], "monotone"


def _result(W, items, chosen_idx, names, rows, choice, width, t, golds, meta, notes) -> WordTimestamps:
    word_rows, token_rows, errs = [], [], []
    for b, s in enumerate(_starts(W, items, chosen_idx, width)):
        it = items[b]
        toks = meta["target_tokens"][b]
        spans = _word_spans(it, s, t)
        for k, p in enumerate(it.positions):
            token_rows.append(
                {"item": b, "position": p, "token": toks[p], "start": t(s[k]), "end": t(s[k + 1])}
            )
        for w, (word, (start, end)) in enumerate(zip(it.words, spans, strict=True)):
            row = {"item": b, "word": word, "start": start, "end": end}
            row["tokens"] = "|".join(toks[it.positions[k]] for k in it.word_tokens[w])
            if golds is not None:
                g = golds[b][w]
                row.update(
                    gold_start=g.start,
                    gold_end=g.end,
                    start_error_ms=abs(start - g.start) * 1000.0,
                    end_error_ms=abs(end - g.end) * 1000.0,
                )
            word_rows.append(row)
        if golds is not None:
            errs += boundary_errors(spans, golds[b])
    metrics = {**error_summary(errs), "boundaries": len(errs)} if golds is not None else None
    cols = ["layer", "head", "monotonicity", "diagonality"]
    if golds is not None:
        cols += ["mean_error_ms", "within_20ms", "within_50ms", "within_100ms"]
    return WordTimestamps(
        words=Table(word_rows, title="word timestamps (seconds)"),
        tokens=Table(token_rows, title="token timestamps (seconds)"),
        heads=Table(rows, columns=[*cols, "chosen"], title="cross-attention heads for word timestamps"),
        chosen=[names[k] for k in chosen_idx],
        choice=choice,
        metrics=metrics,
        notes=notes,
    )


__all__ = ["DIAGONAL", "MONOTONE", "SEARCH", "WordTimestamps", "word_timestamps"]
