"""Shared by the core sections: which positions of each text are real tokens, and their labels."""

from __future__ import annotations

from probe.cache import Cache


def real_positions(mask: list[int] | None, n_tokens: int, length: int) -> list[int]:
    """Indices (into a padded sequence of ``length``) of the real tokens, given an attention mask.

    Without a mask the first ``n_tokens`` positions are taken (unpadded input).
    """
    if mask:
        pos = [i for i, m in enumerate(mask[:length]) if m]
        if len(pos) == n_tokens:
            return pos
    return list(range(min(n_tokens, length) if n_tokens else length))


def side_tokens(cache: Cache, batch: int, side: str) -> tuple[list[str], list[int] | None]:
    """``(tokens, attention_mask)`` of text ``batch`` on ``side`` (``"source"`` or ``"target"``)."""
    meta = cache.metadata
    if side == "target":
        toks = (meta.get("target_tokens") or [[]])[batch] if meta.get("target_tokens") else []
        masks = meta.get("target_attention_mask")
    else:
        toks = (meta.get("tokens") or [[]])[batch] if meta.get("tokens") else []
        masks = meta.get("attention_mask")
    mask = masks[batch] if masks and batch < len(masks) else None
    return list(toks), mask


def query_key_sides(cache: Cache, stack: str, kind: str) -> tuple[str, str]:
    """Which token side the queries and keys of a ``stack``/``kind`` pattern come from."""
    enc_dec = "encoder" in cache.stacks and "decoder" in cache.stacks
    if not enc_dec or stack == "encoder":
        return "source", "source"
    return "target", ("source" if kind == "cross" else "target")


def batch_size(cache: Cache) -> int:
    """The number of texts in ``cache``."""
    meta = cache.metadata
    n = len(meta.get("tokens") or [])
    if n:
        return n
    for k in cache.keys():
        return cache.shape(k)[0]
    return 0
