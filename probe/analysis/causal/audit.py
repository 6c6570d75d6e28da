"""``check_causal``: the audit's entry point, from a model or a cache to a :class:`CausalReport`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from probe import forward
from probe.analysis.causal import suite
from probe.analysis.causal.expect import describe, expected
from probe.analysis.causal.report import TOLERANCES, CausalReport
from probe.analysis.causal.static import check_cache, display_name
from probe.errors import ProbeError

# tried in turn when no inputs are given: the first one the model's tokenizer can read
DEFAULT_TEXTS = (
    "attention lets tokens read.",
    "The cat sat on the mat because it was warm, and the dog watched it.",
    "3141592653589793238462643383279",
    "der junge sah den hund",  # the zoo aligner's German-like source language
    "ich mochte ein bier",  # the seed translator's one sentence
)


def check_causal(
    model_or_cache: Any,
    inputs: Any = None,
    *,
    tokenizer: Any = None,
    expect: Any = None,
    functional: bool = True,
) -> CausalReport:
    """Audit a model (or a captured cache) for attention to the future or to padding.

    ``model_or_cache``: an ``nn.Module`` (then ``inputs`` are texts/ids/a float tensor as for
    :func:`probe.capture`, default a short English sentence, or a :class:`probe.Cache` of this
    model on token ids: audited as it is, its ids feeding the functional checks, with no second
    capture) or a :class:`probe.Cache` (static checks only). ``expect`` overrides what is
    expected: ``"causal"``, ``"bidirectional"``, a sliding-window size in keys, or a dict per
    stack. Without ``expect``: an encoder-decoder's decoder is causal and its encoder
    bidirectional; a lone stack is causal when the model says it is a decoder
    (``config.is_decoder``, a ``*ForCausalLM`` class, an ``is_causal`` attribute, a ``generate``
    method) or its captured attention is causal, with the window from ``sliding_window`` when
    declared. ``functional=False`` skips the model-running checks.

    Cost with a model: one capture, then the functional checks (see
    :mod:`probe.analysis.causal.functional`): on a clean model at most 7 forwards, some batched
    (suffix 1, gradient 1, padding 1, KV cache 3, backend 1, each where the model offers it) and
    one backward; 8 forwards in all on a Hugging Face decoder. Returns a :class:`CausalReport`
    (``.ok``, ``.findings``, ``.checks``, exports).
    """
    model, cache, inputs = _model_and_cache(model_or_cache, inputs, tokenizer)
    dtype = dtype_name(model, cache)
    tol = TOLERANCES[dtype]
    held, notes = expected(cache, model, expect)
    findings, grids, static_notes = check_cache(cache, held, tol)
    report = CausalReport(
        findings=findings,
        expected={display_name(cache, s, held): describe(e) for s, e in held.items()},
        notes=notes + static_notes,
        grids=grids,
        dtype=dtype,
        model=str((cache.metadata.get("model") or {}).get("name", "?")),
    )
    if model is None:
        report.notes.append("cache only: static checks; pass the model for the functional checks")
        report.functional_skipped = "a cache alone (pass the model to run them)"
        return report
    captured = 0 if inputs is cache else 1  # a cache given with the model was not captured again
    capture = {"check": "capture", "status": "pass", "forwards": captured, "backwards": 0}
    report.checks.append({**capture, "detail": "static checks"})
    if functional:
        suite.run(report, model, inputs, cache, held, tol, tokenizer)
    else:
        report.functional_skipped = "functional=False"
    return report


def _model_and_cache(model_or_cache: Any, inputs: Any, tokenizer: Any) -> tuple[nn.Module | None, Any, Any]:
    """``(model or None, cache, inputs)``: a cache as given, or a model's capture of ``inputs``
    (a default text its tokenizer reads when none are given)."""
    from probe.cache import Cache

    if isinstance(model_or_cache, Cache):
        if inputs is not None:
            raise ProbeError("inputs are for a model; a cache already holds its inputs")
        return None, model_or_cache, None
    if not isinstance(model_or_cache, nn.Module):
        raise ProbeError(
            f"check_causal takes a torch model or a probe.Cache, not {type(model_or_cache).__name__}"
        )
    model = model_or_cache
    if isinstance(inputs, Cache):
        why = ids_missing(inputs.metadata)
        if why is not None:
            raise ProbeError(
                f"check_causal(model, cache): {why}; pass check_causal(cache) for the static checks"
            )
        return model, inputs, inputs
    if inputs is None:
        tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        if tok is None or not hasattr(tok, "encode") or type(tok).__name__ == "TensorInput":
            raise ProbeError(
                f"{forward.model_name(model)} needs inputs: pass inputs= (texts, ids or a float tensor)"
            )
        inputs = _default_text(model, tokenizer)
    return model, forward.capture(model, inputs, tokenizer=tokenizer), inputs


ID_KEYS = ("input_ids", "attention_mask", "token_type_ids", "decoder_input_ids", "decoder_attention_mask")


def ids_missing(meta: dict) -> str | None:
    """Why the functional checks cannot run on the inputs a cache records (None: they can): they
    perturb token ids, so the cache must hold the ids of everything its model read."""
    other = [k for k in meta.get("input_keys") or [] if k not in ID_KEYS]
    if other:
        return f"the functional checks perturb token ids alone, and this model read {', '.join(other)}"
    if not meta.get("ids") or meta.get("input_kind") == "tensor":
        return "the functional checks re-run the model, and the cache does not keep the float tensor it read"
    return None


def dtype_name(model: nn.Module | None, cache: Any) -> str:
    """The dtype the model computes in (its first floating parameter's, else the cache's):
    ``float32``, ``float16`` or ``bfloat16`` (the keys of :data:`TOLERANCES`)."""
    dt = None
    if model is not None:
        dt = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dt is not None:
        return {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dt, "float32")
    stored = str(cache.metadata.get("dtype", ""))
    for name in ("bfloat16", "float16"):
        if name in stored:
            return name
    return "float32"


def _default_text(model: nn.Module, tokenizer: Any) -> str:
    for text in DEFAULT_TEXTS:
        try:
            forward.prepare(model, text, tokenizer=tokenizer)
            return text
        except ProbeError:
            continue
    raise ProbeError(
        f"{forward.model_name(model)} reads none of probe's sample texts; pass inputs= (CLI: a text)"
    )
