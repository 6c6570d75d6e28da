"""``induction_scores(model)``: every head scored on repeated random token sequences.

Following Olsson et al. (2022), each sequence is ``[BOS] r r`` where ``r`` is ``length`` random
token ids (drawn without replacement where the vocabulary allows, so the only repeats are the
planted ones; special tokens are never drawn) and BOS is the model's beginning token where it has
one. An induction head at a token of the second copy attends to the token *after* that token's
first occurrence. The model runs through :mod:`probe.forward` only; the scores are the template
scores of :func:`probe.head_stats` on those caches, averaged over ``seeds`` sequences.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from probe import forward
from probe.analysis.focus.stats import head_stats
from probe.analysis.table import Table
from probe.errors import ProbeError

COLUMNS = ("induction_prefix", "induction_score", "dup_prefix", "prev_score")


def _vocab_and_bos(
    model: nn.Module, tokenizer: Any, vocab_size: Any = None
) -> tuple[int, set[int], int | None]:
    """``(vocabulary size, special ids, BOS id or None)``; ``vocab_size`` (checked) overrides the
    size the model's config or tokenizer tells, and may not exceed it."""
    cfg = getattr(model, "config", None)
    known = getattr(cfg, "vocab_size", None) or getattr(tokenizer, "vocab_size", None)
    known = known if isinstance(known, int) and known >= 2 else None
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise ProbeError(
                f"vocab_size={vocab_size!r}: give an integer of at least 2 (the token ids drawn)"
            )
        if known is not None and vocab_size > known:
            raise ProbeError(
                f"vocab_size={vocab_size} exceeds the model's vocabulary of {known}; give at most {known}"
            )
    vocab = vocab_size or known
    if vocab is None:
        raise ProbeError("cannot tell the vocabulary size of this model; pass vocab_size=")
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for attr in ("pad_id", "bos_id", "eos_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            special.add(v)
    bos = None
    for src, attr in (
        (tokenizer, "bos_token_id"),
        (cfg, "bos_token_id"),
        (tokenizer, "bos_id"),
        (tokenizer, "cls_token_id"),
    ):
        v = getattr(src, attr, None)
        if isinstance(v, int):
            bos = v
            break
    return vocab, special, bos


def repeated_sequences(
    vocab: int, length: int, seeds: int, *, bos: int | None = None, exclude: set[int] = frozenset()
) -> torch.Tensor:
    """``[seeds, (1 if bos) + 2·length]`` ids: ``[BOS] r r`` with ``r`` drawn with seed ``s``."""
    allowed = torch.tensor([i for i in range(vocab) if i not in exclude])
    if len(allowed) < 2:
        raise ProbeError("the vocabulary has fewer than two ordinary tokens; cannot build random sequences")
    rows = []
    for s in range(seeds):
        g = torch.Generator().manual_seed(s)
        if len(allowed) >= length:
            r = allowed[torch.randperm(len(allowed), generator=g)[:length]]
        else:
            r = allowed[torch.randint(len(allowed), (length,), generator=g)]
        rows.append(torch.cat([torch.tensor([bos] if bos is not None else [], dtype=torch.long), r, r]))
    return torch.stack(rows)


def induction_scores(
    model: nn.Module,
    *,
    tokenizer: Any = None,
    length: int | None = None,
    seeds: int = 8,
    vocab_size: int | None = None,
    progress: bool = True,
) -> Table:
    """Induction (and duplicate/previous-token) template scores of every self-attention head.

    Returns a :class:`~probe.analysis.table.Table`: one row per (stack, layer, head) with the
    mean over ``seeds`` sequences of ``induction_prefix`` (prefix matching: attention from a
    second-copy token to the token after its first occurrence), ``induction_score`` (the "mul"
    form Σ(A⊙D)/ΣA), ``dup_prefix`` and ``prev_score``, each with ``_std`` across seeds.
    ``length`` defaults to min(50, what the context allows). ``vocab_size``: draw token ids from
    ``0..vocab_size-1`` (default and upper bound: the vocabulary the config or tokenizer tells;
    required when neither tells one).
    """
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    vocab, special, bos = _vocab_and_bos(model, tokenizer, vocab_size)
    limit = getattr(model, "context_length", None) or getattr(
        getattr(model, "config", None), "block_size", None
    )
    limit = limit or getattr(getattr(model, "config", None), "max_position_embeddings", None) or 1024
    if length is None:
        length = min(50, (int(limit) - (bos is not None)) // 2)
    if length < 2:
        raise ProbeError(f"length must be at least 2 tokens, got {length}")
    if seeds < 1:
        raise ProbeError(f"seeds must be at least 1, got {seeds}")
    ids = repeated_sequences(vocab, length, seeds, bos=bos, exclude=special)
    cache = forward.capture(model, ids, tokenizer=tokenizer)
    cache.metadata["special_tokens_mask"] = [[0] * ids.shape[1] for _ in range(seeds)]
    if bos is not None:
        for row in cache.metadata["special_tokens_mask"]:
            row[0] = 1
    stats = head_stats(cache, rollout=False, progress=progress)
    cols = ["stack", "layer", "head"]
    for c in COLUMNS:
        cols += [c] + ([f"{c}_std"] if seeds > 1 else [])
    rows = [{c: r[c] for c in cols} for r in stats.table if r["kind"] == "self"]
    return Table(rows, cols, title=f"induction scores ({seeds} sequences of [BOS] r r, |r| = {length})")


__all__ = ["induction_scores", "repeated_sequences"]
