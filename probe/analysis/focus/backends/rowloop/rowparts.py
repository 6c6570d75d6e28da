"""The tasks, buffers and results of a CPU block for the compiled row loop (:mod:`.rowfused`).

:func:`tasks_of` cuts a block into ``(head, row start, row end)`` tasks; where each part is
computed by the thread that reads it, it goes into that thread's own buffer (:func:`part_buffer`),
kept from block to block, so the block itself is never written: what the caller reads of the
weights afterwards (:class:`Kept`: the weights near each row's diagonal, the first real query's
row) is copied out as each part is read. :func:`word_ranges` and :func:`pairs_csr` put the word
targets and template pairs into the loop's arrays. :func:`outputs` says where the loop writes each
row's terms: a block's own arrays, which :func:`results` turns back into tensors
(:func:`gathered`), or the attention's :class:`Sink`, which the caller's terms view.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

from probe.analysis.focus.backends.rowloop import workers

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


def word_bounds(words: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> np.ndarray:
    """``[B, r, 3, 2]`` (int64) from ``{name: (start, end)}`` ``[B, r]``
    (:func:`~probe.analysis.focus.definitions.terms.word_targets`): each row's word ranges as the ends of
    ``C[e] − C[s − 1]`` (``s − 1`` is −1 for a range from the first key), not yet clamped to a
    block's keys (:func:`word_ranges` does that): a caller takes them once for every row."""
    names = ("word_prev", "word_self", "word_next")
    s = torch.stack([words[m][0] for m in names], -1).long()  # [B, r, 3]
    e = torch.stack([words[m][1] for m in names], -1).long()
    return torch.stack([torch.where(s > 0, s - 1, -1), e], -1).numpy()


def word_ranges(words: dict | np.ndarray | None, B: int, r: int, n: int) -> np.ndarray:
    """``[B, r, 3, 2]`` (int64): each row's word ranges as the ends of ``C[e] − C[s − 1]``, clamped
    to the ``n`` keys as :func:`~probe.analysis.focus.definitions.terms.word_masses` clamps them (``[B, r,
    0, 2]`` without); ``words``: ``{name: (start, end)}`` ``[B, r]`` or their
    :func:`word_bounds`."""
    if words is None:
        return np.zeros((B, r, 0, 2), np.int64)
    wb = words if isinstance(words, np.ndarray) else word_bounds(words)
    lo, hi = wb[..., 0], wb[..., 1]
    return np.stack([np.where(lo >= 0, np.minimum(lo, n - 1), -1), np.clip(hi, 0, n - 1)], -1)


def pairs_csr(
    pairs: dict[str, tuple[torch.Tensor, ...]] | None, B: int, h: int, r: int, sums: np.ndarray | None = None
) -> tuple[list[str], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The templates' names and ``(ptr, keys, sums)`` for :func:`~.rowfused._tasks` (``sums``
    ``[templates, B·h·r]`` float32, each entry written by the loop; or the one given, a
    :class:`Sink`'s). The pairs of
    :func:`~probe.analysis.focus.backends.workspace.template_pairs` come in row-major order, so
    their keys are already grouped by row (others are sorted first); ``ptr`` and ``keys`` are
    remembered in the pairs' ``memo`` where they have one
    (:class:`~probe.analysis.focus.backends.workspace.Pairs`: every layer reads the same pairs)."""
    names = list(pairs or {})
    if not names:
        empty = np.zeros((0, B * h * r), np.float32) if sums is None else sums[:0]
        return [], (np.zeros(1, np.int64), np.zeros(0, np.int64), empty)
    memo = getattr(pairs, "memo", None)
    index = None if memo is None else memo.get(("csr", B, r))
    if index is None:
        at = torch.cat([(t * B + pairs[m][0].long()) * r + pairs[m][1].long() for t, m in enumerate(names)])
        keys = torch.cat([pairs[m][2].long() for m in names])
        if len(at) > 1 and bool((at[1:] < at[:-1]).any()):
            order = torch.sort(at, stable=True).indices
            at, keys = at[order], keys[order]
        ptr = torch.zeros(len(names) * B * r + 1, dtype=torch.long)
        ptr[1:] = torch.bincount(at, minlength=len(names) * B * r).cumsum(0)
        index = (ptr.numpy(), keys.numpy())
        if memo is not None:
            memo[("csr", B, r)] = index
    if sums is None:
        sums = np.empty((len(names), B * h * r), np.float32)
    return names, (*index, sums)


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
    (``{d: [B, h, r]}``, as :func:`~probe.analysis.focus.backends.reference.diagonals` gives
    them from a whole block; copied by the compiled loop as it reads each row,
    :func:`~.rowfused._kept`) and ``first_row`` ``[B, h, n]`` (zeros where that query is not
    among the block's rows)."""

    # what the loop gets where nothing is kept (the same types as arrays())
    NOTHING = (np.zeros((0, 1), np.float32), np.zeros(0, np.int64), np.zeros((0, 1), np.float32))

    def __init__(
        self,
        shape: tuple[int, int, int, int],
        window: int,
        firsts: torch.Tensor | None,
        near: np.ndarray | None = None,
    ):
        B, h, r, n = shape
        self.shape = shape
        self.offsets = np.arange(-window, window + 1)
        self.own = near is None  # else a Sink's, which the loop writes at the attention's rows
        self.diag = np.zeros((B * h * r, len(self.offsets)), np.float32) if near is None else near
        self.firsts = np.full(B, -1, np.int64) if firsts is None else firsts.long().numpy()
        self.rows = np.zeros((B * h, n), np.float32)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(near, firsts, frows)`` for :func:`~.rowfused._tasks`, which fills them."""
        return self.diag, self.firsts, self.rows

    def tensors(self) -> dict[str, torch.Tensor | dict[int, torch.Tensor]]:
        B, h, r, n = self.shape
        got: dict[str, torch.Tensor | dict[int, torch.Tensor]] = {
            "first_row": torch.from_numpy(self.rows).view(B, h, n)
        }
        if self.own:
            diag = torch.from_numpy(self.diag).view(B, h, r, len(self.offsets))
            got["diag"] = {int(d): diag[..., c] for c, d in enumerate(self.offsets)}
        return got


class Sink:
    """One attention's per-row terms (``B·h`` heads of ``Q`` rows), written by the compiled loop
    straight to each row's place as it reads the row (see :func:`~.rowfused.row_terms`'s
    ``into``), instead of into a block's arrays that the caller then copies from: ``terms``
    ``[NAMES, B·h·Q]`` float32, ``arg`` ``[B·h·Q]``, ``near`` ``[B·h·Q, 2·window + 1]`` (the
    weights near the diagonal, as :class:`Kept` keeps them) and ``pairs`` ``[templates, B·h·Q]``
    (the templates ``pair_names``' sums). :meth:`term`, :meth:`masks`, :meth:`diag` and
    :meth:`pair` are ``[B, h, Q]`` tensors viewing them (the caller's
    :class:`~probe.analysis.focus.definitions.terms.Terms` are these views, so a block summed another way
    writes to the same place)."""

    def __init__(self, B: int, h: int, Q: int, window: int, pair_names: tuple[str, ...] = ()):
        self.shape = (B, h, Q)
        self.terms = np.zeros((len(NAMES), B * h * Q), np.float32)
        self.arg = np.zeros(B * h * Q, np.int64)
        self.offsets = np.arange(-window, window + 1)
        self.near = np.zeros((B * h * Q, len(self.offsets)), np.float32)
        self.pair_names = tuple(pair_names)
        self.pairs = np.zeros((len(self.pair_names), B * h * Q), np.float32)

    def term(self, name: str) -> torch.Tensor:
        return torch.from_numpy(self.terms[NAMES.index(name)]).view(self.shape)

    def args(self) -> torch.Tensor:
        return torch.from_numpy(self.arg).view(self.shape)

    def masks(self) -> torch.Tensor:
        """``[B, h, Q, 3]``: special, punct, content (a view, not contiguous)."""
        at = NAMES.index("special")
        return torch.from_numpy(self.terms[at : at + 3]).view(3, *self.shape).permute(1, 2, 3, 0)

    def diag(self) -> dict[int, torch.Tensor]:
        near = torch.from_numpy(self.near).view(*self.shape, len(self.offsets))
        return {int(d): near[..., c] for c, d in enumerate(self.offsets)}

    def pair(self, name: str) -> torch.Tensor:
        return torch.from_numpy(self.pairs[self.pair_names.index(name)]).view(self.shape)


def outputs(
    shape: tuple[int, int, int, int],
    q0: int,
    into: Sink | None,
    pairs: dict[str, tuple[torch.Tensor, ...]] | None,
    kept: tuple[int, torch.Tensor | None] | None,
) -> tuple[tuple, tuple[list[str], tuple], Kept | None]:
    """Where :func:`~.rowfused._tasks` writes a block's rows (``shape`` ``[B, h, r, n]``, rows
    ``q0:q0 + r``): ``out`` (``(terms, arg, oq, o0)``, see there), the templates' names and CSR
    (:func:`pairs_csr`) and the :class:`Kept` (None: nothing kept). Into the block's own arrays,
    or the attention's ``into`` (its near-diagonal weights the sink's; the first rows this
    block's)."""
    B, h, r, n = shape
    if into is None:  # every row's terms and argmax, each written by the loop (every row is some task's)
        out = (np.empty((len(NAMES), B * h * r), np.float32), np.empty(B * h * r, np.int64), r, 0)
        return out, pairs_csr(pairs, B, h, r), Kept(shape, *kept) if kept is not None else None
    csr = pairs_csr(pairs, B, h, r, into.pairs)
    if tuple(csr[0]) != into.pair_names:
        raise ValueError(f"row_terms: the pairs {csr[0]} are not the sink's {list(into.pair_names)}")
    held = Kept(shape, len(into.offsets) // 2, None if kept is None else kept[1], into.near)
    return (into.terms, into.arg, into.shape[2], q0), csr, held


def column_sums(acc: np.ndarray, tasks: np.ndarray, B: int, h: int) -> torch.Tensor:
    """``[B, h, n]`` (float64): the column sums ``acc`` of each task added up per head."""
    return (
        torch.zeros(B * h, acc.shape[1], dtype=torch.float64)
        .index_add_(0, torch.from_numpy(tasks[:, 0]), torch.from_numpy(acc))
        .view(B, h, acc.shape[1])
    )


def gathered(
    out: tuple[np.ndarray, np.ndarray],
    acc: np.ndarray | None,
    tasks: np.ndarray,
    pairs: dict[str, np.ndarray],
    shape: tuple,
) -> dict[str, torch.Tensor]:
    """:func:`row_terms`'s tensors from the loop's arrays: the per-row terms ``out`` (``[NAMES,
    B·h·r]`` float32 and the argmax ``[B·h·r]``, viewed, not copied), the
    column sums ``acc`` of each task (added up per head; None: not asked for) and each
    template's pair sums."""
    B, h, r = shape
    t = torch.from_numpy(out[0]).view(len(NAMES), B, h, r)
    got = {m: t[c] for c, m in enumerate(NAMES) if m != "neg"}
    got["arg"] = torch.from_numpy(out[1]).view(B, h, r)
    if acc is not None:
        got["recv"] = column_sums(acc, tasks, B, h)
    for name, sums in pairs.items():
        got[name] = torch.from_numpy(sums).view(B, h, r)
    return got


def results(
    P: torch.Tensor,
    out: tuple,
    acc: np.ndarray | None,
    tasks: np.ndarray,
    pairs: tuple[list[str], np.ndarray],
    held: Kept | None,
    into: Sink | None,
    fill: Callable[..., None] | None,
    keep: torch.Tensor | None,
) -> dict[str, torch.Tensor] | None:
    """:func:`~.rowfused.row_terms`' result once the loop has read the block ``P``: None where it
    met a negative weight (a block never written is then filled with its weights, as the loop saw
    them, for the caller's sort); else the column sums (``acc`` None: not asked for), what was
    kept of a block never written and, without ``into``, each term (:func:`gathered`)."""
    B, h, r, _ = P.shape
    terms, _, oq, o0 = out
    if terms[NAMES.index("neg")].reshape(B * h, oq)[:, o0 : o0 + r].any():
        if fill is not None:
            weights_into(P, tasks, fill, keep)
        return None
    if into is not None:  # (the first rows only of a block never written: else the caller has P)
        got = {"recv": column_sums(acc, tasks, B, h)} if acc is not None else {}
        return got | held.tensors() if fill is not None else got
    got = gathered(out, acc, tasks, dict(zip(pairs[0], pairs[1], strict=True)), (B, h, r))
    return got if held is None else got | held.tensors()
