"""Word boundaries where the speech is: the refinement after Whisper's dynamic time warping.

Whisper's recipe (:mod:`.dtw`) makes the words contiguous: a word ends where the next begins, the
first starts at the first frame, so each word absorbs the pauses around it, and its edges are read
at the encoder's 20 ms. The refinement ``"attention+energy"`` reads two signals instead, at the
spectrogram's own time step (10 ms for Whisper's features):

* the **sound**: per column the probability that it is speech, from the spectrogram the capture
  kept (:mod:`.sound`: band energies against a noise floor measured on the input itself);
* the **attention**: per word, the chosen heads' cross-attention on the rows that predict its
  tokens (each head's row scaled to its own largest weight, the heads averaged, a median filter
  along the frames), which tells which word a stretch of speech belongs to: word ``k``'s share
  ``q_k`` of the attention at each column, mixed half and half with the uniform share so that no
  column's evidence rests on the attention alone.

Each column is given to one of the states ``pause, word 1, pause, word 2, ..., word n, pause`` in
this order (a pause may be skipped between two words, at a cost: a boundary inside speech) by the
most likely path (Viterbi). A word's column scores ``log(p + BETA (1 - p)) + ATTENTION log(mix
q_k)`` (a word may hold a short silence, a stop's closure, at ``BETA`` per column), a pause's
``log(1 - p + BETA_PAUSE p)``. So the sound decides where speech starts and ends, the word count
decides how many stretches it is cut into, the lengths of the silences decide where, and the
attention which word is where when the sound cannot tell (speech without a pause between two
words, a closure as long as a pause). A word spans its first column's time minus half a step to
its last one's plus half a step; two words with only speech between them meet halfway.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from probe.analysis.alignment.dtw import median_filter

REFINES = ("attention+energy", "none")
BETA = 0.1  # the likelihood of a silent column inside a word, against a spoken one
BETA_PAUSE = 0.1  # the likelihood of a spoken column inside a pause
SKIP = 1e-3  # the likelihood of going from one word to the next without a pause
ATTENTION = 0.05  # the weight of the attention's log-share against the sound's
MIX = 0.5  # the share of the uniform distribution mixed into the attention's
P_FLOOR = 1e-4  # speech probabilities are kept within [P_FLOOR, 1 - P_FLOOR]
ATTENTION_FLOOR = 1e-3  # added to each word's attention (of largest 1) before the shares


def word_attention(w: torch.Tensor, word_rows: list[list[int]], width: int) -> np.ndarray:
    """``[words, frames]``: per word, the mean over its ``word_rows`` of the heads' ``w`` ``[head,
    row, frame]`` cross-attention, each head's row scaled to its largest weight, the heads
    averaged and median-filtered along the frames (``width``)."""
    w = w.double()
    top = w.amax(-1, keepdim=True)
    a = (w / torch.where(top > 0, top, torch.ones_like(top))).mean(0)
    a = median_filter(a, width)
    return torch.stack([a[rows].mean(0) for rows in word_rows]).numpy()


def viterbi(word: np.ndarray, pause: np.ndarray, log_skip: float) -> np.ndarray:
    """The most likely state of each column: states ``0, 1, ..., 2n`` are pause, word 1, pause, ...,
    word n, pause; ``word`` ``[n, columns]`` and ``pause`` ``[columns]`` are log scores. A path
    starts in the first pause or word 1, ends in word n or the last pause, and moves one state
    on, or from word k to word k + 1 at ``log_skip``. Ties keep the state (then advance)."""
    n, C = word.shape
    S = 2 * n + 1
    em = np.empty((S, C))
    em[0::2], em[1::2] = pause, word
    acc = np.full(S, -np.inf)
    acc[:2] = em[:2, 0]
    back = np.zeros((S, C), dtype=np.int32)
    states = np.arange(S)
    for c in range(1, C):
        advance = np.concatenate([[-np.inf], acc[:-1]])
        skip = np.full(S, -np.inf)
        skip[3::2] = acc[1:-2:2] + log_skip
        best = np.maximum(np.maximum(acc, advance), skip)
        back[:, c] = np.where(best == acc, states, np.where(best == advance, states - 1, states - 2))
        acc = best + em[:, c]
    s = S - 1 if acc[S - 1] >= acc[S - 2] else S - 2
    path = np.empty(C, dtype=np.int64)
    path[-1] = s
    for c in range(C - 1, 0, -1):
        s = back[s, c]
        path[c - 1] = s
    return path


def refine_spans(
    attention: np.ndarray, frame_hop: float, frame_offset: float, speech: np.ndarray, col_hop: float
) -> list[tuple[float, float]] | None:
    """Each word's ``(start, end)`` seconds from its ``attention`` ``[words, frames]`` (frame ``f``
    spans ``frame_offset + f * frame_hop`` on) and the sound's ``speech`` probability per column
    (column ``c`` at ``c * col_hop``); None when there are fewer columns than words."""
    n, F = attention.shape
    C = len(speech)
    if C < n or n == 0:
        return None
    t = np.arange(C) * col_hop
    frame = np.clip(np.floor((t - frame_offset) / frame_hop).astype(np.int64), 0, F - 1)
    a = attention[:, frame] + ATTENTION_FLOOR
    share = (1 - MIX) * a / a.sum(0, keepdims=True) + MIX / n
    p = np.clip(speech, P_FLOOR, 1 - P_FLOOR)
    word = np.log(p + BETA * (1 - p))[None, :] + ATTENTION * np.log(share)
    pause = np.log(1 - p + BETA_PAUSE * p)
    path = viterbi(word, pause, math.log(SKIP))
    edges = [(int(cols[0]), int(cols[-1])) for cols in (np.flatnonzero(path == 2 * k + 1) for k in range(n))]
    spans = [[max(0.0, (a - 0.5) * col_hop), (e + 0.5) * col_hop] for a, e in edges]
    for k in range(n - 1):  # a "pause" of speech between two words is a boundary inside speech
        gap = p[edges[k][1] + 1 : edges[k + 1][0]]
        if gap.size and (gap >= 0.5).all():
            spans[k][1] = spans[k + 1][0] = (edges[k][1] + edges[k + 1][0]) / 2 * col_hop
    return [(round(a, 6), round(e, 6)) for a, e in spans]


__all__ = [
    "ATTENTION",
    "BETA",
    "BETA_PAUSE",
    "MIX",
    "REFINES",
    "SKIP",
    "refine_spans",
    "viterbi",
    "word_attention",
]
