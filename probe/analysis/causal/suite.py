"""The functional checks in order on one input: choose it, ask what the model can take, run each.

:func:`run` picks the longest real text of the capture (the decoder side of an encoder-decoder),
runs suffix perturbation and the input gradient on every model, and padding, KV-cache decoding and
backend parity where the model offers them (a check the model cannot take is recorded as skipped,
with the reason), then settles future weight that a mask after the softmax hides
(:mod:`.after_softmax`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from probe import forward
from probe.analysis.causal import after_softmax, parity
from probe.analysis.causal.expect import Expect
from probe.analysis.causal.functional import Functional
from probe.analysis.causal.report import CausalReport
from probe.analysis.causal.static import display_name


def run(
    report: CausalReport,
    model: nn.Module,
    inputs: Any,
    cache: Any,
    expected: dict[str, Expect],
    tol: dict[str, float],
    tokenizer: Any,
) -> None:
    """Run the functional checks on ``model`` and add their checks and findings to ``report``."""
    causal = [s for s, e in expected.items() if e != "bidirectional"]
    if not causal:
        report.notes.append("no stack is expected causal: functional checks skipped")
        report.functional_skipped = "no stack is expected causal"
        return
    stack = causal[-1]
    x, enc = audited_input(cache.metadata, inputs)
    if x.shape[1] < 3:
        report.notes.append("fewer than 3 positions: functional checks skipped (give a longer text)")
        report.functional_skipped = "fewer than 3 positions (give a longer text)"
        return
    label = display_name(cache, stack, expected)
    future_heads = _future_heads(report, label)
    f = Functional(
        model,
        x,
        tol=tol,
        vocab=_vocab(report, model, tokenizer, x, enc),
        pad_id=int(cache.metadata.get("pad_id") or 0),
        encoder_ids=enc,
        stack=stack,
        label=label,
        known={(fd.layer, fd.head) for fd in report.findings if fd.stack == label},
    )
    f.suffix(future_heads)
    f.gradient(explained=bool(future_heads))
    checks: dict[str, Callable[[], None]] = {
        "padding": lambda: parity.padding(f, expected[stack]),
        "kv_cache": lambda: parity.kv_cache(f, expected[stack]),
        "backend": lambda: parity.backend(f),
    }
    for check, why in why_not(model, x, enc).items():
        if why is None:
            _optional(f, check, checks[check])
        else:
            f.skip(check, why)
    report.checks += f.checks
    after_softmax.settle(report, model, x, enc, f, cache.metadata.get("layers", []))
    report.findings += f.findings


def audited_input(meta: dict, inputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x, encoder_ids)``: one input [1, T] for the functional checks and, for an
    encoder-decoder, its source ids [1, S] (else None): the longest text, without padding."""
    kind = meta.get("input_kind")
    if kind == "tensor":
        x = inputs if inputs.dim() >= 3 else inputs.unsqueeze(0)
        return x[:1], None
    if meta.get("target_ids") is not None:
        i = max(range(len(meta["target_ids"])), key=lambda j: len(meta["target_ids"][j]))
        return torch.tensor([meta["target_ids"][i]]), torch.tensor([_real(meta, i)])
    i = max(range(len(meta["ids"])), key=lambda j: sum(meta["attention_mask"][j]))
    return torch.tensor([_real(meta, i)]), None


def _real(meta: dict, i: int) -> list[int]:
    return [t for t, m in zip(meta["ids"][i], meta["attention_mask"][i], strict=True) if m]


def why_not(model: nn.Module, x: torch.Tensor, enc: Any) -> dict[str, str | None]:
    """For padding, KV cache and backend parity: why the model cannot take the check (None: it can).

    Capability is read from what the model's forward accepts (:func:`probe.forward.accepts`,
    :func:`probe.forward.kv_cache_arg`); a check that then fails to run is skipped with the
    model's own error (:func:`_optional`)."""
    why = None
    if x.is_floating_point():
        why = "float inputs have no ids to pad or decode"
    elif enc is not None:
        why = "an encoder-decoder (these run on decoder-only models)"
    out: dict[str, str | None] = {"padding": why, "kv_cache": why, "backend": why}
    if why is not None:
        return out
    if not (forward.is_hf_model(model) or forward.accepts(model, "attention_mask")):
        out["padding"] = "the model takes no attention_mask"
    if not forward.supports_kv_cache(model):
        out["kv_cache"] = "the model takes no KV cache (cache or past_key_values, with use_cache)"
    elif x.shape[1] < 4:
        out["kv_cache"] = "fewer than 4 positions (prefix, chunk and one token)"
    return out


def _future_heads(report: CausalReport, label: str) -> dict[int, list[int]]:
    """{layer: heads} the static checks found attending to later keys in stack ``label``."""
    heads: dict[int, list[int]] = {}
    for fd in report.findings:
        if fd.stack == label and fd.kind in after_softmax.FUTURE_KINDS:
            heads.setdefault(fd.layer, []).append(fd.head)
    return heads


def _optional(f: Functional, check: str, body: Callable[[], None]) -> None:
    """Run a check that needs more of the model than a forward (a padding mask, a KV cache, a
    second backend); a model whose forward takes the argument but cannot run it that way is
    reported as skipped with the model's error, not as a leak."""
    n = len(f.checks)
    try:
        body()
    except (TypeError, ValueError, RuntimeError, IndexError, AttributeError, KeyError) as e:
        del f.checks[n:]
        msg = str(e).splitlines()[0] if str(e) else ""
        f.skip(check, f"the model could not run it ({type(e).__name__}: {msg[:120]})")


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
