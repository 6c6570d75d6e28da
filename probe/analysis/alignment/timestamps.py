"""``probe.word_timestamps``: when each word of a transcript was said, read from cross-attention
and refined on the sound.

For every input of a cache of an audio encoder-decoder (Whisper-shaped: the encoder's positions
carry their time, :mod:`probe.capture.positions.frames`; the decoder holds the transcript):

1. **Whisper's raw recipe.** The chosen heads' cross-attention goes through openai-whisper's
   ``find_alignment`` steps (:mod:`.dtw`: z-score, median filter, mean over heads, dynamic time
   warping) to a start and end for each text token and each word (tokens merged into words the
   tokenizer's way, or as ``words=`` spells them; :mod:`.timing`). Its words are contiguous.
2. **The refinement** (``refine="attention+energy"``, the default; ``"none"`` keeps step 1's
   times): each word's start and end moved to where its speech starts and ends, from the
   spectrogram the capture kept (:mod:`.sound`: speech against a noise floor measured on the
   input) and the chosen heads' attention on the word's rows (which word a stretch of speech
   belongs to), by the most likely path through pauses and words (:mod:`.refine`). Words are no
   longer contiguous across pauses. A cache without a spectrogram keeps step 1's times, with a
   note.

Which heads (:mod:`.heads`): as given; with ``gold`` timings the ones that fit them best; without,
the ones that fit the spans the sound gives (the refinement read with the monotone, diagonal
heads), or, without the sound, the monotone, diagonal heads themselves. Every head's scores are
in ``heads``, the chosen ones marked.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from probe.analysis.alignment.core import cross_layers
from probe.analysis.alignment.dtw import MEDIAN_WIDTH, filtered
from probe.analysis.alignment.heads import DIAGONAL, MONOTONE, SEARCH, choose
from probe.analysis.alignment.reading import Item, mean, read_items, shape_scores, starts_of, word_spans
from probe.analysis.alignment.refine import REFINES, refine_spans, word_attention
from probe.analysis.alignment.sound import spectrogram, speech_probability
from probe.analysis.alignment.timing import boundary_errors, error_summary, frames_of, parse_gold, per_input
from probe.analysis.table import Exports, Table
from probe.errors import ProbeError


@dataclass
class WordTimestamps(Exports):
    """Word and token times of every input of a cache, with the heads they came from.

    ``words`` (a Table: ``item``, ``word``, ``start``, ``end`` in seconds, refined; when refined
    also Whisper's raw ``raw_start``, ``raw_end``; its ``tokens``; with gold also ``gold_start``,
    ``gold_end``, ``start_error_ms``, ``end_error_ms``), ``tokens`` (per text token its
    ``position`` in the decoder, ``start``, ``end``: the raw recipe's, held inside the refined word),
    ``heads`` (per decoder layer and head ``monotonicity``, ``diagonality``; with gold
    ``mean_error_ms`` and ``within_20ms``, ``within_50ms``, ``within_100ms`` of its raw boundaries
    used alone; for the sound's choice ``sound_error_ms``, against the sound's spans; ``chosen``),
    ``chosen`` (the ``(layer, head)`` pairs used), ``choice`` (``given``, ``gold``, ``sound`` or
    ``monotone``), ``refine`` (the refinement applied: ``attention+energy`` or ``none``),
    ``metrics`` (the words' boundary error against gold, None without gold), ``raw_metrics`` (the
    raw recipe's, when refined), ``notes``."""

    _exported = "words"  # CSV and pandas: a row per word

    words: Table
    tokens: Table
    heads: Table
    chosen: list[tuple[int, int]]
    choice: str
    metrics: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)
    refine: str = "none"
    raw_metrics: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready: the choice, refinement, chosen heads, metrics, notes and the tables."""
        return {
            "choice": self.choice,
            "refine": self.refine,
            "chosen": [list(h) for h in self.chosen],
            "metrics": self.metrics,
            "raw_metrics": self.raw_metrics,
            "notes": list(self.notes),
            "words": self.words.to_dict(),
            "tokens": self.tokens.to_dict(),
            "heads": self.heads.to_dict(),
        }

    def _heads_line(self) -> str:
        chosen = ", ".join(f"{layer}.{head}" for layer, head in self.chosen)
        line = f"heads ({self.choice}): {chosen}; refine: {self.refine}"
        for name, m in (("", self.metrics), ("raw ", self.raw_metrics)):
            if m:
                line += (
                    f"; {name}mean boundary error {m['mean_error_ms']:.1f} ms, within 20/50/100 ms: "
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


@dataclass
class _Read:
    """What one call reads: the inputs, each one's ``[head, row, frame]`` weights (``Z``: z-scored
    and filtered), the frames' time (``t``: frame to seconds), the filter width, and per input the
    sound's speech probability with its column step (None where the cache kept no usable
    spectrogram)."""

    items: list[Item]
    W: list[torch.Tensor]
    frames: dict[str, Any]
    width: int
    speech: list[tuple[np.ndarray, float] | None]
    Z: list[torch.Tensor] = field(init=False)

    def __post_init__(self):
        self.Z = [filtered(w, self.width) for w in self.W]  # steps 1-2 of the raw recipe, per head

    def t(self, f: int) -> float:
        return round(self.frames["offset"] + f * self.frames["hop"], 6)

    def raw(self, idx: list[int]) -> list[list[tuple[float, float]]]:
        """Per input, each word's raw ``(start, end)`` read with the heads ``idx``."""
        return [word_spans(it, s, self.t) for it, s in zip(self.items, starts_of(self.Z, idx), strict=True)]

    def refined(self, idx: list[int]) -> list[list[tuple[float, float]] | None]:
        """Per input, each word's refined ``(start, end)`` with the heads ``idx`` (None where the
        input has no sound, or fewer spectrogram columns than words)."""
        out = []
        for it, w, sp in zip(self.items, self.W, self.speech, strict=True):
            if sp is None:
                out.append(None)
                continue
            att = word_attention(w[idx], it.word_tokens, self.width)
            out.append(refine_spans(att, self.frames["hop"], self.frames["offset"], sp[0], sp[1]))
        return out

    def stand_in(self, idx: list[int]) -> list[list[tuple[float, float]]]:
        """The refined spans, the raw ones where an input has none (the sound's head choice)."""
        return [r if r is not None else w for r, w in zip(self.refined(idx), self.raw(idx), strict=True)]


def _speech(meta: dict[str, Any], items: list[Item], frames: dict[str, Any], notes: list[str]):
    """Per input ``(speech probability per column, seconds per column)``, or None with a note."""
    out, missing, flat = [], [], []
    for b, it in enumerate(items):
        sound = spectrogram(meta, b, it.frames * frames["hop"])
        p = speech_probability(sound.values) if sound is not None else None
        out.append((p, sound.hop) if p is not None else None)
        (missing if sound is None else flat if p is None else []).append(b)
    if missing:
        notes.append(
            f"input(s) {missing}: the cache kept no spectrogram of the sound (capture the audio with "
            "probe.capture(model, audio, processor=...)), so their times are Whisper's raw recipe's"
        )
    if flat:
        notes.append(
            f"input(s) {flat}: the sound has no quieter part to measure its noise by, so their times "
            "are Whisper's raw recipe's"
        )
    return out


def word_timestamps(
    cache,
    heads: Any = None,
    words: Any = None,
    gold: Any = None,
    *,
    width: int = MEDIAN_WIDTH,
    refine: str = "attention+energy",
) -> WordTimestamps:
    """Word and token timestamps from the decoder cross-attention of an audio ``cache``, refined on
    its sound (see the module docstring).

    ``heads``: ``[(layer, head), ...]``, or None to choose them (with ``gold``: the best fit;
    without: the best fit to the sound's spans, or the monotone, diagonal heads). ``words``: the
    words as spelled, one list per input (or one input's list), matched to the tokens by their
    letters; by default the tokenizer's words (a word starts at a token with a leading space).
    ``gold``: per input per word ``(start, end)`` seconds, ``(word, start, end)`` (its words then
    group the tokens unless ``words`` is given) or ``{"word", "start", "end"}``. ``width``: the
    median filter's width (odd). ``refine``: ``"attention+energy"`` (the default: each word's
    edges where its speech starts and ends) or ``"none"`` (Whisper's raw recipe, contiguous words).
    Returns :class:`WordTimestamps`.
    """
    if width < 1 or width % 2 == 0:
        raise ProbeError(f"width={width}: the median filter's width should be a positive odd number")
    if refine not in REFINES:
        raise ProbeError(f"refine={refine!r}: use one of {', '.join(map(repr, REFINES))}")
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
    if gold is not None and not all(g is not None for g in golds):
        raise ProbeError("gold: give the timings of every input")
    items = read_items(meta, frames, words, golds, B, S)
    W = [
        torch.stack([P[layer][b, h][it.rows, : it.frames] for layer in layers for h in range(H)])
        for b, it in enumerate(items)
    ]
    notes: list[str] = []
    speech = _speech(meta, items, frames, notes) if refine != "none" else [None] * B
    read = _Read(items, W, frames, width, speech)
    rows = _head_rows(read, names, golds if gold is not None else None)
    sound = read.stand_in if any(s is not None for s in speech) else None
    chosen_idx, choice = choose(
        heads, names, rows, (read.Z, items, read.t), golds if gold is not None else None, sound, notes
    )
    for k, r in enumerate(rows):
        r["chosen"] = k in chosen_idx
    return _result(read, chosen_idx, names, rows, choice, golds if gold is not None else None, meta, notes)


def _head_rows(read: _Read, names, golds) -> list[dict[str, Any]]:
    """Per head its shape scores and, with gold, its raw boundaries' error used alone."""
    rows = []
    for k, (layer, head) in enumerate(names):
        mono, diag = zip(*[shape_scores(w[k]) for w in read.W], strict=True)
        row = {
            "layer": layer,
            "head": head,
            "monotonicity": mean(list(mono)),
            "diagonality": mean(list(diag)),
        }
        if golds is not None:
            errs: list[float] = []
            for spans, g in zip(read.raw([k]), golds, strict=True):
                errs += boundary_errors(spans, g)
            row.update(error_summary(errs))
        rows.append(row)
    return rows


def _token_rows(read: _Read, b: int, starts: list[int], spans, toks) -> list[dict[str, Any]]:
    """Input ``b``'s tokens: the raw recipe's spans, each held inside its word's (refined) span."""
    it = read.items[b]
    out = []
    for w, ks in enumerate(it.word_tokens):
        lo, hi = spans[w]
        for j, k in enumerate(ks):
            a = lo if j == 0 else min(max(read.t(starts[k]), lo), hi)
            e = hi if j == len(ks) - 1 else min(max(read.t(starts[k + 1]), lo), hi)
            out.append(
                {
                    "item": b,
                    "position": it.positions[k],
                    "token": toks[it.positions[k]],
                    "start": a,
                    "end": max(a, e),
                }
            )
    return out


def _result(read: _Read, chosen_idx, names, rows, choice, golds, meta, notes) -> WordTimestamps:
    raw_all = read.raw(chosen_idx)
    refined = read.refined(chosen_idx) if any(s is not None for s in read.speech) else None
    word_rows, token_rows, errs, raw_errs = [], [], [], []
    for b, (it, starts) in enumerate(zip(read.items, starts_of(read.Z, chosen_idx), strict=True)):
        toks = meta["target_tokens"][b]
        raw = raw_all[b]
        spans = refined[b] if refined is not None and refined[b] is not None else raw
        token_rows += _token_rows(read, b, starts, spans, toks)
        for w, word in enumerate(it.words):
            row = {"item": b, "word": word, "start": spans[w][0], "end": spans[w][1]}
            if refined is not None:
                row.update(raw_start=raw[w][0], raw_end=raw[w][1])
            row["tokens"] = "|".join(toks[it.positions[k]] for k in it.word_tokens[w])
            if golds is not None:
                g = golds[b][w]
                row.update(
                    gold_start=g.start,
                    gold_end=g.end,
                    start_error_ms=abs(spans[w][0] - g.start) * 1000.0,
                    end_error_ms=abs(spans[w][1] - g.end) * 1000.0,
                )
            word_rows.append(row)
        if golds is not None:
            errs += boundary_errors(spans, golds[b])
            raw_errs += boundary_errors(raw, golds[b])
    metrics = {**error_summary(errs), "boundaries": len(errs)} if golds is not None else None
    raw_metrics = {**error_summary(raw_errs), "boundaries": len(raw_errs)} if golds and refined else None
    cols = ["layer", "head", "monotonicity", "diagonality"]
    if golds is not None:
        cols += ["mean_error_ms", "within_20ms", "within_50ms", "within_100ms"]
    if choice == "sound":
        cols.append("sound_error_ms")
    return WordTimestamps(
        words=Table(word_rows, title="word timestamps (seconds)"),
        tokens=Table(token_rows, title="token timestamps (seconds)"),
        heads=Table(rows, columns=[*cols, "chosen"], title="cross-attention heads for word timestamps"),
        chosen=[names[k] for k in chosen_idx],
        choice=choice,
        metrics=metrics,
        notes=notes,
        refine="attention+energy" if refined is not None else "none",
        raw_metrics=raw_metrics,
    )


__all__ = ["DIAGONAL", "MONOTONE", "SEARCH", "WordTimestamps", "word_timestamps"]
