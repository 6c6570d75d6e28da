"""The capture engine: module hooks plus a ``TorchFunctionMode`` that sees attention being computed.

How it works, in one pass over the unmodified model:

* **Where attention happens.** While the model runs, a ``TorchFunctionMode`` sees every
  ``softmax`` (``F.softmax``, ``torch.softmax``, ``Tensor.softmax``), every
  ``F.scaled_dot_product_attention`` and every ``F.multi_head_attention_forward`` call. A softmax
  over the last dimension is a pattern when its last two axes are sequence lengths (lengths of
  the model's inputs or of a layer's stream): routers over experts, output probabilities and
  softmaxes over features are not. Scores laid out ``[batch·heads, q, k]`` are restored to
  ``[batch, heads, q, k]``. For SDPA the fused kernel runs untouched and the weights are
  computed beside it from the same ``q``, ``k``, mask and scale (:mod:`probe.capture.patterns`).
  ``nn.MultiheadAttention`` (and torch's encoder layers), whose fast paths switch off whenever a
  torch-function mode is active, run with the mode suspended; their weights are recomputed from
  the module's parameters. ``flex_attention`` computes inside a compiled kernel probe cannot see:
  a layer that uses it is an error naming the fix, never a silently dropped layer.
* **Layers** are found in the module tree: a layer is the outermost module on the call stack that
  is an element of an ``nn.ModuleList`` (or of an ``nn.Sequential`` of one module type). Its index
  is its index in that list, so ``blocks.3`` is ``list[3]`` also when some elements compute no
  attention (hybrids); those keep ``resid_pre``/``resid_post`` only. A model without such a list
  has one layer: the top-level child that computes attention (or the model itself).
* **Sublayers and roles.** Attention computed inside one child call of the layer is one
  attention sublayer; softmaxes of separate head modules (``[batch, q, k]`` each) are stacked as
  its heads. A sublayer is *cross*-attention when its queries and keys differ in length or it
  is handed a second stream-shaped tensor that is not derived from the layer's own stream (the
  encoder output); the residual handed to an attention module (BLOOM) is not.
* **Stacks.** A list of layers with cross-attention is the ``decoder``; another list beside it is
  the ``encoder``. A lone list is the ``decoder`` when its self-attention is causal, else the
  ``encoder``.
* **Residual stream.** ``resid_pre``/``resid_post`` are the layer's input and output; the deltas
  come from following the data flow inside the layer (:mod:`probe.capture.residual`) and are
  verified against the stream before they are stored, or left out with a note saying why.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from probe.cache.writer import MemorySink
from probe.capture.hooks import _Hooks, _Mode
from probe.capture.layers import LayerRecord, _Call, _Layer, _Layers
from probe.capture.record import _Recorder


class Tracer(_Hooks, _Layers, _Recorder):
    """Hooks a model for one capture; see the module docstring for what it records.

    The state lives here; the methods come in three parts, one module each:
    :mod:`probe.capture.hooks` (the torch-function mode and module hooks that watch the forward),
    :mod:`probe.capture.layers` (per-layer bookkeeping and residuals) and
    :mod:`probe.capture.record` (attention patterns: gathering, layout, storing).
    """

    def __init__(
        self,
        model: nn.Module,
        sink: Any,
        *,
        layers: list[int] | None = None,
        heads: list[int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.sink = sink
        self.layers_wanted = None if layers is None else set(layers)
        self.heads = heads
        self.dtype = dtype  # None or a float dtype (checked by the engine)
        self.names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        # list element -> (the list's name, its index there): layers keep the model's own numbers
        self.container_of: dict[int, tuple[str, int]] = {}
        self.container_len: dict[str, int] = {}
        for n, m in model.named_modules():
            homogeneous = isinstance(m, nn.Sequential) and len({type(c) for c in m}) == 1
            if isinstance(m, nn.ModuleList) or homogeneous:
                self.container_len.setdefault(n, len(m))
                for i, child in enumerate(m.children()):
                    self.container_of.setdefault(id(child), (n, i))
        self.stack: list[_Call] = []
        self.layer: _Layer | None = None
        self.layer_call: _Call | None = None
        self.records: list[LayerRecord] = []
        self.plain: list[tuple[str, int, str, Tensor, Tensor]] = []  # list elements without attention
        self.kept: dict[str, int] = {}  # list with attention -> its number of elements
        self.root_calls = 0
        self.impls: set[str] = set()
        self.stored_dtypes: set[str] = set()
        self.lengths: set[int] = set()  # sizes that are sequence lengths in this forward
        self.cached = 0  # positions in the KV cache the forward was given (keys = cached + queries)
        self.blind: list[str] = []  # attention kernels probe cannot look into, as seen
        self._sources: dict[type, bool] = {}
        self._param_counts: dict[int, int] = {}
        self._mode = _Mode(self)
        self._handles: list[Any] = []
        self._suspended = 0
        self._fast_layers: set[int] = set()
        self._replaying = False
        # Streaming to disk: recomputed patterns go into two buffers used in turn (the I/O thread
        # writes one while the next layer fills the other), which saves allocating and
        # page-faulting a fresh one every layer.
        self._reuse = not isinstance(sink, MemorySink)
        self._scratches: list[Tensor | None] = [None, None]
        self._clean = [False, False]  # last filled by a causal call: zeros above the diagonal stay
        self._turn = 0
        self._causal_call = False
        self._scratch_busy = False
