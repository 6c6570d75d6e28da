"""The cache format: key names, field layouts, metadata markers and the version.

A cache is one safetensors file. Tensor keys are ``<stack>.blocks.<i>.<name>``:

- ``stack``: ``encoder`` or ``decoder`` for the usual one or two stacks (decoder-only models use
  ``decoder``). A model with other stacks (more than an encoder and a decoder, or lists of layers
  that are not an encoder-decoder pair) names each stack by the module path of its layer list,
  e.g. ``initial_char_encoder.layer``; the metadata's ``stacks`` lists every stack in the order
  the model ran them.
- ``i``: the layer index within that stack, from 0: the model's own index in its list of layers,
  or, when one module runs several times in a forward (weight-shared or looped layers), the
  index of the call (the metadata's ``layers[...]`` entry gives the module and its ``call``).
- ``name``: a residual tensor or a field of one attention of the layer:

  * residuals ``resid_pre``, ``resid_post``, ``self_attn.delta``, ``cross_attn.delta``,
    ``mlp.delta`` (``[batch, pos, d_model]``), and each with ``.norm`` (``[batch, pos]``, the L2
    norm of every position's vector, kept instead of the tensor by long-context captures);
  * attention fields ``<role>_attn[.<n>].<field>``: ``role`` is ``self`` or ``cross``; ``n``
    numbers the attentions of one role when a layer computes several (``self_attn.0``,
    ``self_attn.1``; a layer with one has no number); ``field`` is one of :data:`ATTN_FIELDS`.

The safetensors string metadata holds ``format`` (= :data:`FORMAT_MARKER`), ``format_version``
and ``probe`` (a JSON document: texts, tokens, ids, masks, model, stacks, layers, ...).
Version 1 caches (encoder/decoder stacks, one pattern per role) are version 2 caches too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from probe.errors import ProbeError

FORMAT_MARKER = "probe-cache"
FORMAT_VERSION = 2
STACKS = ("encoder", "decoder")  # the usual stack names; others are module paths
ROLES = ("self", "cross")
PATTERN_NAMES = ("self_attn.pattern", "cross_attn.pattern")
RESIDUAL_NAMES = (
    "resid_pre",
    "self_attn.delta",
    "cross_attn.delta",
    "mlp.delta",
    "resid_post",
)
KEY_NAMES = PATTERN_NAMES + RESIDUAL_NAMES  # the names of version 1

# axis names: query/pos/row are positions of the stack's own sequence (``row`` a chosen subset),
# key a position of the sequence attended to (the source for cross-attention), k and part counts
RESIDUAL_LAYOUT = ("batch", "pos", "d_model")
NORM_LAYOUT = ("batch", "pos")
ATTN_FIELDS: dict[str, tuple[str, ...]] = {
    # the attention weights: rows are queries, columns keys; each row sums to 1 (less any sink)
    "pattern": ("batch", "head", "query", "key"),
    # the mass of a learned sink column joined to the scores (GPT-OSS): pattern rows sum to 1 - sink
    "sink": ("batch", "head", "query"),
    # global tokens ahead of the input (Pegasus-X): the queries' weights on them, and the global
    # tokens' own rows over [global tokens | keys]; pattern rows sum to 1 - globals' row sums
    "globals": ("batch", "head", "query", "global"),
    "global_rows": ("batch", "head", "global", "global_key"),
    # weights on compressed block summaries joined to the keys (DeepSeek-V4)
    "compressed": ("batch", "head", "query", "summary"),
    # the softmaxes a head combines (differential attention: pattern = parts[0] - lambda * parts[1])
    "parts": ("batch", "head", "part", "query", "key"),
    # selected query rows over every key, and which rows they are (per text)
    "rows": ("batch", "head", "row", "key"),
    "row_index": ("batch", "row"),
    # the k largest weights of every row, their key positions, and the mass they keep
    "topk_values": ("batch", "head", "query", "k"),
    "topk_indices": ("batch", "head", "query", "k"),
    "topk_mass": ("batch", "head", "query"),
    # attention each key receives, summed over the counted queries
    "received": ("batch", "head", "key"),
    # a derived kind beside the weights (probe.contributions): ||a_ij v_j W_O^h||, the norm of what
    # head h writes from key j into query i (Kobayashi et al. 2020); rows do not sum to 1
    "contribution": ("batch", "head", "query", "key"),
    "contribution_rows": ("batch", "head", "row", "key"),
    "contribution_topk_values": ("batch", "head", "query", "k"),
    "contribution_topk_indices": ("batch", "head", "query", "k"),
    "contribution_topk_mass": ("batch", "head", "query"),
}
# what a pattern is measured by (``Cache.pattern(by=...)``) -> the field that holds it
PATTERN_BY = {"weight": "pattern", "contribution": "contribution"}
STAT_LAYOUT = ("batch", "head")  # ``stat.<metric>``: a per-text statistic of every head

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_STACK = rf"{_IDENT}(?:\.[A-Za-z0-9_]+)*?"
_FIELD = "|".join(re.escape(f) for f in ATTN_FIELDS) + r"|stat\.[a-z][a-z0-9_]*"
_NAME = (
    r"(?:resid_pre|resid_post|mlp\.delta|(?:self|cross)_attn\.delta)(?:\.norm)?"
    rf"|(?:self|cross)_attn(?:\.\d+)?\.(?:{_FIELD})"
)
_KEY_RE = re.compile(rf"^(?P<stack>{_STACK})\.blocks\.(?P<layer>\d+)\.(?P<name>{_NAME})$")
_STACK_RE = re.compile(rf"^{_STACK}$")
_ATTN_RE = re.compile(r"^(?P<role>self|cross)_attn(?:\.(?P<n>\d+))?\.(?P<field>.+)$")


@dataclass(frozen=True)
class Name:
    """A parsed key name: a residual tensor, or one field of one attention of a layer."""

    name: str
    role: str | None = None  # "self"/"cross" for attention fields and attention deltas
    index: int | None = None  # which attention of that role, when the layer has several
    field: str | None = None  # "pattern", "sink", ..., "stat.<metric>"; None for residuals
    norm: bool = False  # a residual's per-position norm instead of the tensor

    @property
    def is_attention(self) -> bool:
        return self.field is not None

    @property
    def attention(self) -> str | None:
        """``self_attn``, ``cross_attn.1``, ...: the attention this field belongs to."""
        if self.field is None:
            return None
        return f"{self.role}_attn" + ("" if self.index is None else f".{self.index}")

    @property
    def layout(self) -> tuple[str, ...]:
        """The axis names of the tensor stored under this name."""
        if self.field is None:
            return NORM_LAYOUT if self.norm else RESIDUAL_LAYOUT
        if self.field.startswith("stat."):
            return STAT_LAYOUT
        return ATTN_FIELDS[self.field]


def is_stack_name(stack: str) -> bool:
    """Whether ``stack`` can name a stack in a key (``encoder``, ``decoder`` or a module path)."""
    return isinstance(stack, str) and _STACK_RE.match(stack) is not None


def attention_name(role: str, field: str = "pattern", index: int | None = None) -> str:
    """The key name of ``field`` of attention ``index`` of ``role``.

    ``attention_name("self")`` is ``self_attn.pattern``; ``attention_name("cross", "sink", 1)``
    is ``cross_attn.1.sink``.
    """
    if role not in ROLES:
        raise ValueError(f"unknown attention role {role!r}; expected one of {ROLES}")
    mid = "" if index is None else f".{int(index)}"
    name = f"{role}_attn{mid}.{field}"
    parse_name(name)
    return name


def parse_name(name: str) -> Name:
    """Parse a key name (the part after ``.blocks.<i>.``); raises ValueError for an unknown one."""
    if not isinstance(name, str) or _KEY_RE.match(f"s.blocks.0.{name}") is None:
        raise ValueError(f"not a probe cache key name: {name!r}")
    m = _ATTN_RE.match(name)
    if m is not None and not name.endswith((".delta", ".delta.norm")):
        n = m["n"]
        return Name(name, m["role"], None if n is None else int(n), m["field"])
    norm = name.endswith(".norm")
    base = name[: -len(".norm")] if norm else name
    role = base.split("_attn", 1)[0] if base.endswith("_attn.delta") else None
    return Name(name, role, None, None, norm)


def key(stack: str, layer: int, name: str) -> str:
    """The cache key of ``name`` in layer ``layer`` of ``stack``, e.g. ``decoder.blocks.0.resid_pre``."""
    if not is_stack_name(stack):
        raise ValueError(f"unknown stack {stack!r}; expected encoder, decoder or a module path")
    if int(layer) < 0:
        raise ProbeError(f"layer {layer} is negative; layers count from 0")
    k = f"{stack}.blocks.{int(layer)}.{name}"
    m = _KEY_RE.match(k)
    if m is None or m["stack"] != stack:
        raise ValueError(f"unknown key name {name!r}; expected one of {KEY_NAMES} or an attention field")
    return k


def parse_key(k: str) -> tuple[str, int, str]:
    """Split a cache key into ``(stack, layer, name)``; raises ValueError for a non-probe key."""
    m = _KEY_RE.match(k) if isinstance(k, str) else None
    if m is None:
        raise ValueError(f"not a probe cache key: {k!r}")
    return m["stack"], int(m["layer"]), m["name"]


def real_token_flags(meta: dict, b: int, name: str = "special_tokens_mask", prefix: str = "") -> list[int]:
    """``meta[prefix + name][b]`` (e.g. the special-token mask) with one entry per *real* token of text ``b``.

    Caches pad these rows like ``attention_mask`` (left or right); older caches stored them
    unpadded. Either way this returns the entries of the text's own tokens, in order.
    """
    rows = meta.get(f"{prefix}{name}") or []
    row = list(rows[b]) if b < len(rows) else []
    mask_rows = meta.get(f"{prefix}attention_mask") or []
    mask = list(mask_rows[b]) if b < len(mask_rows) else []
    if mask and len(row) == len(mask) and not all(mask):
        row = [v for v, m in zip(row, mask, strict=True) if m]
    return row


def token_side(meta: dict, stack: str) -> str | None:
    """Which token list the positions of ``stack`` are: ``"source"`` (``tokens``), ``"target"``
    (``target_tokens``) or None (positions that are not tokens: pooled, patches, latents).

    Read from ``meta["stacks"][stack]["tokens"]`` when the writer recorded it; otherwise the
    version 1 rule: the decoder of an encoder-decoder reads the target, every other stack the source.
    """
    info = (meta.get("stacks") or {}).get(stack)
    if isinstance(info, dict) and "tokens" in info:
        side = info["tokens"]
        return side if side in ("source", "target") else None
    return "target" if stack == "decoder" and meta.get("target_tokens") is not None else "source"
