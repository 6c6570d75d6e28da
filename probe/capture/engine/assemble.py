"""Steps of one growing sequence assembled into one cache: each stack's rows where they belong.

A step is one forward of the model (or of its encoder) captured on its own
(:mod:`probe.capture.engine.steps`): its tensors named as a capture names them, with ``q`` query rows
per stack. The query rows of a step are the positions ``end - q .. end - 1`` of its stack, where
``end`` is the KV cache's length before the step plus ``q`` (the generating stack of a KV-cached
step) or ``q`` (a forward over the whole sequence so far: a loop without a cache, or an encoder).
Rows already read by an earlier step (a loop that re-runs the whole sequence) are recomputed
and dropped; only the new ones are kept.

The keys of a step's self-attention are mapped to positions: ``end`` keys are positions
``0 .. end - 1``; more (a static cache, allocated to its full length) are those, the rest
unwritten slots whose weight must be 0; fewer (a sliding-window cache past its window) are the
last positions, ``end - K .. end - 1``. Cross-attention keys are the source's.

What is kept per attention follows ``keep``:

* whole patterns: each step's rows placed in a ``[batch, heads, T, T]`` pattern (``T x S`` for
  cross-attention), zeros where a step had no key;
* ``"rows"``: the generating stack's rows, one per step, over every key in a buffer that grows
  by doubling (``rows`` ``[batch, heads, N, T]``, ``row_index`` ``[batch, N]``); never ``T x T``;
* top-k: each row's ``k`` largest weights with their key positions, ``[batch, heads, T, k]``.

Residual tensors ``[batch, q, d]`` are concatenated along the positions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from probe.cache import format as _format
from probe.cache.perf import heap
from probe.capture.consumers.kept import Keep
from probe.errors import ProbeError

_TOPK = ("topk_values", "topk_indices", "topk_mass")
# every step names the same keys: parsed once (a generation's steps are thousands)
parse_key = functools.lru_cache(maxsize=8192)(_format.parse_key)
parse_name = functools.lru_cache(maxsize=8192)(_format.parse_name)


@dataclass
class Step:
    """One captured forward: its named ``tensors`` and metadata, whether its root call was the
    model itself (False: a submodule such as the encoder, or a vision tower, that ``generate``
    runs first; ``source`` names its stack) and the KV cache's length before it."""

    tensors: dict[str, Tensor]
    meta: dict[str, Any]
    whole_model: bool
    cached: int
    keys: dict[str, int] = field(default_factory=dict)  # attention field key -> the step's key count
    source: str | None = None  # a submodule's step: the name of its lone stack (None: the model's)
    lean: bool = False  # a lean decode step (its rows may wait: engine/deferred.py)


@dataclass
class _Rows:
    """The kept rows of one attention in a buffer that grows by doubling (rows and keys)."""

    hint_rows: int = 1
    hint: int = 0  # the keys expected at most (a generation's final length): allocated at once
    buf: Tensor | None = None
    n: int = 0
    width: int = 0
    positions: list[int] = field(default_factory=list)

    def add(self, pos: int | list[int], row: Tensor, off: int) -> None:
        """Rows ``row`` ``[batch, heads, rows, keys]`` at positions ``pos`` (one or a list), their
        key 0 at key ``off``."""
        B, H, M, K = row.shape
        need_r, need_k = self.n + M, off + K
        if self.buf is None or need_r > self.buf.size(2) or need_k > self.buf.size(3):
            old = self.buf
            rows = old.size(2) if old is not None else 0
            cap_r = rows if need_r <= rows else max(need_r, 2 * rows, self.hint_rows)
            cap_k = _w(old) if need_k <= _w(old) else max(need_k, 2 * _w(old), self.hint)
            # zero-filled by the system, page by page as rows are written: the keys a row does
            # not see yet (a generation's later positions) are never touched
            self.buf = heap.mapped_empty((B, H, cap_r, cap_k), row.dtype, row.device)
            if old is not None:
                self.buf[:, :, : self.n, : old.size(3)] = old[:, :, : self.n]
        self.buf.narrow(2, self.n, M).narrow(-1, off, K).copy_(row)
        self.n += M
        self.width = max(self.width, need_k)
        if isinstance(pos, list):
            self.positions.extend(pos)
        else:
            self.positions.append(pos)

    def result(self, width: int) -> tuple[Tensor, Tensor]:
        rows = self.buf[:, :, : self.n, :width]
        if self.buf.size(3) < width:
            rows = torch.nn.functional.pad(rows, (0, width - self.buf.size(3)))
        index = torch.tensor([self.positions] * rows.size(0), dtype=torch.long)
        return rows.contiguous(), index


@dataclass
class _Grow:
    """Each step's positions of one residual or top-k field, appended along ``dim`` into one buffer
    that grows by doubling (``hint``: the positions expected at most, allocated at once). Kept as
    one small tensor per step instead, a long generation's thousands of blocks would sit in the C
    heap between the KV cache's growing blocks and keep it from reusing them."""

    dim: int
    hint: int = 0
    buf: Tensor | None = None
    n: int = 0

    def add(self, t: Tensor) -> None:
        d, need = self.dim, self.n + t.size(self.dim)
        old = self.buf
        if old is not None and (
            old.shape[:d] != t.shape[:d] or old.shape[d + 1 :] != t.shape[d + 1 :] or old.dtype != t.dtype
        ):
            raise ProbeError(
                f"a step's tensor of shape {list(t.shape)} does not continue the earlier steps' "
                f"{list(old.shape)}; probe.trace(steps=True) needs one batch, head count and width throughout"
            )
        if old is None or need > old.size(d):
            cap = max(need, 2 * (old.size(d) if old is not None else 0), self.hint)
            shape = list(t.shape)
            shape[d] = cap
            self.buf = t.new_empty(shape)
            if old is not None:
                self.buf.narrow(d, 0, self.n).copy_(old.narrow(d, 0, self.n))
        self.buf.narrow(d, self.n, t.size(d)).copy_(t)
        self.n = need

    def result(self) -> Tensor:
        """The positions appended, in a tensor of their own (the buffer itself when it is full)."""
        if self.buf.size(self.dim) == self.n:
            return self.buf
        return self.buf.narrow(self.dim, 0, self.n).clone()


def _w(t: Tensor | None) -> int:
    return 0 if t is None else t.size(3)


class Assembler:
    """Gathers :class:`Step` s into the tensors of one cache (see the module docstring)."""

    def __init__(self, keep: Keep, hint: tuple[int, int] = (1, 0)) -> None:
        self.keep = keep
        self.hint = hint  # (rows, keys) a generation will keep at most: its rows buffers at once
        self.seen: dict[str, int] = {}  # stack -> positions read so far
        self.pieces: dict[str, list[tuple[int, Tensor, int]]] = {}  # key -> (row, rows, key offset)
        self.rows: dict[str, _Rows] = {}
        self.lists: dict[str, _Grow] = {}  # residuals and top-k fields, per key
        self.metas: dict[str, dict[str, Any]] = {}  # stack -> the meta of its first step
        self.renamed: set[str] = set()  # stacks whose self-attention a step judged cross (see _field)
        self.steps = 0
        self.impls: set[str] = set()
        self.finished: dict[str, Tensor] = {}
        self.sources: set[str] = set()  # stacks of submodule steps (read once, never generated)
        self.first: dict[str, set[str]] = {}  # stack -> the keys of its first step
        self._routes: dict[tuple, tuple[str, Any]] = {}  # see _route

    # -- one step ------------------------------------------------------------------------------
    def add(self, step: Step) -> None:
        """Fold one captured forward in (its new rows only)."""
        stacks = _stacks_of(step)
        if step.source is not None:
            self.sources.update(stacks)
        for stack, keys in stacks.items():
            q = _queries(step.tensors, keys)
            generating = step.whole_model and stack != "encoder" and stack not in self.sources
            end = step.cached + q if generating else q
            seen = self.seen.get(stack, 0)
            start = end - q
            if start > seen:
                raise ProbeError(
                    f"a forward inside probe.trace(steps=True) read positions {start}..{end - 1} of the "
                    f"{stack} but only {seen} were read before it; run the steps of one growing sequence"
                )
            if stack not in self.metas:
                self.metas[stack] = step.meta
                self.first[stack] = set(keys)
            elif end <= seen and not generating:
                continue  # the source read again (a loop re-running the encoder): nothing new
            elif end <= seen:
                raise ProbeError(
                    f"a forward inside probe.trace(steps=True) read positions {start}..{end - 1} of the "
                    f"{stack}, which were read already; each step must add positions to one sequence "
                    "(capture separate sequences in separate traces)"
                )
            for k in keys:
                self._field(k, step, stack, start, seen, end, generating)
            self.seen[stack] = end
        self.steps += 1
        self.impls.update(step.meta.get("attention_implementations", []))

    def _route(self, k: str, stack: str, gen: bool) -> tuple[str, Any]:
        """The key a step's key ``k`` is kept under and its parsed name (the same every step of a
        generation once its stack's first step is in: worked out once per key)."""
        memo = (k, stack, gen, "encoder" in self.seen)
        got = self._routes.get(memo)
        if got is not None:
            return got
        n = parse_name(parse_key(k)[2])
        own_key = k.replace(".cross_attn", ".self_attn")
        both = {k, own_key} <= self.first.get(stack, set())  # its first step had both: real cross
        if n.role == "cross" and gen and "encoder" not in self.seen and not both:
            # a decoder-only model's self-attention over a sliding-window or static cache, whose
            # key count is no sequence length of the step: judged cross by the step alone
            k = own_key
            self.renamed.add(stack)
            n = parse_name(parse_key(k)[2])
        self._routes[memo] = (k, n)
        return k, n

    def _field(self, k: str, step: Step, stack: str, start: int, seen: int, end: int, gen: bool) -> None:
        step_key, t, K = k, step.tensors[k], step.keys.get(k)
        skip = max(0, seen - start)
        k, n = self._route(k, stack, gen)
        if n.field is None:  # a residual tensor [batch, q, d] (or a delta)
            self._grow(k, 1, gen).add(t[:, skip:] if skip else t)
            return
        own = n.role == "self" and gen
        if n.field == "pattern":
            t, off = _keys(t, end, own, k)
            self.pieces.setdefault(k, []).append((start + skip, t[:, :, skip:], off))
        elif n.field == "rows":
            index = _row_index(step.tensors[step_key.removesuffix(".rows") + ".row_index"])
            t, off = _keys(t, end, own, k)
            for j, pos in enumerate(index):
                if start + pos >= seen:
                    kept = self.rows.get(k)
                    if kept is None:
                        kept = self.rows[k] = _Rows(*self.hint) if own else _Rows()
                    kept.add(start + pos, t[:, :, j : j + 1], off)
        elif n.field in _TOPK:
            t = t[:, :, skip:]
            if n.field != "topk_mass":
                t = _full_k(t, self.keep.k, n.field == "topk_indices")
            if n.field == "topk_indices" and own and K is not None and K < end:
                t = torch.where(t >= 0, t + (end - K), t)  # sliding window: key 0 is position end - K
            self._grow(k, 2, gen).add(t)
        elif n.field != "row_index":
            name = parse_key(k)[2]
            raise ProbeError(f"probe.trace(steps=True) cannot assemble the field {name} across steps")

    def add_block(self, prefix: str, positions: list[int], fields: dict[str, Tensor]) -> None:
        """Rows of the generating stack's attention ``prefix`` computed for several decode steps at
        once (:mod:`probe.capture.engine.deferred`): each field ``[batch, heads, steps, ...]``, the
        steps' query ``positions`` in order, every row over keys from position 0."""
        for name, t in fields.items():
            stack = parse_key(prefix + "." + name)[0]
            k, n = self._route(prefix + "." + name, stack, True)
            if n.field == "rows":
                kept = self.rows.get(k)
                if kept is None:
                    kept = self.rows[k] = _Rows(*self.hint)
                kept.add(positions, t, 0)
            elif n.field == "pattern":  # the steps' rows of the whole pattern, in runs of positions
                pieces = self.pieces.setdefault(k, [])
                i = 0
                while i < len(positions):
                    j = i + 1
                    while j < len(positions) and positions[j] == positions[j - 1] + 1:
                        j += 1
                    pieces.append((positions[i], t[:, :, i:j], 0))
                    i = j
            else:  # top-k: values and indices padded to k as a step's are, the mass as it is
                if n.field != "topk_mass":
                    t = _full_k(t, self.keep.k, n.field == "topk_indices")
                self._grow(k, 2, True).add(t)

    def _grow(self, k: str, dim: int, generating: bool) -> _Grow:
        got = self.lists.get(k)
        if got is None:  # a generating stack reads up to hint[1] positions; others, once
            got = self.lists[k] = _Grow(dim, self.hint[1] if generating else 0)
        return got

    # -- the cache -----------------------------------------------------------------------------
    def finish(self) -> dict[str, Tensor]:
        """Every assembled tensor by cache key."""
        out: dict[str, Tensor] = {}
        for k, grown in self.lists.items():
            out[k] = grown.result()
        for k, pieces in self.pieces.items():
            out[k] = self._pattern(k, pieces)
        for k, r in self.rows.items():
            stack = parse_key(k)[0]
            own = ".self_attn" in k
            out[k], out[k.removesuffix(".rows") + ".row_index"] = r.result(
                self.seen[stack] if own else r.width
            )
        if self.keep.kind == "topk":
            _pad_topk(out, self.keep.k, self.seen)
        order = {stack: i for i, stack in enumerate(self.metas)}  # the stacks as they first ran
        self.finished = dict(sorted(out.items(), key=lambda kv: _order(kv[0], order)))
        return self.finished

    def keep_json(self) -> Any:
        """The metadata's ``keep``: the kept rows counted from the end (``[-N, ..., -1]``) or top-k."""
        if self.keep.kind == "topk":
            return {"topk": self.keep.k}
        n = max((r.n for k, r in self.rows.items() if ".self_attn" in k), default=0)
        return {"rows": list(range(-n, 0))}

    def _pattern(self, k: str, pieces: list[tuple[int, Tensor, int]]) -> Tensor:
        stack, _, name = parse_key(k)
        T = self.seen[stack]
        width = T if ".self_attn" in name else max(p.size(-1) + off for _, p, off in pieces)
        first = pieces[0][1]
        out = first.new_zeros(first.size(0), first.size(1), T, width)
        for r0, p, off in pieces:
            out[:, :, r0 : r0 + p.size(2), off : off + p.size(3)] = p
        pieces.clear()
        return out


def _row_index(index: Tensor) -> list[int]:
    if index.size(0) > 1 and not bool((index == index[:1]).all()):
        raise ProbeError("keep='rows' over steps keeps the same rows of every text; generate one text")
    return index[0].tolist()


def _full_k(t: Tensor, k: int, indices: bool) -> Tensor:
    """Top-k values or indices of a step padded to ``k`` (a step with fewer keys): zero weights,
    index -1 (filled in at the end with positions the row did not choose)."""
    if t.size(-1) >= k:
        return t
    return torch.nn.functional.pad(t, (0, k - t.size(-1)), value=-1 if indices else 0)


def _order(k: str, order: dict[str, int]) -> tuple:
    stack, layer, _ = parse_key(k)
    return (order.get(stack, len(order)), layer)


def _stacks_of(step: Step) -> dict[str, list[str]]:
    """Each stack of the step -> its keys; a submodule's lone stack is named ``step.source``."""
    out: dict[str, list[str]] = {}
    for k in step.tensors:
        out.setdefault(parse_key(k)[0], []).append(k)
    new = step.source
    if not step.whole_model and len(out) == 1 and new is not None:
        ((only, keys),) = out.items()
        if only != new:
            out = {new: [new + k[len(only) :] for k in keys]}
            step.tensors.update({n: step.tensors.pop(o) for o, n in zip(keys, out[new], strict=True)})
            step.keys = {
                (new + k[len(only) :] if k.startswith(only + ".") else k): v for k, v in step.keys.items()
            }
            step.meta = rename_stack(step.meta, only, new)
    return out


def rename_stack(meta: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """``meta`` with stack ``old`` called ``new`` in its ``stacks`` and ``layers``."""
    meta = dict(meta)
    meta["stacks"] = {new if s == old else s: v for s, v in meta.get("stacks", {}).items()}
    meta["layers"] = [dict(e, stack=new) if e.get("stack") == old else e for e in meta.get("layers", [])]
    return meta


def _queries(tensors: dict[str, Tensor], keys: list[str]) -> int:
    """The query rows of a stack in one step: its residual stream's positions, else a pattern's rows."""
    for k in keys:
        n = parse_name(parse_key(k)[2])
        if n.field is None and tensors[k].dim() >= 2:
            return int(tensors[k].shape[1])
    for k in keys:
        if k.endswith((".pattern", ".topk_values")):
            return int(tensors[k].shape[2])
    raise ProbeError("probe.trace(steps=True) needs each layer's residual stream or pattern; keep them")


def _keys(t: Tensor, end: int, own: bool, k: str) -> tuple[Tensor, int]:
    """A step's weights over its keys as positions: ``(weights, offset of key 0)``."""
    K = t.size(-1)
    if not own or K == end:
        return t, 0
    if K > end:  # a static cache: slots past the sequence hold no key yet
        if bool((t[..., end:] != 0).any()):
            raise ProbeError(
                f"{k}: a step put weight on {K - end} key slots past the {end} positions read so far; "
                "probe cannot map this cache's keys to positions"
            )
        return t[..., :end], 0
    return t, end - K  # a sliding window: the last K positions


def _pad_topk(out: dict[str, Tensor], k: int, seen: dict[str, int]) -> None:
    """Top-k cut to the keys a whole-sequence capture has (``min(k, T)``); the slots of rows that
    saw fewer keys hold zero weights on positions they did not choose (the smallest such)."""
    for key in [x for x in out if x.endswith(".topk_values")]:
        base = key.removesuffix(".topk_values")
        stack = parse_key(key)[0]
        T = seen[stack] if ".self_attn" in key else None
        values, indices = out[key], out[base + ".topk_indices"]
        if T is not None and values.size(-1) > T:
            values, indices = values[..., :T].contiguous(), indices[..., :T].contiguous()
        width = T if T is not None else values.size(-1)
        empty = (indices < 0) | (indices >= width) if T is not None else indices < 0
        if bool(empty.any()):
            indices = indices.clone()
            for row in empty.any(-1).nonzero().tolist():
                idx = indices[tuple(row)]
                holes = empty[tuple(row)]
                free = sorted(set(range(width)) - set(idx[~holes].tolist()))
                idx[holes] = torch.tensor(free[: int(holes.sum())], dtype=idx.dtype, device=idx.device)
        out[key], out[base + ".topk_indices"] = values, indices
