"""Contributions, not only weights: how much of what a head writes comes from each key.

A head's output at query ``i`` is ``sum_j a_ij v_j W_O^h`` (``v_j`` the head's value of key
``j``, bias included; ``W_O^h`` its rows of the output projection). A large weight on a key
whose value the head barely writes says little; Kobayashi et al. (2020) weigh each key by the
norm of what the head writes from it::

    contribution[b, h, i, j] = || a_ij v_j W_O^h || = a_ij || v_j W_O^h ||      (a_ij >= 0)

:func:`contributions` captures the model once with that pattern kind beside the weights: the
value projections are read by hooks (:class:`probe.intervene.values.ValueTap`) and the capture
keeps, for every attention, whatever ``keep=`` keeps of the weights of the contributions too
(:mod:`probe.capture.consumers.kinds`): whole patterns under ``<attn>.contribution``
(``cache.pattern(..., by="contribution")``), rows under ``<attn>.contribution_rows``, the top-k
under ``<attn>.contribution_topk_*``, and with ``keep="stats"`` each head's statistics computed
on the contribution rows renormalised to sum 1, ``<attn>.stat.contrib_<metric>``, beside those by
weight (``probe.head_stats(cache)`` gives them as ``first_contrib``, ``distance_contrib`` and
``HeadStats.by_contribution``). The metadata's ``contribution`` entry holds the definition and,
per attention without contributions, the reason (``refused``); an attention whose pattern is not
one softmax of weights (differential attention, a sink column, global tokens) has none.

What the measure leaves out: the norm before the attention is in ``v_j`` (it is what the head
reads); the residual stream around the attention and the MLPs are not (ALTI, :mod:`.alti`,
takes the residual in; value zeroing, :mod:`.zeroing`, checks by intervention).
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from probe.analysis.focus.streamed.keepstats import stats_fields
from probe.analysis.focus.streamed.run import stats_readers
from probe.cache import Cache
from probe.capture.consumers.kept import parse_keep
from probe.capture.inputs.images import with_text
from probe.errors import ProbeError
from probe.forward import capture, capture_stats
from probe.intervene.anatomy import Anatomy
from probe.intervene.mixing import anatomy_of
from probe.intervene.values import ValueTap, label

DEFINITION = (
    "||a_ij v_j W_O^h||: the norm of what head h writes from key j into query i (Kobayashi et al. "
    "2020); v_j the value the model fed its attention (bias included), W_O^h the head's rows of the "
    "output projection. keep='stats' statistics by contribution are over rows renormalised to sum 1."
)


def contributions(
    model: nn.Module | Anatomy,
    inputs: Any,
    *,
    tokenizer: Any = None,
    target: Any = None,
    processor: Any = None,
    text: Any = None,
    sampling_rate: int | None = None,
    out: str | os.PathLike | None = None,
    layers: list[int] | None = None,
    heads: list[int] | None = None,
    dtype: Any = None,
    keep: Any = None,
    block: int | None = None,
) -> Cache:
    """Capture ``model`` on ``inputs`` with each head's contributions beside its weights (see the
    module docstring). Arguments as :func:`probe.capture` takes them (``keep``: whole patterns,
    ``{"rows": [...]}``, ``{"topk": k}`` or ``"stats"``; ``block``: the row blocks of
    ``keep="stats"``). Costs the anatomy's few forwards (on the first input) and one capture;
    ``model`` may be its :class:`~probe.intervene.anatomy.Anatomy` already found (on any input).
    A ProbeError when no attention of the model has contributions (the reason of the first)."""
    kept = parse_keep(keep)
    if block is not None and kept.kind != "stats":
        raise ProbeError("block= sets the row blocks of keep='stats'; drop it for other keeps")
    an = anatomy_of(
        model, inputs, tokenizer=tokenizer, target=target, processor=processor, text=text,
        sampling_rate=sampling_rate,
    )  # fmt: skip
    model = an.model
    info: dict[str, Any] = {"definition": DEFINITION, "refused": {}}
    tap = ValueTap(an, refused=info["refused"])
    if not tap.keys:
        first = next(iter(info["refused"].items()), ("the model", "probe found no attention"))
        raise ProbeError(f"probe has no contributions for this model ({first[0]}: {first[1]})")
    media = {"processor": with_text(processor, text), "sampling_rate": sampling_rate}
    common = {"tokenizer": tokenizer, "target": target, "out": out, "layers": layers, "heads": heads}
    kinds = {"contribution": tap.scale}
    with tap:
        if kept.kind == "stats":
            cache = capture_stats(
                model, inputs, stats_readers(), stats_fields, dtype=dtype, block=block, kinds=kinds,
                metadata={"contribution": info}, **common, **media,
            )  # fmt: skip
        else:
            cache = capture(
                model, inputs, dtype=dtype, keep=keep, kinds=kinds, metadata={"contribution": info},
                **common, **media,
            )  # fmt: skip
    return cache


__all__ = ["contributions", "DEFINITION", "label"]
