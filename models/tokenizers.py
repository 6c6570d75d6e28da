"""The zoo's tokenizers: characters, whitespace-separated words, and "no text at all".

Every zoo model carries one as `model.tokenizer`, with the same small surface:

    encode(text) -> list[int]       ids, one per token
    decode(ids) -> str              the inverse of encode
    tokenize(text) -> list[str]     the token strings a person reads (what encode numbers)
    vocab_size: int | None
    pad_id: int | None              None when the vocabulary has no padding token

Text outside the vocabulary, and empty text, raise a ValueError that names the problem.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch


def _as_ints(ids: Iterable[int] | torch.Tensor) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise ValueError(f"decode takes one sequence of ids, got a tensor of shape {tuple(ids.shape)}")
        return [int(i) for i in ids.tolist()]
    return [int(i) for i in ids]


def _quoted(items: Iterable[str]) -> str:
    return ", ".join(repr(s) for s in dict.fromkeys(items))  # unique, in order of appearance


class _VocabTokenizer:
    """What the character and word tokenizers share: a fixed vocabulary, ids, and checks.

    Subclasses split text in `tokenize` and set `joiner`, the string `decode` puts between tokens.
    """

    joiner = ""
    unit = "tokens"

    def __init__(self, name: str, vocab: Mapping[str, int], pad_id: int | None = None):
        self.name = name
        self.stoi = dict(vocab)
        self.itos = {i: t for t, i in self.stoi.items()}
        self.vocab_size = len(self.stoi)
        self.pad_id = pad_id

    def _split(self, text: str) -> list[str]:  # pragma: no cover - overridden
        raise NotImplementedError

    def _vocabulary(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    def tokenize(self, text: str) -> list[str]:
        """The tokens of `text`, after checking every one is in the vocabulary."""
        if not isinstance(text, str):
            raise TypeError(f"{self.name} tokenizer: expected a str, got {type(text).__name__}")
        tokens = self._split(text)
        if not tokens:
            raise ValueError(f"{self.name} tokenizer: empty text; give at least one {self.unit[:-1]}")
        unknown = [t for t in tokens if t not in self.stoi]
        if unknown:
            raise ValueError(
                f"{self.name} tokenizer: {self.unit} not in the vocabulary: {_quoted(unknown)} "
                f"(vocabulary: {self._vocabulary()})"
            )
        return tokens

    def encode(self, text: str) -> list[int]:
        """Ids of the tokens of `text`, one per token."""
        return [self.stoi[t] for t in self.tokenize(text)]

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """The text spelled by `ids` (a list or a 1-D tensor)."""
        ids = _as_ints(ids)
        bad = [i for i in ids if i not in self.itos]
        if bad:
            raise ValueError(
                f"{self.name} tokenizer: ids outside 0..{self.vocab_size - 1}: "
                + ", ".join(str(i) for i in dict.fromkeys(bad))
            )
        return self.joiner.join(self.itos[i] for i in ids)


class CharTokenizer(_VocabTokenizer):
    """One token per character; ids are positions in the sorted vocabulary string."""

    unit = "characters"

    def __init__(self, name: str, chars: str, pad_id: int | None = None):
        super().__init__(name, {ch: i for i, ch in enumerate(chars)}, pad_id)
        self.chars = chars

    def _split(self, text: str) -> list[str]:
        return list(text)

    def _vocabulary(self) -> str:
        return f'"{self.chars}"'

    def __repr__(self) -> str:
        return f'CharTokenizer({self.name!r}, vocab_size={self.vocab_size}, chars="{self.chars}")'


class WordTokenizer(_VocabTokenizer):
    """One token per whitespace-separated word, numbered by a fixed vocabulary dict."""

    joiner = " "
    unit = "words"

    def _split(self, text: str) -> list[str]:
        return text.split()

    def _vocabulary(self) -> str:
        return " ".join(self.stoi)

    def __repr__(self) -> str:
        return f"WordTokenizer({self.name!r}, vocab={self.stoi})"


class TensorInput:
    """The "tokenizer" of a model whose input is a float tensor, not text: every call explains."""

    vocab_size = None
    pad_id = None

    def __init__(self, name: str, shape: str, hint: str):
        self.name = name
        self.message = f"{name} takes float tensors of shape {shape}, not text; {hint}"

    def tokenize(self, text: str) -> list[str]:
        raise ValueError(self.message)

    def encode(self, text: str) -> list[int]:
        raise ValueError(self.message)

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        raise ValueError(self.message)

    def __repr__(self) -> str:
        return f"TensorInput({self.name!r})"
