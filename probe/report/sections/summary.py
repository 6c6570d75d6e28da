"""Summary: the model, the texts and their tokens (a token strip per text)."""

from __future__ import annotations

import re
from typing import Any

from probe.analysis.alignment.words import ZOO_SYMBOLS
from probe.cache.format import real_token_flags
from probe.report.labels import display, model_title

TITLE = "Summary"
ORDER = 10


# what the zoo's tutorial symbols stand for (the translator's and aligner's vocabularies)
SYMBOL_MEANING = {
    "S": "the start token: the decoder reads it first, then each target word in turn (teacher forcing)",
    "E": "the end token: the decoder predicts it after the last word",
    "P": "padding: a filler word the model masks out",
}


# the architecture fields a config row shows (the first key of each group the config has); the
# rest of the config is folded away
ARCHITECTURE = (
    ("model_type",),
    ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    ("encoder_layers",),
    ("decoder_layers",),
    ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    ("encoder_attention_heads",),
    ("decoder_attention_heads",),
    ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query"),
    ("hidden_size", "n_embd", "d_model", "dim"),
    ("vocab_size",),
)
SHORT_CONFIG = 12
_LOCAL_PATH = re.compile(r"^(/|~|\.{1,2}[/\\]|[A-Za-z]:[/\\]|\\\\)")
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def _is_local_path(v: Any, key: str = "") -> bool:
    """A string that names a place on this machine (absolute, home- or dot-relative, a drive; for
    a ``*name_or_path`` field anything but a Hugging Face hub id such as ``org/name``)."""
    if not isinstance(v, str):
        return False
    return bool(_LOCAL_PATH.match(v)) or (key.endswith("name_or_path") and not _HUB_ID.match(v))


def config_rows(config: dict) -> dict[str, Any]:
    """The config row: ``main`` the architecture fields (:data:`ARCHITECTURE`) as ``(key, value)``,
    ``rest`` the other top-level fields (folded away), ``hidden`` the keys left out because their
    value is a local path (never shown: a report is shared, the path is the author's machine). A
    config of at most :data:`SHORT_CONFIG` fields (the zoo's) is ``main`` whole, in its order."""
    hidden = sorted(k for k, v in config.items() if _is_local_path(v, k))
    if len(config) <= SHORT_CONFIG:
        return {
            "main": [(k, _without_paths(v)) for k, v in config.items() if k not in hidden],
            "rest": [],
            "hidden": hidden,
        }
    main = []
    for group in ARCHITECTURE:
        k = next((k for k in group if k in config and k not in hidden), None)
        if k is not None:
            main.append((k, config[k]))
    shown = {k for k, _ in main}
    rest = [(k, _without_paths(v)) for k, v in config.items() if k not in shown and k not in hidden]
    return {"main": main, "rest": rest, "hidden": hidden}


def _without_paths(v: Any) -> Any:
    """``v`` with local paths inside nested dicts and lists replaced by ``"<local path>"``."""
    if _is_local_path(v):
        return "<local path>"
    if isinstance(v, dict):
        return {k: "<local path>" if _is_local_path(x, k) else _without_paths(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_without_paths(x) for x in v]
    return v


def _tokens(toks: list[str], specials: list[int] | None, symbols: set[str]) -> list[dict]:
    """Token chips: the shown form (whitespace visible), whether special, and a tooltip."""
    specials = specials or []
    out = []
    for i, t in enumerate(toks):
        special = i < len(specials) and bool(specials[i])
        meaning = SYMBOL_MEANING.get(t) if t in symbols else None
        tip = f"position {i}" + (f": {meaning}" if meaning else "")
        out.append({"i": i, "t": display(t, None), "special": special or bool(meaning), "tip": tip})
    return out


def heads_text(per_layer: list[tuple[int | None, int | None]]) -> str | None:
    """How many heads the layers ``[(layer, heads), ...]`` have, in words: ``"4 heads"`` when all
    have the same, else each run of layers with its own count (``"4 heads in layer 0, 1 in layer 1"``)."""
    known = [(layer, n) for layer, n in per_layer if n is not None]
    if not known:
        return None
    counts = [n for _, n in known]
    if len(set(counts)) == 1:
        return f"{counts[0]} head{'s' if counts[0] != 1 else ''}"
    runs: list[list] = []  # [count, first layer, last layer]
    for layer, n in known:
        if runs and runs[-1][0] == n and layer is not None and runs[-1][2] == layer - 1:
            runs[-1][2] = layer
        else:
            runs.append([n, layer, layer])
    parts = [f"{n} in layer{'s' if a != b else ''} {a}{'–' + str(b) if a != b else ''}" for n, a, b in runs]
    unit = "head" if runs[0][0] == 1 else "heads"
    return f"{parts[0].replace(' in ', f' {unit} in ', 1)}, " + ", ".join(parts[1:])


def _legend(rows: list[list[str]], symbols: set[str]) -> list[str]:
    """``"S = the start token: ..."`` for each zoo symbol that appears in ``rows``."""
    seen = {t for row in rows for t in row if t in symbols}
    return [f"{t} = {SYMBOL_MEANING[t]}" for t in ("S", "E", "P") if t in seen and t in SYMBOL_MEANING]


def build(ctx) -> dict:
    """Per cache: model name, class, parameters, attention implementations, layers; per text its tokens."""
    runs = []
    for ci, cache in enumerate(ctx.caches):
        meta = cache.metadata
        model = meta.get("model") or {}
        symbols = ZOO_SYMBOLS.get(model.get("name"), set())
        stacks = []
        for s in cache.stacks:
            entries = [e for e in meta.get("layers", []) if e.get("stack") == s]
            per_layer = [(e.get("layer"), e.get("self_attn", {}).get("heads")) for e in entries]
            total = (meta.get("stacks") or {}).get(s, {}).get("layers", "?")
            stacks.append(
                {"name": s, "captured": cache.n_layers(s), "layers": total, "heads": heads_text(per_layer)}
            )
        texts = []
        for b in range(cache.n_texts):
            toks = (meta.get("tokens") or [[]])[b] if meta.get("tokens") else []
            entry = {
                "text": (meta.get("texts") or [None] * (b + 1))[b] if meta.get("texts") else None,
                "tokens": _tokens(toks, real_token_flags(meta, b), symbols),
                "target": None,
            }
            if meta.get("target_tokens"):
                entry["target"] = {
                    "text": (meta.get("target_texts") or [None] * (b + 1))[b],
                    "tokens": _tokens(meta["target_tokens"][b], None, symbols),
                    "source": meta.get("target_source"),
                }
            entry["legend"] = _legend([toks, (meta.get("target_tokens") or [[]] * (b + 1))[b]], symbols)
            texts.append(entry)
        runs.append(
            {
                "index": ci,
                "path": str(cache.path) if cache.path else None,
                "model": model_title(str(model.get("name", "?"))),
                "model_path": str(model.get("name", "?")),
                "cls": model.get("class", "?"),
                "parameters": model.get("parameters"),
                "config": config_rows(model.get("config") or {}),
                "impls": meta.get("attention_implementations") or [],
                "dtype": meta.get("dtype", "?"),
                "stacks": stacks,
                "texts": texts,
            }
        )
    out = {"runs": runs}
    if hasattr(ctx, "results"):  # the causal-mask audit's verdict, up front (its section has the detail)
        from probe.report.sections import causal

        out["causal"] = causal.verdict(ctx)
    return out
