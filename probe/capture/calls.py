"""What the capture's parts share: module calls, the attention seen inside one, the forward's facts.

These are plain records. The :class:`~probe.capture.hooks.watch.Watcher` makes a :class:`Call` for
every module call it sees and keeps them on the call stack; the
:class:`~probe.capture.hooks.layers.LayerTracker` marks which calls are layers and sublayers; the
:class:`~probe.capture.hooks.record.Recorder` opens one :class:`Attention` per attention sublayer call
and hands it to its pattern consumer. :class:`Forward` holds what is learnt about the forward as
a whole (which sizes are sequence lengths, the KV cache's length, kernels probe cannot see).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn


@dataclass
class Attention:
    """The attention computed inside one sublayer call (one pattern per role and layer).

    Set by the recorder: ``inputs``/``primary`` (the tensors handed to the sublayer, the first
    one), ``qk`` (query and key lengths), ``impl`` (how the parts were computed), ``role``
    (``"self"``/``"cross"``, at close). Set by the pattern consumer: ``parts`` (its working
    state), ``handle`` (the sink handle of the stored pattern, None when none was stored),
    ``shape`` (the ``[batch, heads, q, k]`` of the pattern, stored or not) and ``causal`` (None
    when not judged).

    Beside the pattern: ``sinks`` (set by the recorder: the mass of a learned sink column joined
    to the scores, one ``[batch, (heads,) q]`` tensor per part, in the parts' order), ``kind``
    (what the pattern is when it is not one plain softmax, said in the metadata) and ``fields``
    (set by the consumer: the other stored fields of this attention, e.g. ``rows`` or ``sink``,
    field name -> sink handle).
    ``extra``: other fields the recorder mapped with the pattern, ``[batch, heads, ...]`` by
    field name (Pegasus-X's ``globals`` and ``global_rows``), stored as they are.
    ``diff_lambda``: the λ of a differential attention's sublayer (DiffLlama), whose heads pair
    up as ``a1 - λ·a2``.
    ``split``: set by the recorder when one softmax ran over the layer's own keys followed by a
    source's keys (T5Gemma 2's merged attention): the number of own keys; the consumer then stores
    the keys from ``split`` on as a second attention in ``also`` (role ``"cross"``); with
    ``source_first`` the source's keys come first (the keys before ``split``: DiffusionGemma's
    decoder over its encoder's cached keys, then its own).
    ``caller``/``last_shape``/``streams``: where its last part came from, and the group of
    attentions when one module call ran several whole softmaxes (:mod:`probe.capture.hooks.streams`).
    ``scale``: set only on the shadow attention of a derived pattern kind
    (:mod:`probe.capture.consumers.kinds`): ``[batch, heads, keys]``, each key column of the
    weights multiplied by it before the consumer keeps them.
    """

    inputs: list[Tensor] = field(default_factory=list)
    positional: list[Tensor] = field(default_factory=list)  # the sublayer's position embeddings
    primary: Tensor | None = None
    qk: tuple[int, int] = (0, 0)
    impl: set[str] = field(default_factory=set)
    role: str | None = None
    closed: bool = False
    parts: list[Any] = field(default_factory=list)
    handle: int | None = None
    shape: tuple[int, ...] = ()
    causal: bool | None = None
    sinks: list[Tensor] = field(default_factory=list)
    extra: dict[str, Tensor] = field(default_factory=dict)  # more fields the recorder mapped, by name
    self_only: bool = False  # keys of the layer's own streams, whatever the shapes say (role self)
    kind: str | None = None
    module: str | None = None  # the path of the sublayer module that computed it
    diff_lambda: float | None = None  # differential attention: pattern = parts[0] - lambda * parts[1]
    fields: dict[str, int] = field(default_factory=dict)
    split: int | None = None
    source_first: bool = False  # the source's keys come first (DiffusionGemma), then the own keys
    # the module concatenates its keys source first (SOURCE_FIRST in record.py: Idefics2's resampler)
    source_first_module: bool = False
    kv_prefix: int = 0  # positions the sublayer's cache held for its layer, filled in this forward
    also: list[Attention] = field(default_factory=list)
    caller: Any = None  # the innermost module call that computed the last part (probe.capture.hooks.streams)
    last_shape: tuple[int, ...] | None = None  # that part's shape
    streams: list[Attention] | None = None  # the attentions of one module call's several softmaxes
    scale: Tensor | None = None  # a derived kind's key-column scale [batch, heads, keys] (kinds.py)


@dataclass
class Call:
    """One module call on the stack (``primary``: its first tensor argument, the stream it gets)."""

    module: nn.Module
    parent: Call | None
    primary: Tensor | None
    inputs: list[Tensor]
    layer: Any = None  # the Layer this call is (layer calls only)
    attn: Attention | None = None  # the attention computed inside this call, until it returns
    suspended: bool = False  # torch's fused module: runs with the mode off
    source: bool = False  # a sublayer of the layer being captured
    wrapper: bool = False  # holds all of the layer's weights (TransformerLens' bridge): look inside
    events: int = 0  # attention events seen inside this call
    chunks: Any = None  # chunked local attention gathered inside this call (local.Chunks)
    # positions a cache handed to this call already held for its module's layer, filled earlier in
    # the same forward by another stack (DiffusionGemma's decoder attends over its encoder's keys)
    kv_prefix: int = 0
    # tensors handed in as position embeddings (DETR's object queries and spatial embeddings,
    # added to the queries and keys): never a second sequence
    positional: list[Tensor] = field(default_factory=list)


def positional_inputs(kwargs: dict) -> list[Tensor]:
    """The tensors of a call's keyword arguments named as position embeddings
    (``position_embeddings``, ``object_queries``, ``query_pos``, ``pos``, ...)."""
    out = []
    for name, v in kwargs.items():
        if "position" in name or name in ("pos", "query_pos", "object_queries", "pos_embed"):
            out += (
                [v]
                if isinstance(v, Tensor)
                else [t for t in v if isinstance(t, Tensor)]
                if isinstance(v, (tuple, list))
                else []
            )
    return out


@dataclass
class Forward:
    """Facts about the forward being captured, written where they are seen."""

    lengths: set[int] = field(default_factory=set)  # sizes that are sequence lengths in this forward
    cached: int = 0  # positions in the KV cache the forward was given (keys = cached + queries)
    root_calls: int = 0  # forward calls of the model itself
    blind: list[str] = field(default_factory=list)  # attention kernels probe cannot look into, as seen
    # layers where a softmax shaped like attention (>= 4 axes) was not recognised as a pattern:
    # local, chunked or banded layouts (Longformer's sliding chunks, LongT5's blocks) probe cannot map
    unseen: list[str] = field(default_factory=list)
    unseen_why: list[str] = field(default_factory=list)  # what the unseen layers run, where known
    # the first model call's keyword inputs when it was handed pixels (what probe.trace names
    # the positions from): pixel_values, input_ids, attention_mask, image_grid_thw
    root_images: dict[str, Any] = field(default_factory=dict)

    def note_root(self, inputs: list[Tensor], kwargs: dict) -> None:
        """The model's own call: its inputs' sizes, and a KV cache's length, are sequence lengths."""
        sound = ("input_features", "input_values")
        if not self.root_calls and any(isinstance(kwargs.get(k), Tensor) for k in ("pixel_values", *sound)):
            keys = ("pixel_values", "input_ids", "attention_mask", "image_grid_thw", *sound)
            keys += ("decoder_input_ids",)  # a speech model's transcript
            self.root_images = {k: kwargs[k] for k in keys if isinstance(kwargs.get(k), Tensor)}
        self.root_calls += 1
        self.lengths |= _lengths(inputs)
        past = kwargs.get("past_key_values")
        cached = _cached_length(past if past is not None else kwargs.get("cache"))  # the newer name
        if cached:  # keys of a KV-cached call: the cached positions plus the new ones
            self.cached = cached
            self.lengths |= {cached + n for n in self.lengths}


def first_tensor(args: tuple, kwargs: dict) -> Tensor | None:
    """The tensor a module call is about: its first positional tensor, else the usual keywords."""
    for a in args:
        if isinstance(a, Tensor):
            return a
    for name in ("hidden_states", "x", "input", "inputs", "query", "src", "tgt"):
        if isinstance(kwargs.get(name), Tensor):
            return kwargs[name]
    for v in kwargs.values():
        if isinstance(v, Tensor):
            return v
    return None


def output_tensor(out: Any) -> Tensor | None:
    """The main tensor of a module's output (a tensor, a tuple's first, ``last_hidden_state``)."""
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    first = getattr(out, "last_hidden_state", None)
    if isinstance(first, Tensor):
        return first
    if isinstance(out, dict):
        for v in out.values():
            if isinstance(v, Tensor):
                return v
    return None


def tensors(args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors of a call's arguments (and of tuples or lists among them)."""
    found = []
    for v in itertools.chain(args, kwargs.values()):
        if isinstance(v, Tensor):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            found.extend(t for t in v if isinstance(t, Tensor))
    return found


def _lengths(tensors: list[Tensor]) -> set[int]:
    """Sizes that may be sequence lengths: every axis of id tensors and masks, all but the last of floats."""
    sizes: set[int] = set()
    for t in tensors:
        if t.is_nested or t.dim() == 0:
            continue
        sizes.update(t.shape if not t.is_floating_point() else t.shape[:-1])
    return sizes


def layer_cache_length(module: nn.Module, kwargs: dict) -> int:
    """How many positions the cache object handed to an attention module (``cache=``,
    ``past_key_values=``) holds for the module's ``layer_idx``; 0 when none or unknown."""
    idx = getattr(module, "layer_idx", None)
    if not isinstance(idx, int):
        return 0
    for name in ("cache", "past_key_values", "past_key_value"):
        obj = kwargs.get(name)
        if hasattr(obj, "cross_attention_cache"):
            # an encoder-decoder cache's length is the decoder's own positions, which its layer's
            # self-attention put there a moment ago: no keys of another stack (Pegasus-X's cross-
            # attention would otherwise look like a source-first merged softmax)
            return 0
        if obj is not None and not isinstance(obj, Tensor) and hasattr(obj, "get_seq_length"):
            try:
                return int(obj.get_seq_length(idx))
            except Exception:
                return 0
    return 0


def past_length(past: Any) -> int:
    """Positions held in a KV cache: a transformers ``Cache``, or nested tuples of ``(k, v)`` per layer."""
    if hasattr(past, "get_seq_length"):
        return int(past.get_seq_length())
    t = past
    while isinstance(t, (tuple, list)):
        t = t[0]
    return int(t.shape[-2])


def _cached_length(past: Any) -> int:
    """:func:`past_length` of a forward's ``past_key_values``; 0 when there is
    none or its layout is unknown (then only the inputs' lengths apply)."""
    if past is None:
        return 0
    try:
        return past_length(past)
    except Exception:
        return 0


def fields_of(a: Attention) -> dict[str, int]:
    """The stored fields of an attention: its pattern's handle and any others."""
    return ({} if a.handle is None else {"pattern": a.handle}) | a.fields


@dataclass
class LayerRecord:
    """What the tracer captured for one layer (before stack names are settled).

    ``patterns``: ``(role, fields, shape, impls, causal)`` per attention with stored fields
    (``fields``: field name, e.g. ``pattern`` or ``rows``, -> sink handle); ``residuals``:
    ``(name, handle)``; ``notes``: metadata (``residual_note``, ``deltas``).
    """

    container: str
    index: int
    module: str
    patterns: list[tuple[str, dict[str, int], tuple[int, ...], list[str], bool | None]]
    residuals: list[tuple[str, int]]
    notes: dict[str, Any] = field(default_factory=dict)
    # what each attention in ``patterns`` is when it is not one plain softmax (None when it is)
    kinds: list[str | None] = field(default_factory=list)
    call: int = 0  # which call of ``module`` in the forward (> 0 only for modules run several times)
    modules: list[str | None] = field(default_factory=list)  # the sublayer of each attention in ``patterns``
