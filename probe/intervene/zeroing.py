"""Value zeroing (Mohebbi et al. 2023): how much each token's value changes each layer's output.

For a layer ``l`` and an input token ``j``, the value vectors of ``j`` in ``l``'s self-attention
(every head, every key/value head) are set to zero where the model computes them, the model runs
again, and each output position ``i`` of the layer is compared with the unchanged run::

    c_ij = 1 - cos(y_i, y_i^{not j}),      rows normalised to sum 1 over the real tokens

``y`` is the layer's output (the stream after the whole layer, MLP included). Unlike the
weight- and norm-based views (:mod:`.contrib`, :mod:`.alti`) it is an intervention: what the
model does without ``j``'s values, nonlinearities included. :func:`value_zeroing` runs every
token's zeroing as one batch of copies of the inputs (``batch_size`` copies a forward, one of
them unchanged: the reference each run is compared with), one layer at a time, and returns a
:class:`~probe.intervene.mixing.TokenMixing` (its rollout, as Mohebbi et al. roll theirs out).
Costs ``layers × ceil(T / (batch_size - 1))`` forwards of ``batch_size`` copies of the inputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from probe.capture.inputs.images import with_text
from probe.errors import ProbeError
from probe.forward import capture
from probe.intervene.anatomy import Anatomy
from probe.intervene.mixing import TokenMixing, anatomy_of, normalise_rows, one_stack, real_tokens
from probe.intervene.values import label

NOTE = "c_ij = 1 - cos(y_i, y_i without token j's values in the layer); y: the layer's output"


def repeat(x: Any, n: int) -> Any:
    """``n`` copies of the whole batch ``x`` one after another (texts, ids, a dict of tensors,
    pictures, sound): copy ``k`` of text ``b`` is row ``k * batch + b``."""
    if x is None:
        return None
    if isinstance(x, str):
        return [x] * n
    if isinstance(x, Tensor):
        x = x.unsqueeze(0) if x.dim() == 1 else x
        return x.repeat(n, *([1] * (x.dim() - 1)))
    if isinstance(x, Mapping):
        b = next((v.shape[0] for v in x.values() if isinstance(v, Tensor) and v.dim()), None)
        data = {
            k: repeat(v, n) if isinstance(v, Tensor) and v.dim() and v.shape[0] == b else v
            for k, v in x.items()
        }
        try:
            return type(x)(data)
        except Exception:  # a mapping type that cannot be rebuilt from a dict
            return data
    if isinstance(x, (list, tuple)):
        return list(x) * n
    return [x] * n


class _Zero:
    """Forward hooks that zero the values of position ``plan[k]`` in copy ``k`` (copy 0 and
    copies without a position keep theirs) on the value projections of one attention."""

    def __init__(self, att: Any, batch: int) -> None:
        self.cols: dict[int, tuple[nn.Module, list[slice]]] = {}
        for blk in att.v:
            self.cols.setdefault(id(blk.module), (blk.module, []))[1].append(blk.cols)
        self.batch = batch
        self.plan: list[int | None] = []
        self.handles: list[Any] = []

    def __enter__(self) -> _Zero:
        for module, _ in self.cols.values():
            self.handles.append(module.register_forward_hook(self._zero))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _zero(self, module: nn.Module, args: Any, out: Any) -> Tensor:
        if not isinstance(out, Tensor) or out.dim() != 3 or out.shape[0] != self.batch * len(self.plan):
            raise ProbeError(
                f"value zeroing needs the value projection's output as [batch, positions, channels]; "
                f"{type(module).__name__} returned {list(getattr(out, 'shape', []))}"
            )
        out = out.clone()
        for k, j in enumerate(self.plan):
            if j is not None:
                for cols in self.cols[id(module)][1]:
                    out[k * self.batch : (k + 1) * self.batch, j, cols] = 0
        return out


def value_zeroing(
    model: nn.Module | Anatomy,
    inputs: Any,
    *,
    stack: str | None = None,
    layers: list[int] | None = None,
    batch_size: int = 16,
    tokenizer: Any = None,
    target: Any = None,
    processor: Any = None,
    text: Any = None,
    sampling_rate: int | None = None,
) -> TokenMixing:
    """Value-zeroing scores of every self-attention layer of ``stack`` (the model's only one by
    default; ``layers`` to choose) on ``inputs`` (anything :func:`probe.capture` takes), see the
    module docstring. ``batch_size``: copies of the inputs per forward (at least 2); ``model`` may
    be its :class:`~probe.intervene.anatomy.Anatomy` already found."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 2:
        raise ProbeError(f"batch_size: copies of the inputs per forward (at least 2), not {batch_size!r}")
    media = {"processor": processor, "text": text, "sampling_rate": sampling_rate}
    an = anatomy_of(model, inputs, tokenizer=tokenizer, target=target, **media)
    model = an.model
    stack = one_stack(an.stacks, stack)
    keep = _layers(an, stack, layers)
    run = {"tokenizer": tokenizer, "processor": with_text(processor, text), "sampling_rate": sampling_rate}
    first = capture(model, inputs, target=target, layers=keep[:1], **run)
    mask, tokens = real_tokens(first, stack)
    B, T = mask.shape
    out = TokenMixing("value zeroing", stack, {}, mask, tokens, notes=[NOTE])
    for layer in keep:
        c = torch.zeros(B, T, T)
        per = batch_size - 1
        for j0 in range(0, T, per):
            plan = [None, *range(j0, min(T, j0 + per))]
            att = an.attention[(stack, layer, "self")]
            y = _outputs(model, inputs, target, att, plan, B, (stack, layer), run).double()
            ref = y[:B]
            for k, j in enumerate(plan[1:], 1):
                cos = torch.nn.functional.cosine_similarity(ref, y[k * B : (k + 1) * B], dim=-1).float()
                c[:, :, j] = (1 - cos).clamp_min(0)
        out.matrices[layer] = normalise_rows(c, mask)
    return out


def _layers(an: Any, stack: str, layers: Any) -> list[int]:
    """The self-attention layers asked for (all of ``stack``'s by default), each checked."""
    have = [i for s, i in an.layers if s == stack and (s, i, "self") in an.attention]
    keep = have if layers is None else [int(i) for i in ([layers] if isinstance(layers, int) else layers)]
    for i in keep:
        key = (stack, i, "self")
        if key in an.refused:
            raise ProbeError(f"probe cannot zero values in {label(key)}: {an.refused[key]}")
        if i not in have:
            raise ProbeError(f"{stack} layer {i} has no self-attention probe found; it has layers {have}")
    if not keep:
        raise ProbeError(f"the {stack} has no self-attention layer probe can zero values in")
    return keep


def _outputs(model, inputs, target, att, plan, B, where, run) -> Tensor:
    """The layer ``where``'s output ``[len(plan) * B, T, d]`` (float32) over copies of the inputs,
    copy ``k`` with the values of position ``plan[k]`` zeroed."""
    n = len(plan)
    zero = _Zero(att, B)
    zero.plan = plan
    with zero:
        cache = capture(model, repeat(inputs, n), target=repeat(target, n), layers=[where[1]], **run)
    return cache[f"{where[0]}.blocks.{where[1]}.resid_post"].float()


__all__ = ["value_zeroing", "repeat", "NOTE"]
