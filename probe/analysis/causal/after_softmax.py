"""Future weight in a captured softmax that the model never uses: a mask applied after the softmax.

The static checks see weight on later keys in a softmax's output; whether that is a leak depends on
what the model does next. One forward with those weights zeroed (:func:`probe.forward.run_future_zeroed`)
tells: unchanged outputs mean the model zeroes them itself (renormalising or not, which the suffix
and gradient checks then tell apart); changed outputs mean the heads use them (the findings stand).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from probe import forward
from probe.analysis.causal.functional import Functional
from probe.analysis.causal.report import TOLERANCES, CausalReport, Finding

FUTURE_KINDS = ("future_attention", "unmasked_head", "swapped_mask")
ZEROED_TOLERANCE = 1e-6  # relative output change when future weights are zeroed after the softmax


def settle(
    report: CausalReport, model: nn.Module, x: torch.Tensor, enc: Any, f: Functional, layers: list[dict]
) -> None:
    """Re-judge the static future-weight findings of softmax layers (of ``f``'s stack) with one
    forward whose future weights are zeroed; updates ``report`` and ``f.findings`` in place."""
    mine = _softmax_findings(report, f, layers)
    if not mine:  # only a softmax's output can be masked after the fact (SDPA weights never are)
        return
    d = _zeroed_change(report, model, x, enc, f)
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
        report.notes.append(_unused_note(report, f))
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


def _softmax_findings(report: CausalReport, f: Functional, layers: list[dict]) -> list[Finding]:
    """The static future-weight findings of ``f``'s stack in layers whose pattern is a softmax's output."""
    softmax_layers = {
        e["layer"]
        for e in layers
        if e.get("stack") == f.stack and (e.get("self_attn") or {}).get("impl") == ["softmax"]
    }
    return [
        fd
        for fd in report.findings
        if fd.kind in FUTURE_KINDS and fd.stack == f.label and fd.layer in softmax_layers
    ]


def _zeroed_change(report: CausalReport, model: nn.Module, x: torch.Tensor, enc: Any, f: Functional) -> float:
    """max |outputs with future weights zeroed - outputs| relative to max |outputs| (one forward)."""
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
    return float((zeroed.float() - plain.float()).abs().max()) / (float(plain.abs().max()) or 1.0)


def _unused_note(report: CausalReport, f: Functional) -> str:
    """The note for future weight the model zeroes afterwards and whose outputs stay causal."""
    if f.tol is not TOLERANCES["float32"]:
        return (
            "the captured softmax has weight on later keys, which the model zeroes afterwards; "
            f"at {report.dtype}'s tolerance its outputs do not move with the suffix, but a mask "
            "applied after the softmax without renormalising can hide under it: audit a float32 "
            "copy (model.float()) to tell"
        )
    return (
        "the captured softmax has weight on later keys, but the model zeroes it afterwards and "
        "renormalises: its outputs are causal (mask applied after the softmax)"
    )
