"""Causal-mask audit: prove a model never sees the future or the padding, or show where it does.

``probe.check_causal(model_or_cache, inputs=None, *, tokenizer=None, expect=None)`` returns a
:class:`CausalReport`. From a cache alone it runs the static checks (:mod:`.static`); with a
model it captures one forward for those and then runs the functional checks
(:mod:`.functional`): suffix perturbation, input gradient, padding parity, KV-cache decoding and
backend parity. Tolerances: :data:`TOLERANCES` (one table, per dtype).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from probe import forward
from probe.analysis.causal import parity
from probe.analysis.causal.functional import Functional
from probe.analysis.causal.report import KINDS, TOLERANCES, CausalReport, Finding
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
_FUTURE_KINDS = ("future_attention", "unmasked_head", "swapped_mask")
ZEROED_TOLERANCE = 1e-6  # relative output change when future weights are zeroed after the softmax


def _dtype_name(model: nn.Module | None, cache: Any) -> str:
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


def _declared_window(model: nn.Module | None, meta: dict) -> int | None:
    cfg = getattr(model, "config", None) if model is not None else None
    for src in (model, cfg):
        for attr in ("sliding_window", "window"):
            v = getattr(src, attr, None) if src is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    v = ((meta.get("model") or {}).get("config") or {}).get("sliding_window")
    return v if isinstance(v, int) and v > 0 else None


def _meant_causal(model: nn.Module | None, meta: dict) -> bool | None:
    """Whether the model says it is a decoder (config, class name, a generate method); None = silent."""
    info = meta.get("model") or {}
    cfg = (info.get("config") or {}) if model is None else getattr(model, "config", None)

    def get(k):
        return cfg.get(k) if isinstance(cfg, dict) else getattr(cfg, k, None)

    if get("is_decoder"):
        return True
    if any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in (get("architectures") or [])):
        return True
    cls = type(model).__name__ if model is not None else str(info.get("class", ""))
    if cls.endswith(("ForCausalLM", "LMHeadModel")):
        return True
    for flag in ("is_causal", "causal"):
        v = getattr(model, flag, None) if model is not None else None
        if isinstance(v, bool):
            return v
    if model is not None and not forward.is_hf_model(model) and callable(getattr(model, "generate", None)):
        return True
    return None


def _expected(cache: Any, model: nn.Module | None, expect: Any) -> tuple[dict[str, Any], list[str]]:
    notes: list[str] = []
    stacks = cache.stacks
    if isinstance(expect, dict):
        if stacks == ["encoder"] and set(expect) == {"decoder"}:
            expect = {"encoder": expect["decoder"]}  # a broken decoder's lone stack looks like an encoder
        bad = set(expect) - set(stacks)
        if bad:
            raise ProbeError(f"expect names stacks {sorted(bad)} the cache lacks; it has {stacks}")
        out = {s: _norm(expect.get(s, "bidirectional")) for s in stacks}
        return out, notes
    window = _declared_window(model, cache.metadata)
    out: dict[str, Any] = {}
    for s in stacks:
        if s == "encoder" and "decoder" in stacks:
            out[s] = "bidirectional"
            continue
        if expect is not None:
            out[s] = _norm(expect)
            continue
        if s == "decoder" and "encoder" in stacks:
            meant = True
        else:
            meant = _meant_causal(model, cache.metadata)
        if meant is None:
            meant = s == "decoder"  # the capture found causal patterns
            if not meant:
                notes.append(
                    f"nothing says this model is a decoder and its {s} attention sees ahead, so it was "
                    "held to bidirectional; pass expect='causal' (CLI: --expect causal) to audit it "
                    "as a decoder"
                )
        out[s] = (window or "causal") if meant else "bidirectional"
    return out, notes


def _norm(e: Any) -> Any:
    if isinstance(e, int) and not isinstance(e, bool):
        if e < 1:
            raise ProbeError(f"expect={e}: a window is a positive number of keys")
        return e
    if e in ("causal", "bidirectional"):
        return e
    raise ProbeError(f"expect={e!r}: use 'causal', 'bidirectional', a window size, or a dict per stack")


def _describe(e: Any) -> str:
    return f"causal, window {e}" if isinstance(e, int) else str(e)


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
    :func:`probe.capture`; default a short English sentence) or a :class:`probe.Cache` (static
    checks only). ``expect`` overrides what is expected: ``"causal"``, ``"bidirectional"``, a
    sliding-window size in keys, or a dict per stack. Without ``expect``: an encoder-decoder's
    decoder is causal and its encoder bidirectional; a lone stack is causal when the model says it
    is a decoder (``config.is_decoder``, a ``*ForCausalLM`` class, an ``is_causal`` attribute, a
    ``generate`` method) or its captured attention is causal, with the window from
    ``sliding_window`` when declared. ``functional=False`` skips the model-running checks.

    Cost with a model: one capture, then the functional checks (see
    :mod:`probe.analysis.causal.functional`): on a clean model at most 7 forwards, some batched
    (suffix 1, gradient 1, padding 1, KV cache 3, backend 1, each where the model offers it) and
    one backward; 8 forwards in all on a Hugging Face decoder. Returns a :class:`CausalReport`
    (``.ok``, ``.findings``, ``.checks``, exports).
    """
    from probe.cache import Cache

    if isinstance(model_or_cache, Cache):
        if inputs is not None:
            raise ProbeError("inputs are for a model; a cache already holds its inputs")
        model, cache = None, model_or_cache
    elif isinstance(model_or_cache, nn.Module):
        model = model_or_cache
        if inputs is None:
            tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
            if tok is None or not hasattr(tok, "encode") or type(tok).__name__ == "TensorInput":
                raise ProbeError(
                    f"{forward.model_name(model)} needs inputs: pass inputs= (texts, ids or a float tensor)"
                )
            inputs = _default_text(model, tokenizer)
        cache = forward.capture(model, inputs, tokenizer=tokenizer)
    else:
        raise ProbeError(
            f"check_causal takes a torch model or a probe.Cache, not {type(model_or_cache).__name__}"
        )
    dtype = _dtype_name(model, cache)
    tol = TOLERANCES[dtype]
    expected, notes = _expected(cache, model, expect)
    findings, grids, static_notes = check_cache(cache, expected, tol)
    report = CausalReport(
        findings=findings,
        expected={display_name(cache, s, expected): _describe(e) for s, e in expected.items()},
        notes=notes + static_notes,
        grids=grids,
        dtype=dtype,
        model=str((cache.metadata.get("model") or {}).get("name", "?")),
    )
    if model is not None:
        report.checks.append(
            {"check": "capture", "status": "pass", "forwards": 1, "backwards": 0, "detail": "static checks"}
        )
        if functional:
            _functional(report, model, inputs, cache, expected, tol, tokenizer)
    else:
        report.notes.append("cache only: static checks; pass the model for the functional checks")
    return report


def _functional(report, model, inputs, cache, expected, tol, tokenizer) -> None:
    causal = [s for s, e in expected.items() if e != "bidirectional"]
    if not causal:
        report.notes.append("no stack is expected causal: functional checks skipped")
        return
    stack = causal[-1]
    meta = cache.metadata
    enc = None
    kind = meta.get("input_kind")
    if kind == "tensor":
        x = inputs if inputs.dim() >= 3 else inputs.unsqueeze(0)
        x = x[:1]
    elif meta.get("target_ids") is not None:
        i = max(range(len(meta["target_ids"])), key=lambda j: len(meta["target_ids"][j]))
        x = torch.tensor([meta["target_ids"][i]])
        enc = torch.tensor([[t for t, m in zip(meta["ids"][i], meta["attention_mask"][i], strict=True) if m]])
    else:
        i = max(range(len(meta["ids"])), key=lambda j: sum(meta["attention_mask"][j]))
        x = torch.tensor([[t for t, m in zip(meta["ids"][i], meta["attention_mask"][i], strict=True) if m]])
    if x.shape[1] < 3:
        report.notes.append("fewer than 3 positions: functional checks skipped (give a longer text)")
        return
    label = display_name(cache, stack, expected)
    future_heads: dict[int, list[int]] = {}
    for fd in report.findings:
        if fd.stack == label and fd.kind in _FUTURE_KINDS:
            future_heads.setdefault(fd.layer, []).append(fd.head)
    known = {(fd.layer, fd.head) for fd in report.findings if fd.stack == label}
    f = Functional(
        model,
        x,
        tol=tol,
        vocab=_vocab(report, model, tokenizer, x, enc),
        pad_id=int(meta.get("pad_id") or 0),
        encoder_ids=enc,
        stack=stack,
        label=label,
        known=known,
    )
    f.suffix(future_heads)
    f.gradient(explained=bool(future_heads))
    why = None
    if x.is_floating_point():
        why = "float inputs: no ids to pad or decode"
    elif enc is not None:
        why = "encoder-decoder: run on decoder-only models"
    if why is None and (forward.is_hf_model(model) or forward.accepts(model, "attention_mask")):
        _optional(f, "padding", lambda: parity.padding(f, expected[stack]))
    else:
        f.skip("padding", why or "the model takes no padding mask")
    if why is None and forward.supports_kv_cache(model) and x.shape[1] >= 4:
        _optional(f, "kv_cache", lambda: parity.kv_cache(f, expected[stack]))
    else:
        f.skip("kv_cache", why or "its forward takes no KV cache (cache/past_key_values with use_cache)")
    if why is None:
        _optional(f, "backend", lambda: parity.backend(f))
    else:
        f.skip("backend", why)
    report.checks += f.checks
    _mask_after_softmax(report, model, x, enc, f, meta.get("layers", []))
    report.findings += f.findings


def _optional(f: Functional, check: str, run) -> None:
    """Run a check that needs more of the model than a forward (a padding mask, a KV cache, a
    second backend); a model whose forward takes the argument but cannot run it that way is
    reported as skipped with the model's error, not as a leak."""
    n = len(f.checks)
    try:
        run()
    except (TypeError, ValueError, RuntimeError, IndexError, AttributeError, KeyError) as e:
        del f.checks[n:]
        msg = str(e).splitlines()[0] if str(e) else ""
        f.skip(check, f"the model could not run it ({type(e).__name__}: {msg[:120]})")


def _mask_after_softmax(report, model, x, enc, f: Functional, layers: list[dict]) -> None:
    """Future weight in the captured softmax that the model never uses: a mask after the softmax."""
    softmax_layers = {
        e["layer"]
        for e in layers
        if e.get("stack") == f.stack and (e.get("self_attn") or {}).get("impl") == ["softmax"]
    }
    mine = [
        fd
        for fd in report.findings
        if fd.kind in _FUTURE_KINDS and fd.stack == f.label and fd.layer in softmax_layers
    ]
    if not mine:  # only a softmax's output can be masked after the fact (SDPA weights never are)
        return
    with torch.no_grad():
        zeroed = forward.outputs_of(forward.run_future_zeroed(model, x, encoder_ids=enc))
    plain = f.out0 if f.out0 is not None else forward.outputs_of(forward.call(model, x, encoder_ids=enc))
    report.checks.append(
        {
            "check": "softmax_zeroed",
            "status": "pass",
            "forwards": 1,
            "backwards": 0,
            "detail": "future weights set to 0 after every softmax",
        }
    )
    d = float((zeroed.float() - plain.float()).abs().max()) / (float(plain.abs().max()) or 1.0)
    # A model that masks after its softmax zeroes those weights itself, so zeroing them first
    # changes nothing, bit for bit, in any dtype; a head that uses them moves the outputs. The
    # dtype's output tolerance would take a weak half-precision leak for the former.
    if d > ZEROED_TOLERANCE:
        return  # the future weights are used: the static findings stand
    report.findings = [fd for fd in report.findings if fd not in mine]
    f.findings = [fd for fd in f.findings if fd.kind != "suffix_leak"]
    # only the checks that perturb the future say whether it still reaches the outputs (a padding
    # or KV-cache failure has other causes)
    if not any(c["check"] in ("suffix", "gradient") and c["status"] == "fail" for c in f.checks):
        if f.tol is not TOLERANCES["float32"]:
            report.notes.append(
                "the captured softmax has weight on later keys, which the model zeroes afterwards; "
                f"at {report.dtype}'s tolerance its outputs do not move with the suffix, but a mask "
                "applied after the softmax without renormalising can hide under it: audit a float32 "
                "copy (model.float()) to tell"
            )
            return
        report.notes.append(
            "the captured softmax has weight on later keys, but the model zeroes it afterwards and "
            "renormalises: its outputs are causal (mask applied after the softmax)"
        )
        return
    for fd in mine:
        fd.kind = "mask_after_softmax"
        fd.evidence = (
            "the future is masked after the softmax without renormalising: the softmax put "
            f"{fd.magnitude:.3g} of a row's mass on later keys, so later tokens still set the normaliser "
            "(outputs change with the suffix); mask the scores before the softmax"
        )
        fd.check = "suffix"
        report.findings.append(fd)


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


def _vocab(report: CausalReport, model: nn.Module, tokenizer: Any, x: torch.Tensor, enc: Any) -> int:
    """How many ids the audited ids ``x`` may take (random suffixes are drawn below it).

    For an encoder-decoder ``x`` are decoder ids: a Hugging Face config's ``decoder_vocab_size``
    (else its shared ``vocab_size``); a tokenizer's ``vocab_size`` is the source side's there
    (the zoo's translator and aligner), so the embedding that reads ``x`` decides."""
    cfg = getattr(model, "config", None)
    for attr in ("decoder_vocab_size", "vocab_size") if enc is not None else ("vocab_size",):
        v = getattr(cfg, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    v = getattr(tok, "vocab_size", None)
    if enc is None and isinstance(v, int) and v > 0:
        return v
    if x.is_floating_point():
        return 0
    report.checks.append(
        {
            "check": "vocab",
            "status": "pass",
            "forwards": 1,
            "backwards": 0,
            "detail": "found the embedding of the ids",
        }
    )
    emb = forward.reading_embedding(model, x, encoder_ids=enc)
    return emb.num_embeddings if emb is not None else int(x.max()) + 1


__all__ = ["check_causal", "CausalReport", "Finding", "TOLERANCES", "KINDS"]
