"""Causal-mask checks that read a cache only: where attention weight goes, row by row.

For every self-attention pattern ``[batch, head, query, key]`` held to ``causal`` (or a window
``W``): the mass above the (bottom-right aligned) diagonal, whether it is exactly zero, the mass on
padding keys, rows that do not sum to 1, NaN/inf rows, a masked diagonal, a swapped mask, the
window actually used, and with a KV cache (query length < key length) top-left alignment.
Bidirectional stacks and cross-attention get the padding and row checks only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from probe.analysis.causal.expect import Expect
from probe.analysis.causal.report import Finding
from probe.errors import ProbeError


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


@dataclass
class _Pattern:
    """One layer's pattern [batch, head, query, key] and what every check reads from it."""

    p0: torch.Tensor  # the pattern in float32, NaN/inf set to 0
    finite: torch.Tensor  # [B, H, Q] rows without NaN/inf
    rows: torch.Tensor  # [B, H, Q] real query rows
    qmask: torch.Tensor  # [B, Q] real queries
    padkey: torch.Tensor  # [B, 1, 1, K] padding keys
    expect: Expect
    tol: dict[str, float]
    offset: int  # a KV cache: query i sits at position offset + i (bottom-right alignment)
    future: torch.Tensor  # [Q, K] keys after the query
    past: torch.Tensor  # [Q, K] keys before the query
    fmass: torch.Tensor  # [B, H, Q] mass on later keys (0 when not held to causal)
    pad_mass: torch.Tensor  # [B, H, Q] mass on padding keys
    first: torch.Tensor  # [B, H, Q] the earliest real, non-future key with weight (K: none)
    span: torch.Tensor  # [B, H, Q] keys back from the query to ``first``, itself included
    exact: list[bool]  # per head: every future cell of every real row exactly 0
    ids: list[int] = field(default_factory=list)  # the model's head index of each head entry

    @property
    def causal(self) -> bool:
        return self.expect != "bidirectional"


def _measure(p, qmask, kmask, expect, tol) -> _Pattern:
    """The masks and per-row masses of pattern ``p`` that the checks share."""
    p = p.float()
    B, H, Q, K = p.shape
    offset = K - Q
    qpos = torch.arange(Q)[:, None] + offset
    kpos = torch.arange(K)[None, :]
    future = kpos > qpos
    rows = qmask[:, None, :].expand(B, H, Q)
    p0 = torch.nan_to_num(p, nan=0.0, posinf=0.0, neginf=0.0)
    padkey = ~kmask[:, None, None, :]
    causal = expect != "bidirectional"
    fmass = (p0 * future).sum(-1).masked_fill(~rows, 0) if causal else torch.zeros(B, H, Q)
    # the window actually used: how far back the earliest real key with weight lies
    nz = (p0 > tol["mass"]) & kmask[:, None, None, :] & ~future & rows[..., None]
    seen = nz.any(-1)
    first = torch.where(seen, nz.to(torch.uint8).argmax(-1), K)  # argmax: the first True key
    return _Pattern(
        p0=p0,
        finite=torch.isfinite(p).all(-1),
        rows=rows,
        qmask=qmask,
        padkey=padkey,
        expect=expect,
        tol=tol,
        offset=offset,
        future=future,
        past=kpos < qpos,
        fmass=fmass,
        pad_mass=(p0 * padkey).sum(-1).masked_fill(~rows, 0),
        first=first,
        span=(qpos[:, 0] - first + 1).masked_fill(~seen, 0),
        exact=(~((p0 * future != 0) & rows[..., None]).flatten(2).any(-1).any(0)).tolist(),
    )


def check_pattern(
    p: torch.Tensor,
    qmask: torch.Tensor,
    kmask: torch.Tensor,
    expect: Expect,
    tol: dict[str, float],
    where: dict[str, Any],
) -> tuple[list[Finding], dict[str, list[float]]]:
    """Check one layer's pattern ``p`` [batch, head, query, key]; returns findings and per-head stats.

    ``qmask``/``kmask`` [batch, query]/[batch, key] mark real tokens. ``where`` names the stack
    and layer for the findings and may give ``heads``, the model's head index of each entry of the
    head axis (a cache that captured some heads, see ``Cache.head_ids``; default 0..H-1): findings
    and evidence name those. The stats dict has
    ``future``, ``pad`` (max mass over real rows, per head) and ``window`` (keys back used, per head).
    Per head, in this order: the row checks (top-left KV alignment, a masked diagonal, NaN/inf
    rows, row sums), weight on later keys, a window wider than expected, weight on padding.
    """
    m = _measure(p, qmask, kmask, expect, tol)
    H = p.shape[1]
    m.ids = list(where.get("heads") or range(H))
    if len(m.ids) != H:
        raise ProbeError(f"where['heads'] names {len(m.ids)} heads for a pattern of {H}")
    stats = {
        "future": [float(m.fmass[:, h].max()) for h in range(H)],
        "pad": [float(m.pad_mass[:, h].max()) for h in range(H)],
        "window": [float(m.span[:, h].max()) for h in range(H)],
    }
    found: list[Finding] = []
    for h in range(H):
        for step in (_broken_rows, _unnormalised_rows, _future_weight, _too_wide, _padding_weight):
            for kind, b, q, k, mag, ev in step(m, h):
                found.append(
                    Finding(kind, where["stack"], where["layer"], m.ids[h], q, k, float(mag), ev, text=b)
                )
    return found, stats


# Each step below yields (kind, text, query, key, magnitude, evidence) for head h of one pattern.


def _top_left(m: _Pattern, h: int) -> bool:
    """With a KV cache (offset > 0), whether every real row of head ``h`` hides the keys a top-left
    aligned causal mask hides: query i (position offset + i) must see keys up to offset + i, and
    ``is_causal=True`` with q_len != k_len hides keys i + 1 .. offset + i instead."""
    r = m.rows[:, h]
    if not m.causal or m.offset <= 0 or not bool(r.any()):
        return False
    Q, K = m.future.shape
    tl_hidden = (torch.arange(K)[None, :] > torch.arange(Q)[:, None]) & ~m.future
    seen = (m.p0[:, h] * tl_hidden).masked_fill(~r[..., None], 0).sum(-1)
    return bool((seen[r] <= m.tol["mass"]).all())


def _broken_rows(m: _Pattern, h: int):
    """A top-left aligned KV-cache mask or a masked diagonal; NaN/inf rows (unless a masked
    diagonal explains them)."""
    r = m.rows[:, h]
    bad_rows = r & ~m.finite[:, h]
    off = m.offset
    Q = m.future.shape[0]
    diag_zero = False
    if _top_left(m, h):
        b, q = _first(r)
        yield (
            "kv_alignment", b, q + off, q + 1, float(off),
            f"with {off} cached keys, query {q + off} sees keys 0..{q} only: the causal "
            "mask is aligned top-left (is_causal=True with a KV cache); align it bottom-right",
        )  # fmt: skip
    elif m.causal and Q > 1:
        d = m.p0[:, h, torch.arange(Q), (torch.arange(Q) + off)]  # [B, Q]
        ok_rows = r & m.finite[:, h]
        diag_zero = bool(ok_rows.any()) and bool((d[ok_rows] == 0).all())
    n_bad = int(bad_rows.sum())
    if diag_zero:
        b, q = _first(bad_rows) if bad_rows.any() else _first(r)
        yield (
            "masked_diagonal", b, q, q + off, n_bad,
            f"no query attends to itself; {n_bad} row(s) have no visible key and are NaN "
            "(mask built with triu(diagonal=0); use diagonal=1)",
        )  # fmt: skip
    elif n_bad:
        b, q = _first(bad_rows)
        yield (
            "non_finite", b, q, None, n_bad,
            f"{n_bad} attention row(s) hold NaN/inf, first at text {b} query {q} "
            "(a mask fill that overflows this dtype, or a fully masked row)",
        )  # fmt: skip


def _unnormalised_rows(m: _Pattern, h: int):
    """Finite real rows whose sum is off 1 by more than the tolerance."""
    ok = m.rows[:, h] & m.finite[:, h]
    sums = m.p0[:, h].sum(-1)
    dev = (sums - 1).abs().masked_fill(~ok, 0)
    if float(dev.max()) > m.tol["rowsum"]:
        b, q = _argmax2(dev)
        yield (
            "rows_not_normalised", b, q, None, float(dev.max()),
            f"row sums range {float(sums[ok].min()):.4g}...{float(sums[ok].max()):.4g} (should be 1)",
        )  # fmt: skip


def _future_weight(m: _Pattern, h: int):
    """Weight on later keys, told apart: a swapped mask, one unmasked head, or plain future weight."""
    fm = float(m.fmass[:, h].max())
    if not m.causal or fm <= m.tol["mass"]:
        return
    r = m.rows[:, h]
    ph = m.p0[:, h]
    cells = (ph * m.future).masked_fill(~r[..., None], 0)
    b, q, k = _argmax3(cells)
    n_rows = int((m.fmass[:, h] > m.tol["mass"]).sum())
    lower_zero = bool(((ph * m.past)[r] == 0).all()) and m.future.shape[0] > 1
    others = [m.ids[g] for g in range(len(m.exact)) if g != h and m.exact[g]]
    if lower_zero:
        kind, why = "swapped_mask", "every earlier key has weight exactly 0 while later keys are seen"
    elif others and not bool((ph.masked_select(m.future & r[..., None]) == 0).any()):
        kind, why = "unmasked_head", f"heads {others} of this layer are exactly causal, this one is not"
    else:
        kind, why = "future_attention", "weight above the diagonal"
    yield (
        kind, b, q, k, fm,
        f"{why}: up to {fm:.3g} of a row's mass on later keys ({n_rows} row(s)); "
        f"worst cell query {q} -> key {k} = {float(cells[b, q, k]):.3g}",
    )  # fmt: skip


def _too_wide(m: _Pattern, h: int):
    """A head that reaches further back than the expected sliding window."""
    if not isinstance(m.expect, int) or isinstance(m.expect, bool):
        return
    used = int(m.span[:, h].max())
    if used > m.expect:
        b, q = _argmax2(m.span[:, h].float())
        k = int(m.first[b, h, q])
        yield (
            "window_too_wide", b, q + m.offset, k, used,
            f"declared window {m.expect} keys, but query {q + m.offset} attends key {k} "
            f"({used} keys back incl. itself)",
        )  # fmt: skip


def _padding_weight(m: _Pattern, h: int):
    """Weight on padding keys: a mask broadcast over queries, or no padding mask at all."""
    pm = float(m.pad_mass[:, h].max())
    if pm <= m.tol["mass"]:
        return
    b, q = _argmax2(m.pad_mass[:, h])
    k = int((m.p0[b, h, q] * m.padkey[b, 0, 0]).argmax())
    if _mask_over_queries(m, h):
        yield (
            "mask_over_queries", b, q + m.offset, k, pm,
            f"real tokens put up to {pm:.3g} of their mass on pad keys while pad queries "
            "are fully masked: the padding mask is broadcast over queries, not keys",
        )  # fmt: skip
    else:
        yield (
            "pad_attention", b, q + m.offset, k, pm,
            f"real tokens put up to {pm:.3g} of their mass on padding keys (the padding mask "
            "is not applied)",
        )  # fmt: skip


def _mask_over_queries(m: _Pattern, h: int) -> bool:
    """Whether the pad query rows of head ``h`` are fully masked (NaN, or uniform over several
    keys): the signature of a padding mask broadcast over queries instead of keys."""
    padq = (~m.qmask).nonzero()
    if not len(padq):
        return False
    pr = m.p0[padq[:, 0], h, padq[:, 1]]
    fin = m.finite[padq[:, 0], h, padq[:, 1]]
    wide = (pr > 0).sum(-1) >= 2  # a row with one visible key is trivially uniform
    uniform = (pr.amax(-1) - _min_nonzero(pr)) < 1e-6
    return bool((~fin).all()) or (bool(wide.any()) and bool(uniform[wide & fin].all()))


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
    ``(findings, grids, notes)``; ``grids[label]`` has per layer x head ``future``/``pad``/``window``,
    the ``layers`` of its rows and the model's ``heads`` of its columns (a cache may hold some of them).
    """
    if getattr(cache, "partial", False):  # rows or top-k only: no check could see every weight
        raise cache.not_kept("whole patterns, which the causal-mask audit reads (every row, every key)")
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
                ids = cache.head_ids(stack, layer, kind)
                f, stats = check_pattern(
                    p, qmask, kmask, exp, tol, {"stack": shown, "layer": layer, "heads": ids}
                )
                findings += f
                g = grids.setdefault(
                    label,
                    {"future": [], "pad": [], "window": [], "layers": [], "cache_stack": stack, "kind": kind},
                )
                for name in ("future", "pad", "window"):
                    g[name].append(stats[name])
                g["layers"].append(layer)
                g["heads"] = ids  # one head selection per cache: the same for every layer
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
