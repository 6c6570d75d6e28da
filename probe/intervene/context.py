"""One context manager for every edit, and the plain functions built on it.

``with probe.intervene(model, inputs, ablate=[(layer, head)], knockout=[(-1, range(2, 5))]) as iv:``
installs head/sublayer ablation (:mod:`probe.intervene.ablate`) and attention knockout
(:mod:`probe.intervene.knockout`) as hooks for the block: every forward of ``model`` inside it
(on these inputs or others of any length) runs edited; on leaving (an exception included) the
hooks are removed and the model computes exactly what it did before. ``inputs`` are needed to
find the places (and are the mean/resample reference by default): ``iv.outputs`` is the edited
model's return value on them, ``iv.clean`` the unedited one. :func:`ablate` and :func:`knockout`
are this block run once on the inputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from probe.analysis.table import Table
from probe.errors import ProbeError
from probe.forward import has_outputs, outputs_of
from probe.intervene.ablate import Ablation, ablation_rows, build_edits, effect
from probe.intervene.core import (
    Prepared,
    media_kw,
    parse_heads,
    parse_sublayers,
    prepare_sites,
    site_label,
)
from probe.intervene.edits import exclusive, hooked
from probe.intervene.knockout import Knockout, knock_plan, knock_table, knocked

_KNOCK_KEYS = ("edges", "layers", "heads", "role")


@dataclass
class Intervention:
    """What :func:`intervene` installed. ``outputs``/``clean``: the model's return value on the
    inputs with and without the edits; ``ablated``: the :class:`Ablation` table (one row per
    removed head or sublayer); ``knocked``: the :class:`Knockout` table (per knocked-out head, the
    attention ops edited in the run on the inputs; empty without ``knockout=``); ``summary``: the
    effect on the outputs, as :attr:`Ablation.summary`."""

    outputs: Any
    clean: Any
    ablated: Table
    knocked: Table
    summary: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        s = ", ".join(f"{k} {v:.4g}" for k, v in self.summary.items())
        return f"{self.ablated}\n{self.knocked}\n{s}"


def _knock_args(knockout: Any) -> dict:
    if isinstance(knockout, dict):
        bad = set(knockout) - set(_KNOCK_KEYS)
        if bad or "edges" not in knockout:
            raise ProbeError(
                f"knockout= is the edges, or a dict with edges= and optionally {', '.join(_KNOCK_KEYS[1:])}"
                + (f"; not {sorted(bad)}" if bad else "")
            )
        return dict(knockout)
    return {"edges": knockout}


def _no_repeats(heads: list) -> None:
    seen = set()
    for s, h in heads:
        if (id(s), h) in seen:
            raise ProbeError(f"{site_label(s, h)} is named twice; name each head once")
        seen.add((id(s), h))


@contextmanager
def intervene(
    model: nn.Module,
    inputs: Any,
    *,
    ablate: Any = (),
    sublayers: Any = (),
    how: str = "zero",
    reference: Any = None,
    knockout: Any = None,
    stack: str | None = None,
    tokenizer: Any = None,
    target: Any = None,
    processor: Any = None,
    text: Any = None,
    sampling_rate: Any = None,
) -> Iterator[Intervention]:
    """Install the edits on ``model`` for the ``with`` block; yields an :class:`Intervention`.

    ``ablate``: heads ``[(layer, head), ...]`` (or ``(stack, layer, head)``, ``(stack, layer,
    "cross", head)``) and ``sublayers`` ``[(layer, "attn"|"cross_attn"|"mlp"), ...]`` removed as
    ``how`` says (``"zero"``, ``"mean"``, ``"resample"`` over ``reference``, default ``inputs``);
    ``knockout``: query → key edges to block (``[(query, keys), ...]`` or a bool ``[q, k]``
    tensor) in every head of ``stack``, or a dict ``{"edges", "layers", "heads", "role"}``.
    ``inputs`` locate the places: texts, ids, a dict of model arguments (a processor's
    ``BatchFeature``), or pictures with ``processor`` (and ``text`` beside them for a
    vision-language model) or sound with ``processor``/``sampling_rate``, all as in
    :func:`probe.capture` (``tokenizer``/``target`` too); ``reference`` is prepared like them.
    Blocks do not nest: a second intervention on the same model inside one (this or a plain
    function) is a :class:`ProbeError`.
    """
    m = media_kw(processor, text, sampling_rate)
    prep = prepare_sites(model, inputs, tokenizer=tokenizer, target=target, **m)
    heads = parse_heads(prep, ablate, stack)
    _no_repeats(heads)
    subs = parse_sublayers(prep, sublayers, stack)
    edits = build_edits(prep, heads, subs, how, reference, tokenizer, target)
    plan, edges = {}, None
    if knockout is not None:
        k = _knock_args(knockout)
        edges = k.pop("edges")
        plan = knock_plan(prep, stack=stack, **k)
    with ExitStack() as es:
        es.enter_context(exclusive(model))
        es.enter_context(hooked(model, edits))
        mode = es.enter_context(knocked(model, plan, edges)) if plan else None
        with torch.no_grad():
            outputs = prep.run()
        table = knock_table(plan, dict(mode.counts)) if mode is not None else knock_table({}, {})
        rows = ablation_rows(heads, subs, how)
        yield Intervention(outputs, prep.outputs, rows, table, _effect(prep, outputs))


def _effect(prep: Prepared, outputs: Any) -> dict[str, float]:
    logits = outputs_of(prep.outputs) if has_outputs(prep.outputs) else None
    mask = prep.mask(logits, "decoder") if logits is not None and logits.dim() >= 2 else None
    return effect(prep.outputs, outputs, mask, prep.sites.d_model)


def ablate(
    model: nn.Module,
    inputs: Any,
    heads: Any = (),
    *,
    sublayers: Any = (),
    stack: str | None = None,
    how: str = "zero",
    reference: Any = None,
    tokenizer: Any = None,
    target: Any = None,
    processor: Any = None,
    text: Any = None,
    sampling_rate: Any = None,
) -> Ablation:
    """Run ``model`` on ``inputs`` with ``heads`` and ``sublayers`` removed; returns an :class:`Ablation`.

    ``heads``: ``[(layer, head), ...]`` (or ``(stack, layer, head)``, ``(stack, layer, "cross",
    head)``); ``sublayers``: ``[(layer, "attn"|"cross_attn"|"mlp"), ...]``; ``how``: ``"zero"``,
    ``"mean"`` or ``"resample"`` over ``reference`` (texts or ids like ``inputs``; default the
    inputs). ``tokenizer``/``target``, and ``processor``/``text``/``sampling_rate`` for pictures
    or sound, as in :func:`probe.capture`. A place probe cannot edit (a
    fused attention kernel) raises a :class:`ProbeError` naming the layer. The same edits as
    ``with probe.intervene(model, inputs, ablate=heads, ...)``.
    """
    kw = dict(sublayers=sublayers, stack=stack, how=how, reference=reference, tokenizer=tokenizer)
    kw |= media_kw(processor, text, sampling_rate)
    with intervene(model, inputs, ablate=heads, target=target, **kw) as iv:
        pass
    return Ablation(iv.outputs, iv.clean, iv.ablated, iv.summary)


def knockout(
    model: nn.Module,
    inputs: Any,
    edges: Any,
    *,
    layers: list[int] | None = None,
    heads: list[int] | None = None,
    stack: str | None = None,
    role: str = "self",
    tokenizer: Any = None,
    target: Any = None,
    processor: Any = None,
    text: Any = None,
    sampling_rate: Any = None,
) -> Knockout:
    """Run ``model`` on ``inputs`` with the query → key ``edges`` blocked in the ``role`` attention
    of ``layers`` (default all) and ``heads`` (default all) of ``stack``; returns a :class:`Knockout`.

    ``edges``: ``[(query, keys), ...]`` (e.g. ``[(-1, range(10, 21))]``: the last token may not
    read positions 10-20) or a bool ``[q, k]`` tensor (True = blocked). ``inputs`` as for
    :func:`ablate` (pictures with ``processor``/``text``, sound). The same edit as
    ``with probe.intervene(model, inputs, knockout={"edges": edges, ...})``.
    """
    k = {"edges": edges, "layers": layers, "heads": heads, "role": role}
    kw = dict(stack=stack, tokenizer=tokenizer, target=target) | media_kw(processor, text, sampling_rate)
    with intervene(model, inputs, knockout=k, **kw) as iv:
        pass
    return Knockout(iv.outputs, iv.clean, iv.knocked, iv.summary)


__all__ = ["Intervention", "intervene", "ablate", "knockout"]
