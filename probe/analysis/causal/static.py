"""Causal-mask checks that read a cache only: where attention weight goes, row by row.

For every self-attention pattern ``[batch, head, query, key]`` held to ``causal`` (or a window
``W``): the mass above the (bottom-right aligned) diagonal, whether it is exactly zero, the mass on
padding keys, rows that do not sum to 1, NaN/inf rows, a masked diagonal, a swapped mask, the
window actually used, and with a KV cache (query length < key length) top-left alignment.
Bidirectional stacks and cross-attention get the padding and row checks only.
"""

from __future__ import annotations

from typing import Any

import torch

from probe.analysis.causal.report import Finding

Expect = Any  # "causal", "bidirectional" or an int window


def _key_mask(meta: dict, stack: str, kind: str, batch: int, n: int, cross_stack: bool) -> torch.Tensor:
    """[batch, n] real-key mask (1 = real token) for a pattern's keys."""
    name = "attention_mask"
    if stack == "decoder" and kind == "self" and meta.get("target_attention_mask") is not None:
        name = "target_attention_mask"
    m = meta.get(name)
    if m is not None:
        t = torch.tensor(m, dtype=torch.bool)
        if t.shape == (batch, n):
            return t
    return torch.ones(batch, n, dtype=torch.bool)


def _query_mask(meta: dict, stack: str, kind: str, batch: int, n: int) -> torch.Tensor:
    name = "attention_mask"
    if stack == "decoder" and meta.get("target_attention_mask") is not None:
        name = "target_attention_mask"
    m = meta.get(name)
    if m is not None:
        t = torch.tensor(m, dtype=torch.bool)
        if t.shape[0] == batch and t.shape[1] >= n:
            return t[:, t.shape[1] - n :]
    return torch.ones(batch, n, dtype=torch.bool)


def check_pattern(
    p: torch.Tensor,
    qmask: torch.Tensor,
    kmask: torch.Tensor,
    expect: Expect,
    tol: dict[str, float],
    where: dict[str, Any],
) -> tuple[list[Finding], dict[str, list[float]]]:
    """Check one layer's pattern ``p`` [batch, head, query, key]; returns findings and per-head stats.

    ``qmask``/``kmask`` [batch, query]/[batch, key] mark real tokens. The stats dict has
    ``future``, ``pad`` (max mass over real rows, per head) and ``window`` (keys back used, per head).
    """
    p = p.float()
    B, H, Q, K = p.shape
    offset = K - Q  # a KV cache: query i sits at position offset + i (bottom-right alignment)
    qpos = torch.arange(Q)[:, None] + offset
    kpos = torch.arange(K)[None, :]
    future = kpos > qpos  # [Q, K]
    past = kpos < qpos
    causal = expect != "bidirectional"
    rows = qmask[:, None, :].expand(B, H, Q)  # real query rows
    finite = torch.isfinite(p).all(-1)
    p0 = torch.nan_to_num(p, nan=0.0, posinf=0.0, neginf=0.0)
    padkey = ~kmask[:, None, None, :]
    pad_mass = (p0 * padkey).sum(-1).masked_fill(~rows, 0)
    stats: dict[str, list[float]] = {"future": [0.0] * H, "pad": [0.0] * H, "window": [0.0] * H}
    found: list[Finding] = []

    def add(kind, h, b, q, k, mag, ev):
        found.append(Finding(kind, where["stack"], where["layer"], h, q, k, float(mag), ev, text=b))

    fmass = (p0 * future).sum(-1).masked_fill(~rows, 0) if causal else torch.zeros(B, H, Q)
    # the window actually used: how far back the earliest real key with weight lies
    nz = (p0 > tol["mass"]) & kmask[:, None, None, :] & ~future & rows[..., None]
    seen = nz.any(-1)
    first = torch.where(seen, nz.to(torch.uint8).argmax(-1), K)  # argmax: the first True key
    span = (qpos[:, 0] - first + 1).masked_fill(~seen, 0)  # [B, H, Q]
    # per head: every future cell of every real row exactly 0
    exact = (~((p0 * future != 0) & rows[..., None]).flatten(2).any(-1).any(0)).tolist()
    row_sums = p0.sum(-1)
    for h in range(H):
        stats["future"][h] = float(fmass[:, h].max())
        stats["pad"][h] = float(pad_mass[:, h].max())
        stats["window"][h] = float(span[:, h].max())
    for h in range(H):
        r = rows[:, h]
        bad_rows = r & ~finite[:, h]
        diag_zero = top_left = False
        if causal and offset > 0:
            # KV cache: query i (position offset+i) must see keys up to offset+i. Top-left alignment
            # (is_causal=True with q_len != k_len) hides keys i+1 .. offset+i instead.
            tl_hidden = (kpos > torch.arange(Q)[:, None]) & ~future
            seen = (p0[:, h] * tl_hidden).masked_fill(~r[..., None], 0).sum(-1)
            top_left = bool(r.any()) and bool((seen[r] <= tol["mass"]).all())
        if top_left:
            b, q = _first(r)
            add(
                "kv_alignment",
                h,
                b,
                q + offset,
                q + 1,
                float(offset),
                f"with {offset} cached keys, query {q + offset} sees keys 0..{q} only: the causal "
                "mask is aligned top-left (is_causal=True with a KV cache); align it bottom-right",
            )
        elif causal and Q > 1:
            d = p0[:, h, torch.arange(Q), (torch.arange(Q) + offset)]  # [B, Q]
            ok_rows = r & finite[:, h]
            diag_zero = bool(ok_rows.any()) and bool((d[ok_rows] == 0).all())
        if diag_zero:
            b, q = _first(bad_rows) if bad_rows.any() else _first(r)
            n_nan = int(bad_rows.sum())
            add(
                "masked_diagonal",
                h,
                b,
                q,
                q + offset,
                n_nan,
                f"no query attends to itself; {n_nan} row(s) have no visible key and are NaN "
                "(mask built with triu(diagonal=0); use diagonal=1)",
            )
        elif bad_rows.any():
            b, q = _first(bad_rows)
            add(
                "non_finite",
                h,
                b,
                q,
                None,
                int(bad_rows.sum()),
                f"{int(bad_rows.sum())} attention row(s) hold NaN/inf, first at text {b} query {q} "
                "(a mask fill that overflows this dtype, or a fully masked row)",
            )
        sums = row_sums[:, h]
        dev = (sums - 1).abs().masked_fill(~(r & finite[:, h]), 0)
        if float(dev.max()) > tol["rowsum"]:
            b, q = _argmax2(dev)
            add(
                "rows_not_normalised",
                h,
                b,
                q,
                None,
                float(dev.max()),
                f"row sums range {float(sums[r & finite[:, h]].min()):.4g}..."
                f"{float(sums[r & finite[:, h]].max()):.4g} (should be 1)",
            )
        fm = float(fmass[:, h].max())
        if causal and fm > tol["mass"]:
            cells = (p0[:, h] * future).masked_fill(~r[..., None], 0)
            b, q, k = _argmax3(cells)
            n_rows = int((fmass[:, h] > tol["mass"]).sum())
            lower_zero = bool(((p0[:, h] * past)[r] == 0).all()) and Q > 1
            others = [g for g in range(H) if g != h and exact[g]]
            if lower_zero:
                kind, why = "swapped_mask", "every earlier key has weight exactly 0 while later keys are seen"
            elif others and not bool((p0[:, h].masked_select(future & r[..., None]) == 0).any()):
                kind, why = (
                    "unmasked_head",
                    f"heads {others} of this layer are exactly causal, this one is not",
                )
            else:
                kind, why = "future_attention", "weight above the diagonal"
            add(
                kind,
                h,
                b,
                q,
                k,
                fm,
                f"{why}: up to {fm:.3g} of a row's mass on later keys ({n_rows} row(s)); "
                f"worst cell query {q} -> key {k} = {float(cells[b, q, k]):.3g}",
            )
        if isinstance(expect, int) and not isinstance(expect, bool):
            used = int(span[:, h].max())
            if used > expect:
                b, q = _argmax2(span[:, h].float())
                k = int(first[b, h, q])
                add(
                    "window_too_wide",
                    h,
                    b,
                    q + offset,
                    k,
                    used,
                    f"declared window {expect} keys, but query {q + offset} attends key {k} "
                    f"({used} keys back incl. itself)",
                )
        pm = float(pad_mass[:, h].max())
        if pm > tol["mass"]:
            b, q = _argmax2(pad_mass[:, h])
            k = int((p0[b, h, q] * padkey[b, 0, 0]).argmax())
            padq = (~qmask).nonzero()
            over_q = False
            if len(padq):
                pr = p0[padq[:, 0], h, padq[:, 1]]
                fin = finite[padq[:, 0], h, padq[:, 1]]
                wide = (pr > 0).sum(-1) >= 2  # a row with one visible key is trivially uniform
                uniform = (pr.amax(-1) - _min_nonzero(pr)) < 1e-6
                over_q = bool((~fin).all()) or (bool(wide.any()) and bool(uniform[wide & fin].all()))
            if over_q:
                add(
                    "mask_over_queries",
                    h,
                    b,
                    q + offset,
                    k,
                    pm,
                    f"real tokens put up to {pm:.3g} of their mass on pad keys while pad queries "
                    "are fully masked: the padding mask is broadcast over queries, not keys",
                )
            else:
                add(
                    "pad_attention",
                    h,
                    b,
                    q + offset,
                    k,
                    pm,
                    f"real tokens put up to {pm:.3g} of their mass on padding keys (the padding mask "
                    "is not applied)",
                )
    return found, stats


def _min_nonzero(rows: torch.Tensor) -> torch.Tensor:
    return torch.where(rows > 0, rows, torch.full_like(rows, float("inf"))).amin(-1)


def _first(mask: torch.Tensor) -> tuple[int, int]:
    idx = mask.nonzero()
    return int(idx[0, 0]), int(idx[0, 1])


def _argmax2(x: torch.Tensor) -> tuple[int, int]:
    i = int(x.flatten().argmax())
    return i // x.shape[1], i % x.shape[1]


def _argmax3(x: torch.Tensor) -> tuple[int, int, int]:
    i = int(x.flatten().argmax())
    b, r = divmod(i, x.shape[1] * x.shape[2])
    return b, r // x.shape[2], r % x.shape[2]


def display_name(cache: Any, stack: str, expected: dict[str, Expect]) -> str:
    """The stack name to show: a lone stack held to causal is the ``decoder``.

    (The capture names a lone stack ``encoder`` when its attention is not causal, which is exactly
    what a broken decoder looks like.)
    """
    if stack == "encoder" and "decoder" not in cache.stacks and expected.get(stack) != "bidirectional":
        return "decoder"
    return stack


def _future_note(label: str, grid: dict, tol: dict[str, float]) -> str:
    """Exactly zero vs. tiny but non-zero weight above the diagonal (heads over tolerance are findings)."""
    cells = [
        (layer, h, m)
        for layer, row in zip(grid["layers"], grid["future"], strict=True)
        for h, m in enumerate(row)
    ]
    tiny = [(layer, h, m) for layer, h, m in cells if 0 < m <= tol["mass"]]
    zero = sum(m == 0 for _, _, m in cells)
    if not tiny:
        return f"{label}: weight on later keys is exactly 0 in {zero} of {len(cells)} heads"
    worst = max(m for *_, m in tiny)
    where = ", ".join(f"L{layer} H{h}" for layer, h, _ in tiny[:6]) + (" ..." if len(tiny) > 6 else "")
    return (
        f"{label}: weight on later keys is exactly 0 in {zero} of {len(cells)} heads; tiny but non-zero in "
        f"{len(tiny)} ({where}; at most {worst:.3g} of a row, within the tolerance {tol['mass']:g}: the "
        "residue of a finite mask fill, not a leak)"
    )


def check_cache(cache: Any, expected: dict[str, Expect], tol: dict[str, float]):
    """Run :func:`check_pattern` on every pattern in ``cache``.

    ``expected[stack]`` is what that stack's self-attention is held to. Returns
    ``(findings, grids, notes)``; ``grids[label]`` has per layer x head ``future``/``pad``/``window``.
    """
    meta = cache.metadata
    findings: list[Finding] = []
    grids: dict[str, dict[str, list[list[float]]]] = {}
    notes: list[str] = []
    has_encoder = "encoder" in cache.stacks
    for stack in cache.stacks:
        shown = display_name(cache, stack, expected)
        layers = sorted({e["layer"] for e in meta.get("layers", []) if e.get("stack") == stack})
        if not layers:
            layers = list(range(cache.n_layers(stack)))
        for kind in ("self", "cross"):
            label = shown if kind == "self" else f"{shown} cross"
            exp = expected.get(stack, "bidirectional") if kind == "self" else "bidirectional"
            for layer in layers:
                try:
                    p = cache.pattern(stack, layer, kind)
                except KeyError:
                    continue
                B, H, Q, K = p.shape
                cached_self = kind == "cross" and not has_encoder and K > Q
                if cached_self:  # decoding with a KV cache: keys = cached + new, not another stream
                    exp = expected.get(stack, "bidirectional")
                qmask = _query_mask(meta, stack, kind, B, Q)
                kmask = _key_mask(
                    meta, "encoder" if kind == "cross" and has_encoder else stack, "self", B, K, has_encoder
                )
                f, stats = check_pattern(p, qmask, kmask, exp, tol, {"stack": shown, "layer": layer})
                findings += f
                g = grids.setdefault(
                    label,
                    {"future": [], "pad": [], "window": [], "layers": [], "cache_stack": stack, "kind": kind},
                )
                for name in ("future", "pad", "window"):
                    g[name].append(stats[name])
                g["layers"].append(layer)
            if label in grids:
                if kind == "cross" and not (not has_encoder and exp != "bidirectional"):
                    notes.append(
                        f"{label}-attention reads another sequence: not expected causal "
                        "(checked: padding, rows)"
                    )
                elif exp == "bidirectional":
                    notes.append(
                        f"{label} self-attention is bidirectional by design: not expected causal "
                        "(checked: padding, rows)"
                    )
                else:
                    notes.append(_future_note(label, grids[label], tol))
                    if isinstance(exp, int):
                        used = max(max(r) for r in grids[label]["window"])
                        notes.append(f"{label}: sliding window declared {exp} keys, widest used {int(used)}")
    return findings, grids, notes
