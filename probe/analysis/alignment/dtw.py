"""Cross-attention to token times, the way openai-whisper's ``find_alignment`` does it.

For the chosen heads' cross-attention ``[head, row, frame]`` over the frames that hold audio:

1. each head's weights are standardised per frame over the rows (z-score, population standard
   deviation: ``std_mean(weights, dim=-2, unbiased=False)`` in whisper's ``timing.py``), so a
   frame every row reads alike carries no signal;
2. a median filter of width 7 runs along the frames (reflect padding at the ends);
3. the heads are averaged into one matrix ``[row, frame]``;
4. dynamic time warping on its negative finds the monotone path through (row, frame) of the
   highest total weight, from (0, 0) to (last row, last frame); each step goes down a row, right a
   frame, or both (ties: a diagonal step only when strictly cheaper than both others, a row step
   only when strictly cheaper than both others, else a frame step, as whisper's ``dtw_cpu``);
5. the first frame the path reaches on each row is that row's start (the "jumps").

The rows are the decoder positions that *predict* the text tokens (the row before each token,
whisper's ``matrix[len(sot_sequence):-1]``) plus the row that predicts what follows the last
one, so token ``k`` spans from row ``k``'s first frame to row ``k + 1``'s.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

MEDIAN_WIDTH = 7


def standardise(w: torch.Tensor) -> torch.Tensor:
    """``[head, row, frame]`` weights z-scored per head and frame over the rows (a frame whose
    rows are all equal becomes 0, where whisper would divide by zero)."""
    std, mean = torch.std_mean(w, dim=-2, keepdim=True, unbiased=False)
    return (w - mean) / torch.where(std > 0, std, torch.ones_like(std))


def median_filter(x: torch.Tensor, width: int = MEDIAN_WIDTH) -> torch.Tensor:
    """The median of each window of ``width`` (odd) along the last axis, reflect-padded; ``x``
    unchanged when the axis is not longer than half the width (reflect padding cannot pad it)."""
    pad = width // 2
    if width < 1 or width % 2 == 0:
        raise ValueError(f"the median filter width must be odd and positive, not {width}")
    if x.shape[-1] <= pad or pad == 0:
        return x
    shape = x.shape
    flat = x.reshape(1, -1, shape[-1])
    padded = F.pad(flat, (pad, pad), mode="reflect")
    return padded.unfold(-1, width, 1).sort(dim=-1).values[..., pad].reshape(shape)


def alignment_matrix(w: torch.Tensor, width: int = MEDIAN_WIDTH) -> torch.Tensor:
    """Steps 1-3: ``[head, row, frame]`` cross-attention to the ``[row, frame]`` matrix DTW runs on."""
    return median_filter(standardise(w.double()), width).mean(0)


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotone path through ``cost`` ``[N, M]`` (step 4 of the module docstring):
    ``(rows, cols)``, its cells in order from (0, 0) to (N - 1, M - 1). Computed one
    anti-diagonal at a time (every cell of one depends only on the two before it)."""
    cost = np.asarray(cost, dtype=np.float64)
    N, M = cost.shape
    acc = np.full((N + 1, M + 1), np.inf)
    acc[0, 0] = 0.0
    trace = np.zeros((N + 1, M + 1), dtype=np.int8)
    for d in range(2, N + M + 1):  # cells (i, j), 1-based, with i + j = d
        i = np.arange(max(1, d - M), min(N, d - 1) + 1)
        j = d - i
        c0, c1, c2 = acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]
        t = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        acc[i, j] = cost[i - 1, j - 1] + np.choose(t, [c0, c1, c2])
        trace[i, j] = t
    trace[0, :], trace[:, 0] = 2, 1
    i, j, path = N, M, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        t = trace[i, j]
        if t == 0:
            i, j = i - 1, j - 1
        elif t == 1:
            i -= 1
        else:
            j -= 1
    rows, cols = np.array(path[::-1]).T
    return rows, cols


def filtered(w: torch.Tensor, width: int = MEDIAN_WIDTH) -> torch.Tensor:
    """Steps 1-2, which act on each head alone: ``[head, row, frame]`` z-scored and median
    filtered (step 3, the mean over a set of heads, can then be taken of any subset)."""
    return median_filter(standardise(w.double()), width)


def path_starts(matrix: torch.Tensor) -> list[int]:
    """Steps 4-5: the frame at which each row of the ``[row, frame]`` matrix starts on the path."""
    rows, cols = dtw(-matrix.numpy())
    jumps = np.concatenate([[True], np.diff(rows) != 0])
    return [int(c) for c in cols[jumps]]


def row_starts(w: torch.Tensor, width: int = MEDIAN_WIDTH) -> list[int]:
    """Steps 1-5: the frame at which each row of ``[head, row, frame]`` starts on the path."""
    return path_starts(alignment_matrix(w, width))


__all__ = [
    "MEDIAN_WIDTH",
    "alignment_matrix",
    "dtw",
    "filtered",
    "median_filter",
    "path_starts",
    "row_starts",
    "standardise",
]
