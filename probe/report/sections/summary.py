"""Summary: the model, the texts and their tokens (a token strip per text)."""

from __future__ import annotations

from probe.cache.format import real_token_flags

TITLE = "Summary"
ORDER = 10


def _tokens(toks: list[str], specials: list[int] | None) -> list[dict]:
    specials = specials or []
    return [{"i": i, "t": t, "special": i < len(specials) and bool(specials[i])} for i, t in enumerate(toks)]


def build(ctx) -> dict:
    """Per cache: model name, class, parameters, attention implementations, layers; per text its tokens."""
    runs = []
    for ci, cache in enumerate(ctx.caches):
        meta = cache.metadata
        model = meta.get("model") or {}
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
                "tokens": _tokens(toks, real_token_flags(meta, b)),
                "target": None,
            }
            if meta.get("target_tokens"):
                entry["target"] = {
                    "text": (meta.get("target_texts") or [None] * (b + 1))[b],
                    "tokens": _tokens(meta["target_tokens"][b], None),
                    "source": meta.get("target_source"),
                }
            texts.append(entry)
        runs.append(
            {
                "index": ci,
                "path": str(cache.path) if cache.path else None,
                "model": model.get("name", "?"),
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
