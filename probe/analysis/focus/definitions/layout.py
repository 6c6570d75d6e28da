"""Everything about one layer's pattern that does not depend on the heads: :class:`Layout`.

Which queries are counted (real, with at least two visible keys), how many keys each sees, the key
classes (special, punctuation, content), the template pairs (previous token, duplicate token,
induction), the word ranges and, for images, the pixel distances and the kinds of positions: the
conventions of the definitions in :mod:`probe.analysis.focus`, computed once per layer shape and
shared by the whole-pattern path, the streamed path and :func:`~.terms.reduce`.
"""

from __future__ import annotations

from functools import cached_property

import torch

from probe.analysis.focus.definitions.tokens import CLASS, IMAGE, REGISTER, Side


class Layout:
    """Everything about one layer's pattern that does not depend on the heads."""

    def __init__(self, q: Side, k: Side, Q: int, K: int, *, causal: bool) -> None:
        self.q, self.k, self.Q, self.K, self.causal = q, k, Q, K, causal
        B = q.real.shape[0]
        self.qi, self.kj = torch.arange(Q), torch.arange(K)
        n_vis = k.real.sum(-1)[:, None, None].expand(B, 1, Q)
        if causal:
            # real keys j <= i: a running count (O(T), not a [Q, K] mask)
            n_vis = k.real.long().cumsum(-1)[:, None, :Q]
        self.n_vis = n_vis
        self.counted = q.real[:, None, :] & (n_vis >= 2)  # [B, 1, Q]: queries that have a choice
        self.log_n = torch.log(n_vis.clamp(min=2).float())
        self.not_end = (self.qi[None, :] != q.end[:, None])[:, None, :]
        self.masks = torch.stack(
            [k.special, k.punct, k.real & ~k.special & (self.kj[None, :] != k.first[:, None])], -1
        ).float()[:, None]  # [B, 1, K, 3]
        self.any_pad = bool(k.real.logical_not().any())

    def key_ok(self, d: int) -> torch.Tensor:
        """``[B, 1, Q]``: whether key ``i + d`` exists, is real and visible to query ``i``."""
        i = self.qi + d
        inside = (i >= 0) & (i < self.K)
        ok = torch.zeros(self.k.real.shape[0], self.Q, dtype=torch.bool)
        ok[:, inside] = self.k.real[:, i[inside]]
        if d > 0 and self.causal:
            ok[:] = False
        return ok[:, None, :] & self.counted

    @cached_property
    def pixel_distances(self) -> torch.Tensor:
        """``[B, Q, K]``: ‖c_i − c_j‖ in input pixels between patch query i and patch key j of the
        same picture, 0 for every other pair (class, register and text positions, other pictures)."""
        q, k = self.q, self.k
        d = torch.cdist(torch.nan_to_num(q.centre), torch.nan_to_num(k.centre))
        same = (q.picture[:, :, None] == k.picture[:, None, :]) & (q.picture >= 0)[:, :, None]
        return torch.where(same, d, 0.0).float()

    @cached_property
    def kind_masks(self) -> torch.Tensor:
        """``[B, 1, K, 3]``: whether each key is a class token ([CLS], [DIST]), a register, or an
        image position (a patch, a vision-language model's image token); needs ``k.kind``."""
        kind = self.k.kind
        return torch.stack([kind == CLASS, kind == REGISTER, kind == IMAGE], -1).float()[:, None]

    @cached_property
    def image_queries(self) -> torch.Tensor:
        """``[B, 1, Q]``: the counted text queries that can see an image position (a causal layer's
        text before the first image token reads none and is left out)."""
        q, k = self.q, self.k
        img = (k.kind == IMAGE) & k.real
        if self.causal:
            sees = img.long().cumsum(-1)[:, : self.Q] > 0
        else:
            sees = img.any(-1, keepdim=True).expand(-1, self.Q)
        return self.counted & ((q.kind == 0) & sees)[:, None, :]

    @cached_property
    def words_split(self) -> bool:
        """Whether some word has more than one piece (else word metrics equal token metrics)."""
        return any(bool(((s.word.amax(-1) + 1) < s.real.sum(-1)).any()) for s in (self.q, self.k))

    @cached_property
    def word_ranges(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(start, end)`` ``[B, W]``: each word's first and last key position (-1 if none)."""
        B, W = self.k.real.shape[0], self.k.n_words
        w = self.k.word.clamp(min=0)
        big = torch.where(self.k.real, self.kj.expand(B, -1), self.K)
        start = torch.full((B, W), self.K, dtype=torch.long).scatter_reduce(1, w, big, "amin")
        small = torch.where(self.k.real, self.kj.expand(B, -1), -1)
        end = torch.full((B, W), -1, dtype=torch.long).scatter_reduce(1, w, small, "amax")
        return start, end

    @cached_property
    def templates(self) -> dict[str, tuple[torch.Tensor, ...]]:
        """Per template: the (text, query, key) index triples where D = 1 and the queries with a hit."""
        q, k = self.q, self.k
        qi, kj = self.qi[:, None], self.kj[None, :]
        real = q.real[:, :, None] & k.real[:, None, :]  # [B, Q, K]
        same = (q.ids[:, :, None] == k.ids[:, None, :]) & real
        prev_same = torch.zeros_like(same)  # ids[i] == ids[j - 1]
        prev_same[:, :, 1:] = same[:, :, :-1] & k.real[:, None, 1:]
        out = {}
        for name, D in (
            ("prev", real & (kj == qi - 1)),
            ("dup", same & (kj < qi)),
            ("induction", prev_same & (kj <= qi)),
        ):
            b, i, j = D.nonzero(as_tuple=True)
            hits = D.any(-1)  # [B, Q]
            out[name] = (b, i, j, hits)
        return out


__all__ = ["Layout"]
