"""The texts of a corpus run: a list, a text file, a JSONL file or a ``datasets.Dataset``."""

from __future__ import annotations

import json
import os
from typing import Any

from probe.errors import ProbeError
from probe.files import input_file


def load_texts(texts: Any, *, field: str | None = None) -> list[str]:
    """The texts of a list, a text file (one per non-empty line), JSONL (``field``) or a Dataset."""
    if isinstance(texts, (str, os.PathLike)):
        p = input_file(texts, "texts file", "give a .txt (one text per line) or .jsonl file")
        lines = [ln for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()]
        if p.suffix == ".jsonl" or field is not None:
            key = field or "text"
            out = []
            for n, ln in enumerate(lines, 1):
                try:
                    rec = json.loads(ln)
                    out.append(rec[key])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ProbeError(
                        f"{p}: record {n} is not a JSON object with a {key!r} field; pass --field NAME"
                    ) from None
            lines = out
        texts = lines
    elif hasattr(texts, "column_names"):  # a datasets.Dataset (optional package)
        key = field or "text"
        if key not in texts.column_names:
            raise ProbeError(
                f"the dataset has no column {key!r} (columns: {texts.column_names}); pass field="
            )
        texts = texts[key]
    texts = list(texts)
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise ProbeError(f"text {bad[0]} is a {type(texts[bad[0]]).__name__}, not a string")
    if not texts:
        raise ProbeError("no texts given; pass a list of strings or a file with one text per line")
    return texts


NOUNS = {"images": "picture", "audio": "sound"}  # config["inputs"] -> what one item is called


def item_noun(config: dict) -> str:
    """What one item of a run is called in its messages and summary: text, picture or sound."""
    return NOUNS.get(config.get("inputs"), "text")


__all__ = ["load_texts", "item_noun"]
