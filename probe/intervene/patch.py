"""Activation patching: ``probe.patch(model, clean, corrupted, what=..., metric=...)``.

The model runs on the clean inputs once (every site recorded), then on the corrupted inputs once
per cell with one activation taken from the clean run:

* ``what="resid"``: the residual stream entering layer ``L`` (``resid_pre``) at position ``p``
  (a layers × positions map);
* ``what="heads"``: head ``h``'s output (its slice of the output projection's input) at every
  position, or at ``positions`` (a layers × heads map);
* ``what="attn"`` / ``"mlp"``: the sublayer's output (its write to the stream) at position ``p``
  (a layers × positions map).

Each cell's metric ``m`` is reported raw and normalised as in the patching literature:
``(m - m_corrupted) / (m_clean - m_corrupted)``: 1 = the patch restores the clean behaviour,
0 = no effect. Clean and corrupted inputs must have the same number of tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from probe.analysis.interventions import Patching
from probe.analysis.table import Table
from probe.errors import ProbeError
from probe.intervene.core import media_kw, prepare_call, prepare_sites
from probe.intervene.edits import Edit, applied, recording
from probe.intervene.locate import Site
from probe.intervene.metrics import metric_tensor

WHATS = ("resid", "heads", "attn", "mlp")
COLUMNS = ["stack", "layer", "component", "pos", "token", "head", "metric", "normalised"]


def _sites(prep, what: str, stack: str) -> list[Site]:
    keys = sorted(k for k in prep.sites.heads if k[0] == stack)
    layers = sorted({k[1] for k in keys})
    if what == "resid":
        out = [prep.sites.layers.get((stack, i)) for i in layers]
        bad = [i for i, s in zip(layers, out, strict=True) if s is None]
        if bad:
            why = prep.sites.refused.get((stack, bad[0], "resid"), "not found")
            raise ProbeError(f"cannot patch the residual stream of {stack} layer {bad[0]}: {why}")
        return out
    role = {"heads": "self", "attn": "self", "mlp": "mlp"}[what]
    return [prep.site(stack, i, role) for i in layers]


def patch(
    model: nn.Module,
    clean: Any,
    corrupted: Any,
    *,
    what: str = "resid",
    metric: Any = "logit_diff",
    answer: Any = None,
    wrong: Any = None,
    positions: list[int] | None = None,
    stack: str | None = None,
    tokenizer: Any = None,
    processor: Any = None,
    text: Any = None,
    sampling_rate: Any = None,
) -> Patching:
    """Patch clean activations into the corrupted run, one cell at a time; returns :class:`Patching`.

    ``what``: ``"resid"``, ``"heads"``, ``"attn"`` or ``"mlp"`` (see the module docstring);
    ``metric``: ``"logit_diff"`` (needs ``answer`` and ``wrong``), ``"prob"`` (``answer``),
    ``"loss"`` or a function of the model's outputs; ``positions``: the positions to patch
    (default all; for ``"heads"`` default all at once). ``clean`` and ``corrupted``: texts, ids,
    dicts of model arguments, or both pictures (or both sound) made into inputs by the same
    ``processor`` (with the same ``text`` beside them for a vision-language model;
    ``sampling_rate`` for sound), as :func:`probe.capture` takes them.
    """
    if what not in WHATS:
        raise ProbeError(f"what= is one of {', '.join(WHATS)}, not {what!r}")
    m = media_kw(processor, text, sampling_rate)
    prep = prepare_sites(model, clean, tokenizer=tokenizer, **m)
    corr = prepare_call(model, corrupted, tokenizer, None, **m)
    from probe.intervene.core import choose_stack

    st = choose_stack(prep, stack)
    sites = _sites(prep, what, st)
    where = "output" if what in ("attn", "mlp") else "input"
    with torch.no_grad(), recording(model, [(s, where) for s in sites]) as got:
        prep.run()
    saved = [got[(i, where)] for i in range(len(sites))]
    ids = padded_ids(prep.meta)
    mask = prep.mask(saved[0], st)
    m = metric_tensor(model, metric, answer=answer, wrong=wrong, ids=ids, mask=mask, tokenizer=tokenizer)
    name, fn = m.name, lambda out: float(m(out))
    with torch.no_grad():
        out_corr = corr.run()
    _same_shape(prep.outputs, out_corr)
    m_clean, m_corr = fn(prep.outputs), fn(out_corr)
    T = saved[0].shape[1]
    row0 = _labels(prep, st, T)
    cells = _cells(what, sites, T, positions)
    notes = []
    if m_clean == m_corr:
        notes.append(
            "the metric is the same on the clean and the corrupted inputs: nothing to normalise by (NaN)"
        )
    rows, grid = _run_cells(model, corr, fn, what, where, sites, saved, cells, st, row0, m_clean, m_corr)
    col_keys = sorted({c for _, c in grid}, key=lambda c: -1 if c is None else c)
    g = torch.full((len(sites), len(col_keys)), math.nan)
    for (si, c), v in grid.items():
        g[si, col_keys.index(c)] = v
    col_names = [
        f"H{c}" if what == "heads" else (f"{c}:{row0[c]}" if c < len(row0) else str(c)) for c in col_keys
    ]
    return Patching(
        what,
        name,
        m_clean,
        m_corr,
        Table(rows, COLUMNS, f"patching {what}"),
        g,
        [f"L{s.layer}" for s in sites],
        col_names,
        notes,
    )


def _run_cells(
    model, corr, fn, what, where, sites, saved, cells, st, row0, m_clean, m_corr
) -> tuple[list, dict]:
    """One patched corrupted run per cell: the table rows and ``{(site, column): normalised}``."""
    rows, grid = [], {}
    denom = m_clean - m_corr
    for si, head, pos in cells:
        s, full = sites[si], saved[si]
        cols = slice(head * s.d_head, (head + 1) * s.d_head) if head is not None else None
        edit = Edit(s, where, cols, _from_clean(full, cols, pos), pos)
        with torch.no_grad(), applied(model, [edit]):
            m = fn(corr.run())
        norm = (m - m_corr) / denom + 0.0 if denom != 0 else math.nan  # + 0.0: no -0.0
        grid[(si, head if what == "heads" else pos)] = norm
        comp = (
            f"L{s.layer}."
            + (f"H{head}" if head is not None else what)
            + (f"@{pos}" if pos is not None else "")
        )
        rows.append(
            {
                "stack": st,
                "layer": s.layer,
                "component": comp,
                "pos": pos,
                "token": row0[pos] if pos is not None and pos < len(row0) else None,
                "head": head,
                "metric": m,
                "normalised": norm,
            }
        )
    return rows, grid


def _labels(prep, st: str, T: int) -> list[str]:
    """The first input's position names in stack ``st`` (``T`` positions): the decoder's tokens of
    an encoder-decoder, else the capture's names (words, ``[CLS]``, ``patch (r, c)``) where they
    cover this stack (as many, or the padded texts' length), else the positions' numbers."""
    meta = prep.meta
    tokens = (meta.get("target_tokens") if st == "decoder" else None) or prep.labels or meta.get("tokens")
    key = "target_attention_mask" if st == "decoder" and meta.get("target_tokens") else "attention_mask"
    padded = meta.get(key)
    row = tokens[0] if tokens else []
    if row and (len(row) == T or (padded and len(padded[0]) == T)):
        return list(row)
    return [str(i) for i in range(T)]


def _same_shape(a: Any, b: Any) -> None:
    from probe.forward import outputs_of

    sa, sb = tuple(outputs_of(a).shape), tuple(outputs_of(b).shape)
    if sa != sb:
        raise ProbeError(
            f"clean and corrupted inputs give outputs of different shapes ({sa} vs {sb}); "
            "patching needs the same number of tokens in both"
        )


def padded_ids(meta: dict) -> Tensor | None:
    """The token ids ``[batch, pos]`` of the inputs (the decoder's for an encoder-decoder), padded
    with 0 (padding is masked out wherever ids are used)."""
    ids = meta.get("target_ids") or meta.get("ids")
    if not ids:
        return None
    T = max(len(r) for r in ids)
    mask = meta.get("target_attention_mask") if meta.get("target_ids") else meta.get("attention_mask")
    out = torch.zeros(len(ids), T, dtype=torch.long)
    for b, r in enumerate(ids):
        if mask is not None and len(mask[b]) == T and mask[b][0] == 0:  # left padding
            out[b, T - len(r) :] = torch.tensor(r)
        else:
            out[b, : len(r)] = torch.tensor(r)
    return out


def _cells(what: str, sites: list[Site], T: int, positions: list[int] | None) -> list[tuple]:
    """``(site index, head or None, position or None)`` for every patch to run."""
    for p in positions or []:
        if not -T <= p < T:
            raise ProbeError(f"position {p} is outside the {T} positions of the inputs")
    pos = [p % T for p in positions] if positions is not None else None
    if what == "heads":
        return [(i, h, p) for i, s in enumerate(sites) for h in range(s.heads) for p in (pos or [None])]
    return [(i, None, p) for i in range(len(sites)) for p in (pos if pos is not None else range(T))]


def _from_clean(full: Tensor, cols: slice | None, pos: int | None):
    part = full[..., cols] if cols is not None else full
    if pos is not None:
        part = part[:, pos]

    def value(x: Tensor) -> Tensor:
        if x.shape != part.shape:
            raise ProbeError(
                f"clean and corrupted inputs differ in shape ({tuple(part.shape)} vs {tuple(x.shape)}); "
                "patching needs the same number of tokens in both"
            )
        return part

    return value


__all__ = ["Patching", "patch", "padded_ids", "WHATS"]
