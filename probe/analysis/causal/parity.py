"""Causal checks (c)-(e): the same forward computed another way must agree on the real tokens.

Padding (left- and right-padded copies vs. the unpadded text), incremental decoding through a KV
cache vs. the full forward, and eager vs. SDPA attention. Each runs on a :class:`Functional`
(its input, tolerances, findings and check records) and, when it fails, spends one or two traced
forwards to say which layer and head (or that probe could not trace it). Costs: see
:mod:`probe.analysis.causal.functional`.
"""

from __future__ import annotations

import torch

from probe import forward
from probe.analysis.causal.functional import Functional, relative_change
from probe.analysis.causal.report import Finding
from probe.analysis.causal.static import check_pattern


# -- (c) padding -----------------------------------------------------------------------------
def padding(fc: Functional, expect) -> None:
    """Left- and right-padded copies of a shorter text equal the unpadded run on real tokens."""
    was = fc.leaked
    T = fc.T
    k = max(1, T // 3)
    short = fc.x[:, : T - k]
    pad = torch.full((1, k), fc.pad_id, dtype=fc.x.dtype)
    ids = torch.cat([fc.x, torch.cat([pad, short], 1), torch.cat([short, pad], 1)])
    mask = torch.ones_like(ids)
    mask[1, :k] = 0
    mask[2, T - k :] = 0
    out = fc.call(ids, attention_mask=mask)
    ref = out[0, : T - k]
    d_left, d_right = relative_change(out[1, k:], ref), relative_change(out[2, : T - k], ref)
    ok = max(d_left, d_right) <= fc.tol["output"]
    fc.record(
        "padding",
        ok,
        1,
        detail=f"batch 3: {k} pads left, right, none; change {d_left:.3g}, {d_right:.3g}",
    )
    if ok:
        return
    fc.leaked = True
    cache = fc.trace(lambda: forward.call(fc.model, ids, attention_mask=mask))
    fc.checks[-1]["forwards"] += 1
    found = []
    stack = cache.stacks[-1] if cache is not None else None
    for layer in range(cache.n_layers(stack) if cache is not None else 0):
        try:
            p = cache.pattern(stack, layer)
        except KeyError:
            continue
        f, _ = check_pattern(p, mask.bool(), mask.bool(), expect, fc.tol, {"stack": stack, "layer": layer})
        found += [x for x in f if x.kind in ("pad_attention", "mask_over_queries")]
    if found:
        fc.add(found, "padding")
        return
    if was:
        return  # explained by the leak found above
    side = "left" if d_left > d_right else "right"
    fc.findings.append(
        Finding(
            "padding_mismatch",
            None,
            None,
            None,
            None,
            None,
            max(d_left, d_right),
            f"{side}-padded outputs differ from the unpadded run by {max(d_left, d_right):.3g} "
            + (
                "although no head attends to pads (positions shifted by padding?)"
                if max(d_left, d_right) < float("inf")
                else "(NaN/inf on real tokens: a fully masked pad row divided by zero or overflowed, "
                "and its NaN reached real tokens through 0 x NaN)"
            ),
            check="padding",
        )
    )


def _agrees(fc: Functional, check: str, got: torch.Tensor, forwards: int, detail: str) -> float | None:
    """Record whether ``got`` equals the plain forward's outputs on the text: None when it does,
    else the relative change (and the model is marked leaking)."""
    full = fc.out0 if fc.out0 is not None else fc.call(fc.x)
    d = relative_change(got, full)
    ok = d <= fc.tol["output"]
    fc.record(check, ok, forwards, detail=f"{detail}max change {d:.3g}")
    if ok:
        return None
    fc.leaked = True
    return d


# -- (d) KV cache ----------------------------------------------------------------------------
def kv_cache(fc: Functional, expect) -> None:
    """Prefix, then a chunk, then one token through the KV cache equal the full forward."""
    was = fc.leaked
    T = fc.T
    n = T // 2
    with torch.no_grad():
        o1 = forward.call(fc.model, fc.x[:, :n], use_cache=True)
        past = forward.kv_cache_of(o1)
        if past is None:
            fc.skip("kv_cache", "asked with use_cache=True, the model returned no KV cache")
            return
        o2 = forward.call(fc.model, fc.x[:, n : T - 1], past_key_values=past, use_cache=True)
        o3 = forward.call(fc.model, fc.x[:, T - 1 :], past_key_values=forward.kv_cache_of(o2))
    inc = torch.cat([forward.outputs_of(o) for o in (o1, o2, o3)], 1)
    d = _agrees(fc, "kv_cache", inc, 3, f"prefix {n}, chunk {T - 1 - n}, then 1 token; ")
    if d is None:
        return
    with torch.no_grad():
        past = forward.kv_cache_of(forward.call(fc.model, fc.x[:, :n], use_cache=True))
    chunk = fc.x[:, n : T - 1]
    cache = fc.trace(lambda: forward.call(fc.model, chunk, past_key_values=past, use_cache=True))
    fc.checks[-1]["forwards"] += 2
    found = []
    for stack in cache.stacks if cache is not None else []:
        for layer in range(cache.n_layers(stack)):
            for kind in ("self", "cross"):
                try:
                    p = cache.pattern(stack, layer, kind)
                except KeyError:
                    continue
                ones_q = torch.ones(p.shape[0], p.shape[2], dtype=torch.bool)
                ones_k = torch.ones(p.shape[0], p.shape[3], dtype=torch.bool)
                f, _ = check_pattern(p, ones_q, ones_k, expect, fc.tol, {"stack": fc.stack, "layer": layer})
                found += f
    if found:
        fc.add(found, "kv_cache")
        return
    if was:
        return
    fc.findings += [
        Finding(
            "kv_cache_mismatch",
            fc.label,
            None,
            None,
            n,
            None,
            d,
            f"decoding with the KV cache differs from the full forward by {d:.3g}",
            check="kv_cache",
        )
    ]


# -- (e) backend parity ----------------------------------------------------------------------
def backend(fc: Functional) -> None:
    """Eager and SDPA attention give the same outputs (transformers models that offer both)."""
    other = forward.other_backend(fc.model)
    if other is None:
        fc.skip("backend", "the model has no eager/SDPA switch")
        return
    current, name, twin = other
    was = fc.leaked
    with torch.no_grad():
        alt = forward.outputs_of(forward.call(twin, fc.x))
    d = _agrees(fc, "backend", alt, 1, f"{current} vs {name}: ")
    if d is None:
        return
    if was:
        return
    caches = [fc.trace(lambda m=m: forward.call(m, fc.x), model=m) for m in (fc.model, twin)]
    fc.checks[-1]["forwards"] += 2
    # compare layer by layer; each cache names its own lone stack (a leaky one looks like an encoder)
    ok_caches = None not in caches
    sa, sb = (caches[0].stacks[-1], caches[1].stacks[-1]) if ok_caches else (None, None)
    n = min(caches[0].n_layers(sa), caches[1].n_layers(sb)) if ok_caches else 0
    for layer in range(n):
        a, b = caches[0].pattern(sa, layer), caches[1].pattern(sb, layer)
        diff = (a.float() - b.float()).abs().amax(dim=(0, 2, 3))
        if float(diff.max()) > fc.tol["mass"] * 10:
            h = int(diff.argmax())
            fc.findings.append(
                Finding(
                    "backend_mismatch",
                    fc.label,
                    layer,
                    h,
                    None,
                    None,
                    float(diff.max()),
                    f"{current} and {name} attention differ (first at this layer, max weight "
                    f"difference {float(diff.max()):.3g})",
                    check="backend",
                )
            )
            return
    fc.findings.append(
        Finding(
            "backend_mismatch",
            None,
            None,
            None,
            None,
            None,
            d,
            f"{current} and {name} outputs differ by {d:.3g}",
            check="backend",
        )
    )
