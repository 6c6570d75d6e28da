"""What the focus statistics need to know about the tokens of one side of an attention pattern.

For a pattern ``[batch, head, query, key]`` of ``stack``/``kind``, :func:`side` returns, per text
and padded position: which positions are real (``attention_mask``), which are special tokens
(``special_tokens_mask``), which are punctuation, the token ids (for the templates) and the word
each position belongs to. Encoder-decoder caches keep the decoder's tokens under ``target_*``; the
decoder's self-attention reads them on both sides, its cross-attention reads them for queries and
the source for keys.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any

import torch

from probe.cache.format import real_token_flags
from probe.cache.pictures import runs_over_pictures
from probe.errors import ProbeError


@dataclass
class Side:
    """Per-position facts of one side (queries or keys) of a pattern, shapes ``[batch, T]``."""

    real: torch.Tensor  # bool: a real token, not padding
    special: torch.Tensor  # bool: a special token ([CLS], [SEP], BOS, EOS, ...)
    punct: torch.Tensor  # bool: a punctuation token
    ids: torch.Tensor | None  # long, -1 at padding; None when the cache has no ids
    word: torch.Tensor  # long: word index within the text, -1 at padding
    n_words: int  # the largest number of words of a text in the batch
    first: torch.Tensor  # long [batch]: position of the first real token
    end: torch.Tensor  # long [batch]: position of the last real token if it is special, else -1
    # an image grid's positions: each patch's centre (y, x) in input pixels, [batch, T, 2], and
    # which picture it belongs to, [batch, T] (-1: not a patch); None without an image grid
    centre: torch.Tensor | None = None
    picture: torch.Tensor | None = None
    # what each position of an image stack is, [batch, T]: KIND_CODES (class, register, image
    # patch or image token, text); None without recorded positions
    kind: torch.Tensor | None = None


# position kinds as the image metrics group them: [CLS] and DeiT's [DIST] are class tokens
KIND_CODES = {"text": 0, "class": 1, "distillation": 1, "register": 2, "patch": 3, "image": 3}
CLASS, REGISTER, IMAGE = 1, 2, 3


def _prefix(meta: dict[str, Any], stack: str, role: str) -> str:
    """``"target_"`` where the decoder of an encoder-decoder reads its own tokens, else ``""``."""
    enc_dec = meta.get("target_tokens") is not None
    return "target_" if enc_dec and stack == "decoder" and role == "own" else ""


def is_punct(token: str) -> bool:
    """A display token made only of Unicode punctuation (category P*), ignoring ``##`` and spaces."""
    t = token[2:] if token.startswith("##") else token
    t = t.strip()
    return bool(t) and all(unicodedata.category(c).startswith("P") for c in t)


def word_starts(tokens: list[str], special: list[bool]) -> list[bool]:
    """Whether each display token starts a new word (see the conventions in ``probe.analysis.focus``).

    WordPiece (any ``##`` piece): every piece not starting with ``##`` starts a word. Leading-space
    schemes (byte BPE ``Ġthe`` and SentencePiece ``▁the``, both shown as `` the``; character
    tokenizers whose spaces are tokens): a piece starts a word when it begins with whitespace or
    follows a whitespace-only piece. Tokenizers with neither (plain word tokens): every token is a
    word. Special tokens are always words of their own.
    """
    n = len(tokens)
    if any(t.startswith("##") and len(t) > 2 for t in tokens):
        starts = [not t.startswith("##") for t in tokens]
    elif any(t[:1].isspace() for t, s in zip(tokens, special, strict=True) if not s):
        starts = [True] * n
        for i in range(1, n):
            t, prev = tokens[i], tokens[i - 1]
            starts[i] = t[:1].isspace() or prev.isspace() or t.isspace()
    else:
        starts = [True] * n
    for i in range(n):
        if special[i] or (i > 0 and special[i - 1]):
            starts[i] = True
    if n:
        starts[0] = True
    return starts


def side(meta: dict[str, Any], stack: str, role: str, batch: int, length: int) -> Side:
    """Facts of the ``role`` side (``"own"``: the stack's own tokens; ``"source"``: the encoder's)
    for a pattern dimension of ``length`` positions over ``batch`` texts."""
    p = _prefix(meta, stack, role)
    mask = meta.get(f"{p}attention_mask")
    tokens = meta.get(f"{p}tokens") or []
    specials = meta.get(f"{p}special_tokens_mask")
    ids = meta.get(f"{p}ids")
    if mask is None or runs_over_pictures(meta, stack, batch, length, mask):
        real = torch.ones(batch, length, dtype=torch.bool)
    else:
        real = torch.tensor(mask, dtype=torch.bool)
        if tuple(real.shape) != (batch, length):
            raise ProbeError(
                f"the cache's {p}attention_mask is {list(real.shape)} but its {stack} patterns have "
                f"{batch} texts × {length} positions; the cache is inconsistent, capture it again"
            )
    special = torch.zeros(batch, length, dtype=torch.bool)
    punct = torch.zeros(batch, length, dtype=torch.bool)
    word = torch.full((batch, length), -1, dtype=torch.long)
    id_t = torch.full((batch, length), -1, dtype=torch.long) if ids is not None else None
    n_words = 1
    for b in range(batch):
        pos = real[b].nonzero().flatten().tolist()
        toks = tokens[b] if b < len(tokens) and len(tokens[b]) == len(pos) else [""] * len(pos)
        spec = [bool(s) for s in real_token_flags(meta, b, "special_tokens_mask", p)] if specials else []
        if len(spec) != len(pos):
            spec = [False] * len(pos)
        at = torch.tensor(pos, dtype=torch.long)  # one write per text, not per token
        special[b, at] = torch.tensor(spec, dtype=torch.bool).reshape(-1)
        punct[b, at] = torch.tensor(
            [not sp and is_punct(t) for sp, t in zip(spec, toks, strict=True)], dtype=torch.bool
        ).reshape(-1)
        if id_t is not None and b < len(ids) and len(ids[b]) == length != len(pos):
            id_t[b, pos] = torch.tensor(ids[b], dtype=torch.long)[pos]  # stored padded
        elif id_t is not None and b < len(ids) and len(ids[b]) == len(pos):
            id_t[b, pos] = torch.tensor(ids[b], dtype=torch.long)
        w, words = -1, []
        for k, s in enumerate(word_starts(toks, spec)):
            w += 1 if s or k == 0 else 0
            words.append(w)
        word[b, at] = torch.tensor(words, dtype=torch.long).reshape(-1)
        n_words = max(n_words, w + 1)
    idx = torch.arange(length)
    first = torch.where(real, idx, length).amin(-1)
    last = torch.where(real, idx, -1).amax(-1)
    end = torch.where(special[torch.arange(batch), last.clamp(min=0)] & (last >= 0), last, -1)
    centre, picture, kind = patch_centres(meta, stack, batch, length) if role == "own" else (None,) * 3
    return Side(real, special, punct, id_t, word, n_words, first, end, centre, picture, kind)


def patch_centres(meta: dict[str, Any], stack: str, batch: int, length: int) -> tuple[Any, Any, Any]:
    """``(centre [batch, T, 2], picture [batch, T], kind [batch, T])`` of the stack's image
    positions (see :class:`Side`), or ``(None, None, None)`` when the stack has none or they do
    not fit ``length``."""
    pos = ((meta.get("stacks") or {}).get(stack) or {}).get("positions")
    if not isinstance(pos, dict):
        return None, None, None
    # kinds without a grid (a generation's prompt/generated positions) name no patch
    grids = [pos["grid"]] if pos.get("grid") else []
    rows = pos.get("rows") or [{"kinds": pos.get("kinds", []), "grids": grids}] * batch
    if len(rows) != batch or any(len(r["kinds"]) != length for r in rows):
        return None, None, None
    centre = torch.full((batch, length, 2), float("nan"), dtype=torch.float64)
    picture = torch.full((batch, length), -1, dtype=torch.long)
    kind = torch.tensor([[KIND_CODES.get(k, 0) for k in row["kinds"]] for row in rows], dtype=torch.long)
    for b, row in enumerate(rows):
        for g, grid in enumerate(row["grids"]):
            n, ph, pw = grid["rows"] * grid["cols"], grid["patch"][0], grid["patch"][1]
            k = torch.arange(n)
            at = grid["offset"] + k
            centre[b, at, 0] = ((k // grid["cols"]).double() + 0.5) * ph
            centre[b, at, 1] = ((k % grid["cols"]).double() + 0.5) * pw
            picture[b, at] = g
    return centre, picture, kind


__all__ = ["KIND_CODES", "Side", "side", "is_punct", "patch_centres", "word_starts"]
