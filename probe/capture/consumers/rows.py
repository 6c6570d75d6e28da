"""Pattern consumers for long contexts: selected query rows, or the top-k keys of every row.

Both implement the seam of :mod:`probe.capture.hooks.record` and never hold a whole ``[query, key]``
pattern that the model did not compute itself:

* :class:`KeepRows` stores the chosen query rows of each attention over every key,
  ``rows`` ``[batch, head, row, key]`` and ``row_index`` ``[batch, row]`` (the query positions, per
  text). SDPA rows are recomputed alone (:func:`~probe.capture.patterns.sdpa_rows`, ``O(rows ·
  keys)``); a softmax the model computed is sliced.
* :class:`KeepTopK` stores the ``k`` largest weights of every row, sorted from the largest,
  ``topk_values`` and ``topk_indices`` (int32 key positions) ``[batch, head, query, k]``, and
  ``topk_mass`` ``[batch, head, query]`` (their sum: the share of the row they keep). SDPA weights
  are recomputed a block of rows at a time (:func:`~probe.capture.patterns.sdpa_blocks`) and each
  block is reduced before the next; ``k`` is cut to the number of keys when there are fewer.
  A row with fewer than ``k`` keys it can see fills the rest with zero weights on keys it cannot see.

Each also keeps query rows 0 and ``q // 2`` until the attention closes, to judge causality
as :func:`~probe.capture.consumers.keep.is_causal` does for whole patterns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from probe.cache.selection import Selection
from probe.capture.calls import Attention
from probe.capture.consumers.keep import batch_size, restore_layout
from probe.capture.consumers.kept import Keep
from probe.capture.consumers.scale import scaled
from probe.capture.hooks.store import Store
from probe.capture.patterns import sdpa_blocks, sdpa_rows
from probe.errors import ProbeError

CHUNK = 128  # query rows per recomputed block (top-k)


class RowPicker:
    """Resolves ``keep={"rows": [...]}`` to query positions, per text.

    A row index counts the *real* queries of a text (``attention_mask`` or
    ``target_attention_mask`` of the metadata, whichever is as wide as the queries): ``-1`` is
    each text's last real token, ``0`` its first. Without a mask of that width (float inputs,
    a forward run by hand inside ``probe.trace``) every query position is real.
    """

    def __init__(self, rows: tuple[int, ...], meta: dict[str, Any]) -> None:
        self.rows = rows
        self.masks = [m for m in (meta.get("attention_mask"), meta.get("target_attention_mask")) if m]
        self._seen: dict[tuple[int, int], Tensor] = {}

    def check(self) -> None:
        """Refuse rows some text does not have, before the model runs."""
        for mask in self.masks:
            self._resolve(len(mask[0]), len(mask), [mask])

    def index(self, q: int, batch: int, device: torch.device) -> Tensor:
        """int64 ``[batch, rows]``: the query positions kept for ``q`` queries of ``batch`` texts."""
        got = self._seen.get((q, batch))
        if got is None:
            masks = [m for m in self.masks if len(m) == batch and len(m[0]) == q]
            if len({tuple(map(tuple, m)) for m in masks}) > 1:
                raise ProbeError(
                    f"keep rows {list(self.rows)}: the source and target texts are both {q} tokens long "
                    "but padded differently, so which are real queries is ambiguous; capture them "
                    "unpadded (one text at a time) or keep whole patterns"
                )
            got = self._seen[(q, batch)] = self._resolve(q, batch, masks[:1])
        return got.to(device)

    def _resolve(self, q: int, batch: int, masks: list) -> Tensor:
        out = []
        for b in range(batch):
            real = [j for j, m in enumerate(masks[0][b]) if m] if masks else list(range(q))
            for r in self.rows:
                if not -len(real) <= r < len(real):
                    raise ProbeError(
                        f"keep rows {list(self.rows)}: row {r} does not exist in text {b}, which has "
                        f"{len(real)} real positions; choose rows from {-len(real)} to {len(real) - 1}"
                    )
            out.append([real[r] for r in self.rows])
        return torch.tensor(out, dtype=torch.long)


def _query_key(args: tuple, kwargs: dict) -> tuple[Tensor, Tensor]:
    query = args[0] if args else kwargs["query"]
    key = args[1] if len(args) > 1 else kwargs["key"]
    return query, key


def _causal(probe: Tensor, q: int, k: int) -> bool:
    """:func:`~probe.capture.consumers.keep.is_causal` from query rows 0 and ``q // 2``
    (``[batch, heads, 2, k]``)."""
    off = k - q
    first = (probe[:, :, 0, off + 1 :] == 0).flatten(1).all(dim=1)
    middle = (probe[:, :, 1, off + q // 2 + 1 :] == 0).flatten(1).all(dim=1)
    return bool((first & middle).any())


class _Kept:
    """What both consumers share: parts gathered per attention, heads cut and causality at close."""

    def __init__(self, store: Store, selection: Selection) -> None:
        self.store = store
        self.selection = selection

    def _layout(self, attn: Attention, parts: list[Tensor]) -> Tensor:
        t = restore_layout(parts, batch_size(attn.primary, attn.qk[0]))
        heads = self.selection.heads
        if heads is not None:
            self.selection.check_heads(t.shape[1])
            t = t[:, heads]
        return t

    def _judge(self, attn: Attention, probes: list[Tensor]) -> None:
        probe = self._layout(attn, probes)
        q, k = attn.qk
        if attn.role == "self" and q > 1:
            attn.causal = _causal(probe, q, k)
        attn.shape = (probe.shape[0], probe.shape[1], q, k)

    def _extra(self, attn: Attention) -> None:
        """Store the other fields the recorder mapped with the pattern (Pegasus-X's ``globals``
        and ``global_rows``, small beside a pattern) whole, heads cut as the rows are."""
        for name, t in attn.extra.items():
            heads = self.selection.heads
            attn.fields[name] = self.store.put(t if heads is None else t[:, heads], owned=True)
        attn.extra = {}

    @staticmethod
    def _probe_rows(p: Tensor) -> Tensor:
        """Rows 0 and ``q // 2`` of a whole pattern ``[..., q, k]`` (a copy)."""
        return p[..., [0, p.size(-2) // 2], :].clone()


class KeepRows(_Kept):
    """Stores the query rows ``picker`` names of every attention (see the module docstring)."""

    def __init__(self, store: Store, selection: Selection, picker: RowPicker) -> None:
        super().__init__(store, selection)
        self.picker = picker

    def weights(self, attn: Attention, pattern: Tensor, impl: str) -> None:
        p = restore_layout([pattern.detach()], batch_size(attn.primary, attn.qk[0]))
        B, H, _, K = p.shape
        idx = self.picker.index(p.size(-2), B, p.device)
        rows = p.gather(-2, idx[:, None, :, None].expand(B, H, idx.size(1), K))
        if attn.scale is not None:  # a derived kind's shadow (kinds.py)
            rows = scaled(rows, attn.scale)
        attn.parts.append((rows, self._probe_rows(p), idx))

    def sdpa(self, attn: Attention, args: tuple, kwargs: dict) -> None:
        query, _ = _query_key(args, kwargs)
        if query.dim() != 4:
            raise ProbeError(
                f"keep rows needs scaled_dot_product_attention queries laid out [batch, heads, "
                f"query, dim]; this model passes {query.dim()}-d ones: keep whole patterns instead"
            )
        B, L = query.size(0), query.size(-2)
        idx = self.picker.index(L, B, query.device)
        rows = sdpa_rows(*args, **kwargs, rows=idx)
        if attn.scale is not None:
            rows = scaled(rows, attn.scale)
        probe = sdpa_rows(*args, **kwargs, rows=torch.tensor([[0, L // 2]] * B, device=query.device))
        attn.parts.append((rows, probe, idx))

    def close(self, attn: Attention) -> None:
        if not attn.parts:
            return
        rows = self._layout(attn, [r for r, _, _ in attn.parts])
        self._judge(attn, [p for _, p, _ in attn.parts])
        idx = attn.parts[0][2]
        attn.fields["rows"] = self.store.put(rows, owned=True)
        attn.fields["row_index"] = self.store.put(idx.cpu().clone(), owned=True)  # one per attention
        attn.parts.clear()
        self._extra(attn)


class KeepTopK(_Kept):
    """Stores the ``k`` largest weights of every query row (see the module docstring)."""

    def __init__(self, store: Store, selection: Selection, k: int) -> None:
        super().__init__(store, selection)
        self.k = k

    def weights(self, attn: Attention, pattern: Tensor, impl: str) -> None:
        p = pattern.detach() if attn.scale is None else scaled(pattern.detach(), attn.scale)
        values, indices = p.topk(min(self.k, p.size(-1)), dim=-1)
        mass = values.float().sum(-1)
        attn.parts.append((values, indices.int(), mass, self._probe_rows(p)))

    def sdpa(self, attn: Attention, args: tuple, kwargs: dict) -> None:
        query, key = _query_key(args, kwargs)
        L, S = query.size(-2), key.size(-2)
        k = min(self.k, S)
        values = indices = mass = probe = None
        for i, e, blk in sdpa_blocks(*args, **kwargs, chunk=CHUNK):
            if attn.scale is not None:
                blk = scaled(blk, attn.scale, first=True)
            if values is None:
                lead, dev = blk.shape[:-2], blk.device
                values = torch.empty(lead + (L, k), dtype=torch.float32, device=dev)
                indices = torch.empty(lead + (L, k), dtype=torch.int32, device=dev)
                mass = torch.empty(lead + (L,), dtype=torch.float32, device=dev)
                probe = torch.zeros(lead + (2, S), dtype=torch.float32, device=dev)
            kend = blk.size(-1)
            kk = min(k, kend)
            v, ix = blk.topk(kk, dim=-1)
            values[..., i:e, :kk], indices[..., i:e, :kk] = v, ix
            if kk < k:  # keys past kend (unseen by every row of a causal block) weigh 0
                values[..., i:e, kk:] = 0
                indices[..., i:e, kk:] = torch.arange(kend, kend + k - kk, dtype=torch.int32, device=dev)
            mass[..., i:e] = v.sum(-1)
            for j, r in enumerate((0, L // 2)):
                if i <= r < e:
                    probe[..., j, :kend] = blk[..., r - i, :]
        attn.parts.append((values, indices, mass, probe))

    def close(self, attn: Attention) -> None:
        if not attn.parts:
            return
        parts = attn.parts
        values = self._layout(attn, [p[0] for p in parts])
        indices = self._layout(attn, [p[1] for p in parts])
        mass = self._layout(attn, [p[2].unsqueeze(-1) for p in parts]).squeeze(-1)
        self._judge(attn, [p[3] for p in parts])
        attn.fields["topk_values"] = self.store.put(values, owned=True)
        attn.fields["topk_indices"] = self.store.put(indices, owned=True)
        attn.fields["topk_mass"] = self.store.put(mass, owned=True)
        parts.clear()
        self._extra(attn)


def consumer(keep: Keep, store: Store, selection: Selection, meta: dict[str, Any]) -> Any:
    """The pattern consumer for ``keep`` (None for whole patterns: the tracer's default)."""
    if keep.kind == "rows":
        picker = RowPicker(keep.rows, meta)
        picker.check()
        return KeepRows(store, selection, picker)
    if keep.kind == "topk":
        return KeepTopK(store, selection, keep.k)
    return None
