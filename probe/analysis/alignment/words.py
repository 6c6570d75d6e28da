"""Tokens -> words: which display tokens are special, and which pieces make up one word.

A cache records, per text, the *display tokens* (``probe.capture``'s readable form: WordPiece
``##`` continuations kept, SentencePiece ``▁`` and byte-level ``Ġ`` shown as a leading space),
plus ``special_tokens_mask`` and ``attention_mask``. From these alone the alignment analysis
rebuilds words:

* a token is *special* (left out of every alignment) when its special-token mask says so, when its
  attention mask is 0 (padding), or, for the zoo's encoder-decoders (``translator``, ``aligner``),
  when it is one of their symbols ``S`` (start), ``E`` (end), ``P`` (pad), which their word
  tokenizers do not flag;
* a ``##piece`` continues the word before it;
* in a text whose tokenizer marks word starts with a space (any token starting with `` `` or
  ``▁``), a token *without* that mark continues the word before it (``' un' 'believ' 'able'`` is
  one word), except the first real token and a token right after a special one;
* otherwise every token is a word of its own (word-level tokenizers).
"""

from __future__ import annotations

from dataclasses import dataclass

from probe.cache.format import real_token_flags

ZOO_SYMBOLS = {
    "translator": {"S", "E", "P"},
    "aligner": {"S", "E", "P"},
    "speech": {"<s>", "</s>", "<pad>"},
}
_SPACE = (" ", "\u2581")


@dataclass
class Words:
    """The words of one text: ``words[k]`` is spelled by the token positions ``pieces[k]``."""

    words: list[str]
    pieces: list[list[int]]

    def __len__(self) -> int:
        return len(self.words)


def special_positions(meta: dict, side: str, b: int) -> list[bool]:
    """Per token of text ``b`` on ``side`` (``"source"`` or ``"target"``): True if it is special."""
    prefix = "target_" if side == "target" else ""
    tokens = meta.get(f"{prefix}tokens", [])[b]
    n = len(tokens)
    special = real_token_flags(meta, b, "special_tokens_mask", prefix)[:n]
    special += [0] * (n - len(special))
    mask = list(meta.get(f"{prefix}attention_mask", [[1] * n] * (b + 1))[b])[:n]
    mask += [1] * (n - len(mask))
    symbols = ZOO_SYMBOLS.get(meta.get("model", {}).get("name"), set())
    return [bool(s) or not m or t in symbols for t, s, m in zip(tokens, special, mask, strict=True)]


def group_words(tokens: list[str], special: list[bool]) -> Words:
    """Merge the display ``tokens`` of one text into words, leaving out the ``special`` ones."""
    spaced = any(t.startswith(_SPACE) for t, s in zip(tokens, special, strict=True) if not s)
    words: list[str] = []
    pieces: list[list[int]] = []
    new_word = True
    for pos, (tok, sp) in enumerate(zip(tokens, special, strict=True)):
        if sp:
            new_word = True
            continue
        text = tok
        if tok.startswith("##") and len(tok) > 2:
            starts = False
            text = tok[2:]
        elif spaced:
            starts = tok.startswith(_SPACE)
            text = tok.lstrip("".join(_SPACE)) if starts else tok
        else:
            starts = True
        if starts or new_word or not words:
            words.append(text)
            pieces.append([pos])
        else:
            words[-1] += text
            pieces[-1].append(pos)
        new_word = False
    return Words(words, pieces)
