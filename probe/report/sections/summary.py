"""Summary: the model, the texts and their tokens (a token strip per text)."""

from __future__ import annotations

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
            heads = sorted({e.get("self_attn", {}).get("heads") for e in entries} - {None})
            total = (meta.get("stacks") or {}).get(s, {}).get("layers", "?")
            stacks.append({"name": s, "captured": cache.n_layers(s), "layers": total, "heads": heads})
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
                "config": model.get("config") or {},
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
