"""What figures, the report and exports ask of a cache, answered once: a mixin of :class:`probe.Cache`.

Which layers of a stack hold a pattern, which model heads its head axis holds, which positions of
a text are real and which tokens label them (:mod:`probe.cache.axes`), one head's weights between
real tokens; and the inputs of other viewers (:mod:`probe.cache.viewers`). Everything here reads the
mapping's keys, shapes, tensors and metadata only.
"""

from __future__ import annotations

from typing import Any

import torch

from probe.cache import axes as _axes
from probe.cache.format import is_stack_name, key
from probe.cache.viewers import bertviz_inputs, circuitsvis_inputs
from probe.errors import ProbeError


class CacheKeyError(ProbeError, KeyError):
    """A key or pattern that is not in the cache (a :class:`ProbeError` and a ``KeyError``)."""

    __str__ = BaseException.__str__  # KeyError would quote the message


def _check_kind(kind: str) -> str:
    if kind not in ("self", "cross"):
        raise ProbeError(f"kind must be 'self' or 'cross', not {kind!r}")
    return kind


class CacheQueries:
    """Queries over a cache's keys and metadata; :class:`probe.Cache` provides ``keys``,
    ``shape``, ``pattern``, ``layer_indices``, ``stacks`` and ``metadata``."""

    _keys: list[str]
    _metadata: dict[str, Any]

    @property
    def n_texts(self) -> int:
        """The number of texts (the batch size) the cache holds."""
        n = _axes.n_texts(self._metadata)
        if n is None:
            n = self.shape(self._keys[0])[0] if self._keys else 0
        return n

    def pattern_layers(self, stack: str, kind: str = "self") -> list[int]:
        """The layers of ``stack`` that hold a ``kind`` (``"self"``/``"cross"``) pattern, ascending."""
        return self.layer_indices(stack, f"{_check_kind(kind)}_attn.pattern")

    def pattern_stack(self, stack: str | None = None, kind: str = "self") -> str:
        """``stack`` checked against the cache, or by default the stack a ``kind`` pattern is
        usually read from: the decoder (the only stack with cross-attention), else the only one."""
        _check_kind(kind)
        stacks = self.stacks
        if not any(self.pattern_layers(s, k) for s in stacks for k in ("self", "cross")):
            if self.partial:
                raise self.not_kept()
            raise ProbeError("this cache holds no attention patterns; capture a model with probe.capture")
        if stack is not None:
            if stack not in stacks:
                raise CacheKeyError(f"stack {stack!r} is not in this cache; it has {', '.join(stacks)}")
            return stack
        return "decoder" if kind == "cross" or "decoder" in stacks else stacks[0]

    def head_ids(self, stack: str, layer: int, kind: str = "self") -> list[int]:
        """The model's head index of each entry of a pattern's head axis: all heads, or the heads
        captured (``metadata["heads_captured"]``)."""
        n = self.shape(self._pattern_key(stack, layer, kind))[1]
        captured = self._metadata.get("heads_captured")
        return list(captured) if captured and len(captured) == n else list(range(n))

    def axes(self, stack: str, kind: str = "self", batch: int = 0) -> tuple[_axes.Axis, _axes.Axis]:
        """``(queries, keys)`` of text ``batch``'s ``stack``/``kind`` pattern: each an
        :class:`~probe.cache.axes.Axis` with the real (unpadded) positions and their tokens."""
        layers = self.pattern_layers(stack, kind)
        k = self._pattern_key(stack, layers[0] if layers else 0, kind)
        n_batch, _, n_q, n_k = self.shape(k)
        if isinstance(batch, bool) or not isinstance(batch, int) or not 0 <= batch < n_batch:
            raise ProbeError(f"batch {batch!r} is out of range: the cache holds {n_batch} text(s)")
        q_side, k_side = _axes.sides(self._metadata, self.stacks, stack, kind)
        return (
            _axes.axis(self._metadata, q_side, batch, n_q),
            _axes.axis(self._metadata, k_side, batch, n_k),
        )

    def stream_axis(self, stack: str, batch: int = 0) -> _axes.Axis:
        """The real positions and tokens of text ``batch`` along ``stack``'s residual stream (the
        positions of its ``[batch, pos, d_model]`` tensors: the target side of an encoder-decoder's
        decoder, else the input)."""
        names = [k for k in self._keys if k.startswith(f"{stack}.") and not k.endswith("pattern")]
        if not names:
            raise CacheKeyError(f"this cache holds no residual-stream tensors in the {stack!r} stack")
        n_batch, n_pos = self.shape(names[0])[:2]
        if isinstance(batch, bool) or not isinstance(batch, int) or not 0 <= batch < n_batch:
            raise ProbeError(f"batch {batch!r} is out of range: the cache holds {n_batch} text(s)")
        side = _axes.sides(self._metadata, self.stacks, stack, "self")[0]
        return _axes.axis(self._metadata, side, batch, n_pos)

    def head_pattern(
        self, layer: int, head: int = 0, *, stack: str | None = None, kind: str = "self", batch: int = 0
    ) -> tuple[torch.Tensor, _axes.Axis, _axes.Axis]:
        """One head's weights between real tokens: ``(weights [n_query, n_key] float32, queries,
        keys)``. ``head`` is the model's head index (see :meth:`head_ids`); ``stack`` defaults as in
        :meth:`pattern_stack`. Padding positions are left out of both axes."""
        stack = self.pattern_stack(stack, kind)
        ids = self.head_ids(stack, layer, kind)  # checks that the layer holds this pattern
        if head not in ids:
            raise ProbeError(f"head {head} is not in this cache's {stack} layer {layer}; it has heads {ids}")
        q, kk = self.axes(stack, kind, batch)
        w = self.pattern(stack, layer, kind, head=ids.index(head), batch=batch).float()
        return w[q.positions][:, kk.positions], q, kk

    def _pattern_key(self, stack: str, layer: int, kind: str) -> str:
        """The key of a ``stack``/``layer``/``kind`` pattern, or a one-line error naming what exists."""
        _check_kind(kind)
        name = f"{kind}_attn.pattern"
        k = key(stack, layer, name) if is_stack_name(stack) else None
        if k is not None and k in self:
            return k
        have = self.layer_indices(stack, name)
        if not have and self.partial:
            raise self.not_kept()
        if not have:
            what = (
                "cross-attention (it is not an encoder-decoder)" if kind == "cross" else f"{kind}-attention"
            )
            raise CacheKeyError(f"this cache has no {what} in the {stack} stack")
        raise CacheKeyError(f"layer {layer} of the {stack} stack is not in this cache; it has layers {have}")

    # -- other viewers (probe.cache.viewers; probe.export writes their pages) ---------------------
    def to_bertviz(self, batch: int = 0) -> dict[str, Any]:
        """Text ``batch`` as BertViz takes it: ``bertviz.head_view(**cache.to_bertviz())`` (or
        ``model_view``). See :func:`probe.export.bertviz_inputs`."""
        return bertviz_inputs(self, batch)

    def to_circuitsvis(
        self, *, stack: str | None = None, layers: list[int] | None = None, batch: int = 0
    ) -> dict[str, Any]:
        """Text ``batch``'s self-attention heads as CircuitsVis takes them:
        ``circuitsvis.attention.attention_heads(**cache.to_circuitsvis())``. See
        :func:`probe.export.circuitsvis_inputs`."""
        return circuitsvis_inputs(self, stack=stack, layers=layers, batch=batch)
