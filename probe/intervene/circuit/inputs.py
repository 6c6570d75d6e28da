"""The clean and corrupted inputs of a circuit, as examples that run in chunks of the batch.

Inputs are whatever :func:`probe.capture` takes: a text or a list of texts, a tensor of token ids
``[batch, pos]``, a dict of keyword tensors (``input_ids``, ``attention_mask``, ``pixel_values``,
...: every tensor whose first dimension is the batch is split), or a list of pictures or sounds
with ``processor=``. :class:`Examples` takes any subset of them, in any order, with repeats
(a chunk of the batch, or one example repeated once per patched edge), and :func:`run_chunk`
prepares and runs one such subset the way :func:`probe.capture` would.

Circuits compare the clean and corrupted runs position by position, so each corrupted example
must have exactly the positions of its clean one: :func:`check_pair` raises a
:class:`ProbeError` naming the first example whose lengths differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from probe.errors import ProbeError
from probe.intervene.core import prepare_call


class Examples:
    """``n`` examples of one input kind; :meth:`take` gives the inputs of a subset."""

    def __init__(self, inputs: Any, what: str = "inputs") -> None:
        self.what = what
        self.kind, self.data, self.n = _split(inputs, what)

    def take(self, idx: list[int] | Tensor) -> Any:
        """The inputs of examples ``idx`` (in that order, repeats allowed), of the same kind."""
        idx = [int(i) for i in idx]
        if self.kind == "list":
            return [self.data[i] for i in idx]
        if self.kind == "tensor":
            return self.data[torch.tensor(idx, dtype=torch.long)]
        rows = torch.tensor(idx, dtype=torch.long)
        return {
            k: (v[rows.to(v.device)] if isinstance(v, Tensor) and v.dim() and v.shape[0] == self.n else v)
            for k, v in self.data.items()
        }


def _split(inputs: Any, what: str) -> tuple[str, Any, int]:
    if isinstance(inputs, str):
        return "list", [inputs], 1
    if isinstance(inputs, Tensor):
        if inputs.numel() == 0:
            raise ProbeError(f"the {what} are an empty tensor")
        if not inputs.is_floating_point() and inputs.dim() == 1:
            inputs = inputs.unsqueeze(0)
        return "tensor", inputs, int(inputs.shape[0])
    if isinstance(inputs, Mapping):
        sizes = [v.shape[0] for v in inputs.values() if isinstance(v, Tensor) and v.dim()]
        if not sizes:
            raise ProbeError(f"the {what} are a dict without tensors; give input_ids or pixel_values")
        return "dict", dict(inputs), int(sizes[0])
    if isinstance(inputs, (list, tuple)):
        if not inputs:
            raise ProbeError(f"the {what} are an empty list")
        return "list", list(inputs), len(inputs)
    return "list", [inputs], 1  # one picture or sound


@dataclass
class Chunk:
    """A prepared forward call on a subset of the examples: ``run()``, the real-token ``mask``
    ``[batch, pos]`` (None when the inputs have no positions to pad), and the ``examples``."""

    run: Any
    mask: Tensor | None
    examples: Tensor


def run_chunk(model: nn.Module, examples: Examples, idx: list[int], options: dict) -> Chunk:
    """The forward call of ``model`` on examples ``idx`` (``options``: ``tokenizer``, ``processor``,
    ``text``, ``sampling_rate`` as for :func:`probe.capture`), prepared as the interventions do."""
    o = options
    p = prepare_call(
        model,
        examples.take(idx),
        o.get("tokenizer"),
        None,
        processor=o.get("processor"),
        text=o.get("text"),
        sampling_rate=o.get("sampling_rate"),
    )
    mask = p.meta.get("attention_mask")
    if mask is not None:
        mask = torch.as_tensor(mask, dtype=torch.bool)
    return Chunk(p.run, mask, torch.tensor(idx, dtype=torch.long))


def check_pair(clean: Chunk, corrupt: Chunk, n_clean: int, n_corrupt: int) -> None:
    """Refuse corrupted inputs that do not match the clean ones example by example."""
    if n_clean != n_corrupt:
        raise ProbeError(
            f"{n_clean} clean inputs but {n_corrupt} corrupted ones; give one corrupted input per clean one"
        )
    a, b = clean.mask, corrupt.mask
    if a is None or b is None:
        return
    if a.shape != b.shape or not torch.equal(a, b):
        la, lb = a.sum(-1), b.sum(-1)
        for i in range(min(len(la), len(lb))):
            if int(la[i]) != int(lb[i]):
                ex = int(clean.examples[i])
                raise ProbeError(
                    f"clean input {ex} has {int(la[i])} tokens but its corrupted input has {int(lb[i])}; "
                    "circuits compare the runs position by position: give corrupted inputs with the "
                    "same number of tokens (e.g. swap single-token names)"
                )
        raise ProbeError("the clean and corrupted inputs are padded differently; pad them the same way")


def chunks(n: int, size: int) -> list[list[int]]:
    """``range(n)`` in consecutive chunks of at most ``size``."""
    size = max(1, int(size))
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


__all__ = ["Examples", "Chunk", "run_chunk", "check_pair", "chunks"]
