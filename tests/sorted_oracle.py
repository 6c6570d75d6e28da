"""A row's span, top weight, first argmax, total and entropy by a full sort, written for the tests
of the kernels that compute them without one (tests/test_fused_stats.py, tests/test_cuda.py)."""

from __future__ import annotations

import torch


def sorted_terms(P: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per row of ``P``: ascending values, float64 running sums; the span leaves out the most
    smallest weights whose sum stays within 10% of the row's mass."""
    vals = P.double().sort(-1).values
    c = vals.cumsum(-1)
    left = (c <= 0.1 * c[..., -1:]).sum(-1)
    ent = -(P.double() * P.double().clamp_min(torch.finfo(torch.float32).tiny).log()).sum(-1)
    return {
        "span": P.shape[-1] - left,
        "top": vals[..., -1],
        "total": c[..., -1],
        "ent": ent,
        "arg": P.argmax(-1),
    }
