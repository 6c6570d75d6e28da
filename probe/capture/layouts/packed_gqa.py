"""Grouped-query attention of one query token, packed by transformers: heads folded into query rows.

For a single query token with a mask (a generation step over a sliding-window or padded cache),
transformers' SDPA path runs the attention on the key/value heads without repeating them: the
query ``[batch, heads, 1, dim]`` becomes ``[batch, kv_heads, n_rep, dim]`` (``pack_gqa``), head
``h`` at key/value head ``h // n_rep``, row ``h % n_rep``. Read plainly, that call looks like
``n_rep`` query rows of ``kv_heads`` heads. This layout unpacks it: the same call with the query
``[batch, heads, 1, dim]`` (and a per-head mask likewise) and ``enable_gqa``, whose weights are
the same numbers, handed to the recorder's consumer as the one query row it is.
"""

from __future__ import annotations

from typing import Any

from probe.capture.calls import Call
from probe.capture.layouts.registry import Layout, register, skipped


def _groups(module: Any) -> int:
    n = getattr(module, "num_key_value_groups", None)
    return n if isinstance(n, int) else 0


class PackedGQA(Layout):
    name = "packed-gqa"
    priority = 90
    reads = frozenset({"sdpa"})

    def claim(self, stack: list[Call], out: Any) -> Call | None:
        for c in reversed(stack):
            if _groups(c.module) > 1:
                p = c.primary
                return c if p is not None and p.dim() >= 2 and p.size(-2) == 1 else None
        return None

    def sdpa(self, rec, call: Call, args: tuple, kwargs: dict) -> bool:
        n_rep = _groups(call.module)
        args, kwargs = list(args), dict(kwargs)
        query = args[0] if args else kwargs["query"]
        key = args[1] if len(args) > 1 else kwargs["key"]
        if query.dim() != 4 or query.size(2) != n_rep or query.size(1) != key.size(1):
            return False  # not packed (a repeated or enable_gqa call): the plain path reads it
        if skipped(rec):
            return True
        B, kv, _, d = query.shape
        H, K = kv * n_rep, key.size(-2)
        unpacked = query.reshape(B, H, 1, d)
        if args:
            args[0] = unpacked
        else:
            kwargs["query"] = unpacked
        mask_at = 3 if len(args) > 3 else None
        mask = args[3] if mask_at else kwargs.get("attn_mask")
        if mask is not None and mask.dim() == 4 and mask.size(1) == kv and mask.size(2) == n_rep:
            mask = mask.reshape(mask.size(0), H, 1, mask.size(-1))
            if mask_at:
                args[3] = mask
            else:
                kwargs["attn_mask"] = mask
        kwargs["enable_gqa"] = True
        rec.consumer.sdpa(rec.open_attention((1, K), "sdpa", whole=(B, H, 1, K)), tuple(args), kwargs)
        return True


register(PackedGQA())
