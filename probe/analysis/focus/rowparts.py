"""The tasks, buffers and results of a CPU block for the compiled row loop (:mod:`.rowfused`).

:func:`tasks_of` cuts a block into ``(head, row start, row end)`` tasks; where each part is
computed by the thread that reads it, it goes into that thread's own buffer (:func:`part_buffer`),
kept from block to block, so the block itself is never written: what the caller reads of the
weights afterwards (:class:`Kept`: the weights near each row's diagonal, the first real query's
row) is copied out as each part is read. :func:`word_ranges` and :func:`pairs_csr` put the word
targets and template pairs into the loop's arrays; :func:`gathered` turns the loop's arrays back
into tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

from probe.analysis.focus import workers

# each row's terms in the loop's output (then its argmax)
NAMES = (
    "total", "ent", "top", "span", "signed", "dist", "reach", "beyond_16", "beyond_128", "beyond_1024",
    "special", "punct", "content", "first", "after", "neg", "word_prev", "word_self", "word_next",
)  # fmt: skip
PART = 1 << 18  # weights per part when the block is filled part by part (1 MiB: see tasks_of)
PART_ROWS = 128  # but no fewer rows a part (a skinnier matrix product is slower than the cache saves)
TRIM_ROWS = 128  # the fewest rows a part is cut to for trimming (see tasks_of)
TAIL = 4  # each of the last tasks is cut into this many (see tasks_of), of at least TAIL_ROWS rows
TAIL_ROWS = 32


def tasks_of(heads: int, r: int, n: int, k: int, filled: bool, causal_end: int = 0) -> np.ndarray:
    """The ``(head, row start, row end)`` tasks of a block for ``k`` threads: a head's rows, split
    further when there are fewer heads than threads, or (``filled``: each part computed by its
    thread) past :data:`PART` weights, into parts of at least :data:`PART_ROWS` rows: one part
    is one matrix product, and its rows share one packing of the keys; the loop reads a row at a
    time, so only the row need stay in the core's cache (in turns in one process: parts of 1
    MiB took 0.91 times the time of parts of 4 MiB at 4,096 keys, with parts of 64 rows; parts
    of 128 rows took 0.97 times the time of 64 at 16,384 keys, where each part reads the head's
    4 MiB of keys once, and 0.99 at 4,096). ``causal_end``: the block's
    last query + 1 where each part computes only the keys its rows see (trimmed, see
    :func:`~.rowfused.row_terms`): then parts of at most a quarter of that many rows (the keys
    after a row's query that its part computes anyway are then at most about an eighth), but at
    least :data:`TRIM_ROWS`. The last ``k`` tasks are each cut into :data:`TAIL` (of at least
    :data:`TAIL_ROWS` rows): the threads take tasks in order, so each ends within a short task
    of the others (where the last whole part of one thread ran alone, 5.5% of the threads' time
    sat idle at 4,096 tokens; 4% with the tail cut)."""
    per = -(-2 * k // heads) if heads < 2 * k else 1
    if filled:
        per = max(per, min(-(-r * n // PART), r // PART_ROWS))
    if causal_end:
        per = max(per, min(-(-4 * r // causal_end), r // TRIM_ROWS))
    tasks = [(bh, a0, a1) for bh in range(heads) for a0, a1 in workers.parts(r, per)]
    if k > 1:  # the last k tasks in quarters (of TAIL_ROWS rows or more)
        cut = lambda a0, a1: workers.parts(a1 - a0, max(1, min(TAIL, (a1 - a0) // TAIL_ROWS)))  # noqa: E731
        tasks[-k:] = [(bh, a0 + b0, a0 + b1) for bh, a0, a1 in tasks[-k:] for b0, b1 in cut(a0, a1)]
    return np.array(tasks, np.int64)


def word_ranges(words: dict | None, B: int, r: int, n: int) -> np.ndarray:
    """``[B, r, 3, 2]`` (int64): each row's word ranges as the ends of ``C[e] − C[s − 1]``, clamped
    as :func:`~probe.analysis.focus.metrics.word_masses` clamps them (``[B, r, 0, 2]`` without)."""
    if words is None:
        return np.zeros((B, r, 0, 2), np.int64)
    names = ("word_prev", "word_self", "word_next")
    s = torch.stack([words[m][0] for m in names], 1)  # [B, 3, r]
    e = torch.stack([words[m][1] for m in names], 1)
    wr = torch.stack([torch.where(s > 0, (s - 1).clamp(0, n - 1), -1), e.clamp(0, n - 1)], -1)
    return wr.permute(0, 2, 1, 3).contiguous().numpy().astype(np.int64)


def pairs_csr(
    pairs: dict[str, tuple[torch.Tensor, ...]] | None, B: int, h: int, r: int
) -> tuple[list[str], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The templates' names and ``(ptr, keys, sums)`` for :func:`~.rowfused._tasks` (``sums`` zeros)."""
    names = list(pairs or {})
    if not names:
        return [], (np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros((B * h * r, 0), np.float64))
    at = torch.cat([(t * B + pairs[m][0].long()) * r + pairs[m][1].long() for t, m in enumerate(names)])
    keys = torch.cat([pairs[m][2].long() for m in names])
    order = torch.sort(at, stable=True).indices
    ptr = torch.zeros(len(names) * B * r + 1, dtype=torch.long)
    ptr[1:] = torch.bincount(at, minlength=len(names) * B * r).cumsum(0)
    return names, (ptr.numpy(), keys[order].numpy(), np.zeros((B * h * r, len(names)), np.float64))


_LOCAL = threading.local()  # each thread's part buffer (see part_buffer)


def part_buffer(size: int) -> np.ndarray:
    """This thread's buffer of at least ``size`` float32, kept from block to block (a fresh one
    for each block paid its page faults each time): at most the largest part, :data:`PART`
    weights (1 MiB) or :data:`PART_ROWS` rows, a thread."""
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.size < size:
        buf = _LOCAL.buf = np.empty(size, np.float32)
    return buf


def weights_into(
    P: torch.Tensor, tasks: np.ndarray, fill: Callable[..., None], keep: torch.Tensor | None
) -> None:
    """``P`` filled with its weights, part by part, with the weights on keys where ``keep`` is 0
    dropped as the loop drops them (for the caller's sort)."""
    B, h, r, n = P.shape
    flat = P.view(B * h, r, n)
    for bh, a0, a1 in tasks.tolist():
        fill(bh, a0, a1, softmax=True, out=flat[bh, a0:a1])
    if keep is not None:
        P.mul_(keep[:, None, None, :].to(P.dtype))


class Kept:
    """What the caller reads of a block's weights after the loop, where each part was computed
    into a thread's buffer and the block never written: each row's weights on the keys ``i + d``,
    ``|d| <= window`` (0 where that key is missing), and the row of each text's first real query
    (``firsts`` ``[B]``; None: none asked for), whole: :meth:`tensors` gives them as ``diag``
    (``{d: [B, h, r]}``, as :func:`~.rowblock.diagonals` gives them from a whole block; copied by
    the compiled loop as it reads each row, :func:`~.rowfused._kept`) and ``first_row`` ``[B, h,
    n]`` (zeros where that query is not among the block's rows)."""

    # what the loop gets where nothing is kept (the same types as arrays())
    NOTHING = (np.zeros((0, 1), np.float32), np.zeros(0, np.int64), np.zeros((0, 1), np.float32))

    def __init__(self, shape: tuple[int, int, int, int], window: int, firsts: torch.Tensor | None):
        B, h, r, n = shape
        self.shape = shape
        self.offsets = np.arange(-window, window + 1)
        self.diag = np.zeros((B * h * r, len(self.offsets)), np.float32)
        self.firsts = np.full(B, -1, np.int64) if firsts is None else firsts.long().numpy()
        self.rows = np.zeros((B * h, n), np.float32)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(near, firsts, frows)`` for :func:`~.rowfused._tasks`, which fills them."""
        return self.diag, self.firsts, self.rows

    def tensors(self) -> dict[str, torch.Tensor | dict[int, torch.Tensor]]:
        B, h, r, n = self.shape
        diag = torch.from_numpy(self.diag).view(B, h, r, len(self.offsets))
        return {
            "diag": {int(d): diag[..., c] for c, d in enumerate(self.offsets)},
            "first_row": torch.from_numpy(self.rows).view(B, h, n),
        }


def gathered(
    out: np.ndarray, acc: np.ndarray | None, tasks: np.ndarray, pairs: dict[str, np.ndarray], shape: tuple
) -> dict[str, torch.Tensor]:
    """:func:`row_terms`'s tensors from the loop's arrays: the per-row terms ``out``, the
    column sums ``acc`` of each task (added up per head; None: not asked for) and each
    template's pair sums."""
    B, h, r = shape
    t = torch.from_numpy(out[:, : len(NAMES)]).float().T.reshape(len(NAMES), B, h, r)
    got = {m: t[c] for c, m in enumerate(NAMES) if m != "neg"}
    got["arg"] = torch.from_numpy(out[:, len(NAMES)]).long().reshape(B, h, r)
    if acc is not None:
        got["recv"] = (
            torch.zeros(B * h, acc.shape[1], dtype=torch.float64)
            .index_add_(0, torch.from_numpy(tasks[:, 0]), torch.from_numpy(acc))
            .view(B, h, acc.shape[1])
        )
    for name, sums in pairs.items():
        got[name] = torch.from_numpy(np.ascontiguousarray(sums)).float().reshape(B, h, r)
    return got
