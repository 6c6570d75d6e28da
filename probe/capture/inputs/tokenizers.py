"""One interface over zoo tokenizers and Hugging Face tokenizers (fast and slow).

:func:`adapt` wraps whatever tokenizer the user has into a :class:`Tokenizer` that turns a text
into ids, *display tokens* (the strings a person reads) and a special-token mask:

* WordPiece pieces keep their continuation mark (``##ing``); special tokens stay as written
  (``[CLS]``, ``</s>``);
* SentencePiece's ``▁`` and byte-level BPE's ``Ġ`` become the space they stand for
  (``▁the``/``Ġthe`` → `` the``);
* a byte-level piece holding only part of a character (Chinese in GPT-2's byte BPE) is shown as
  the text its bytes come from (fast tokenizers know the offsets), else as its bytes
  (``<0xE6><0xB3>``, SentencePiece's byte-fallback notation);
* an unknown piece shows what it stood for: ``[UNK]:注``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from probe.errors import ProbeError


@dataclass
class Encoding:
    """One text, tokenized."""

    ids: list[int]
    tokens: list[str]
    special: list[bool]


class Tokenizer:
    """The interface probe uses; see :class:`ZooTokenizer` and :class:`HFTokenizer`."""

    pad_id: int = 0
    padding_side: str = "right"

    def encode(self, text: str) -> Encoding:  # pragma: no cover - interface
        raise NotImplementedError

    def tokens_of(self, ids: list[int]) -> list[str]:  # pragma: no cover - interface
        raise NotImplementedError

    def is_special(self, i: int) -> bool:
        return False

    def decode(self, ids: list[int]) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    def from_ids(self, ids: list[int]) -> Encoding:
        """An :class:`Encoding` of ids that came from a model (generated or shifted labels)."""
        return Encoding(list(ids), self.tokens_of(ids), [self.is_special(i) for i in ids])


def clip(text: str, n: int = 30) -> str:
    """``text`` quoted, cut to ``n`` characters with an ellipsis when longer."""
    return repr(text) if len(text) <= n else repr(text[: n - 1] + "…")


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().strip("'\"")
    return msg.splitlines()[0] if msg else type(e).__name__


class ZooTokenizer(Tokenizer):
    """A probe zoo tokenizer (``encode``, ``decode``, ``tokenize``, ``pad_id``)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.pad_id = int(getattr(tok, "pad_id", 0) or 0)

    def encode(self, text: str) -> Encoding:
        try:
            ids = [int(i) for i in self.tok.encode(text)]
        except (ValueError, KeyError) as e:
            raise ProbeError(_first_line(e)) from None
        tokens = list(self.tok.tokenize(text)) if hasattr(self.tok, "tokenize") else self.tokens_of(ids)
        return Encoding(ids, tokens, [False] * len(ids))

    def tokens_of(self, ids: list[int]) -> list[str]:
        try:
            return [self.tok.decode([i]) for i in ids]
        except (ValueError, KeyError, IndexError) as e:  # ids past the vocabulary
            raise ProbeError(f"{_first_line(e)}; give ids the tokenizer made") from None

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


class HFTokenizer(Tokenizer):
    """A ``transformers`` tokenizer, fast (``tokenizers`` backend) or slow (pure Python)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        pad = getattr(tok, "pad_token_id", None)
        if pad is None:
            pad = getattr(tok, "eos_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        self.padding_side = getattr(tok, "padding_side", "right") or "right"
        self.special_ids = set(getattr(tok, "all_special_ids", []) or [])
        self.fast = bool(getattr(tok, "is_fast", False))
        self.unk_id = getattr(tok, "unk_token_id", None)
        # ids that mark structure (BOS, EOS, CLS, SEP, PAD, ...); a tokenizer may give [UNK] the
        # same id as one of them (GPT-2 style: one <|endoftext|> for all), and then it is a marker
        markers = ("bos", "eos", "pad", "cls", "sep", "mask")
        self.marker_ids = {getattr(tok, f"{m}_token_id", None) for m in markers} - {None}

    def encode(self, text: str, *, target: bool = False) -> Encoding:
        kwargs: dict[str, Any] = {"add_special_tokens": True, "return_special_tokens_mask": True}
        if self.fast:
            kwargs["return_offsets_mapping"] = True
        try:
            enc = self.tok(text_target=text, **kwargs) if target else self.tok(text, **kwargs)
        except Exception as e:  # tokenizers raise many types; the message is what matters
            raise ProbeError(f"the tokenizer cannot encode {clip(text)}: {_first_line(e)}") from None
        ids = [int(i) for i in enc["input_ids"]]
        offsets = enc.get("offset_mapping") if self.fast else None
        own = enc.get("special_tokens_mask")  # the tokenizer's own mask: [UNK] is not special
        if own is not None and len(own) == len(ids):
            special = [bool(s) for s in own]
        else:
            special = [self.is_special(i) for i in ids]
        return Encoding(ids, self._display(ids, text, offsets), special)

    def tokens_of(self, ids: list[int]) -> list[str]:
        return self._display(ids, None, None)

    def is_special(self, i: int) -> bool:
        # the unknown token stands for text, it is not a marker the tokenizer added
        return i in self.special_ids and (i != self.unk_id or i in self.marker_ids)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def _piece(self, piece: str) -> str:
        """The tokenizer's own text of one byte-level piece, remembered per tokenizer (a capture
        of a long text asks for hundreds; the decoder gives each piece the same text every time)."""
        try:
            seen = _PIECES.setdefault(self.tok, {})
        except TypeError:  # a tokenizer that cannot be weakly referenced: ask it each time
            return self.tok.convert_tokens_to_string([piece])
        shown = seen.get(piece)
        if shown is None:
            if len(seen) >= _PIECES_MAX:
                seen.clear()
            shown = seen[piece] = self.tok.convert_tokens_to_string([piece])
        return shown

    def _display(self, ids: list[int], text: str | None, offsets: Any) -> list[str]:
        raw = self.tok.convert_ids_to_tokens(ids)
        out = []
        for k, (i, piece) in enumerate(zip(ids, raw, strict=True)):
            piece = piece if isinstance(piece, str) else str(piece)
            if (
                i == self.unk_id
                and text is not None
                and offsets is not None
                and offsets[k][1] > offsets[k][0]
            ):
                out.append(f"{piece}:{text[offsets[k][0] : offsets[k][1]]}")  # what was unknown
            elif i in self.special_ids or piece.startswith("##"):
                out.append(piece)
            elif "▁" in piece:
                out.append(piece.replace("▁", " "))
            elif _looks_byte_level(piece):
                shown = self._piece(piece)
                if "\ufffd" in shown:  # part of a character's UTF-8 bytes
                    if text is not None and offsets is not None and offsets[k][1] > offsets[k][0]:
                        shown = text[offsets[k][0] : offsets[k][1]]
                    else:
                        shown = "".join(f"<0x{b:02X}>" for b in _piece_bytes(piece))
                out.append(shown)
            else:
                out.append(piece)
        return out


# per tokenizer: the text of each byte-level piece shown so far (at most _PIECES_MAX, then anew)
_PIECES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PIECES_MAX = 1 << 16

# GPT-2's byte-to-unicode table maps the bytes that are not printable to these code points
# (space -> Ġ, newline -> Ċ, ...); a piece containing one of them is byte-level BPE.
_BYTE_LEVEL_MARKS = {chr(c) for c in range(0x100, 0x144)}


def _byte_decoder() -> dict[str, int]:
    # GPT-2's reversible byte <-> unicode table: printable bytes map to themselves, the rest to
    # the code points from U+0100 on, in byte order.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return table


_BYTES = _byte_decoder()


def _piece_bytes(piece: str) -> bytes:
    return bytes(_BYTES.get(ch, ord(ch) & 0xFF) for ch in piece)


def _looks_byte_level(piece: str) -> bool:
    return any(ch in _BYTE_LEVEL_MARKS for ch in piece) or any(0x80 <= ord(ch) <= 0xFF for ch in piece)


def adapt(tokenizer: Any) -> Tokenizer:
    """Wrap ``tokenizer`` (a zoo or Hugging Face tokenizer, or an adapter) in the probe interface."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if hasattr(tokenizer, "convert_ids_to_tokens") and callable(tokenizer):
        return HFTokenizer(tokenizer)
    if hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode"):
        return ZooTokenizer(tokenizer)
    raise ProbeError(
        f"{type(tokenizer).__name__} is not a tokenizer probe knows: give a "
        "Hugging Face tokenizer or an object with encode(text) and decode(ids)"
    )
