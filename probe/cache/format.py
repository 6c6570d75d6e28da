"""The cache format: key names, metadata markers and the version.

A cache is one safetensors file. Tensor keys are ``<stack>.blocks.<i>.<name>``:

- ``stack``: ``encoder`` or ``decoder`` (decoder-only models use ``decoder``);
- ``i``: the layer index within that stack, from 0;
- ``name``: one of :data:`KEY_NAMES`. Patterns are ``[batch, head, query, key]``; residual
  tensors are ``[batch, pos, d_model]``.

The safetensors string metadata holds ``format`` (= :data:`FORMAT_MARKER`), ``format_version``
and ``probe`` (a JSON document: texts, tokens, ids, masks, model, attention implementations,
dtype, probe version).
"""

from __future__ import annotations

import re

FORMAT_MARKER = "probe-cache"
FORMAT_VERSION = 1
STACKS = ("encoder", "decoder")
PATTERN_NAMES = ("self_attn.pattern", "cross_attn.pattern")
RESIDUAL_NAMES = (
    "resid_pre",
    "self_attn.delta",
    "cross_attn.delta",
    "mlp.delta",
    "resid_post",
)
KEY_NAMES = PATTERN_NAMES + RESIDUAL_NAMES

_KEY_RE = re.compile(
    r"^(?P<stack>encoder|decoder)\.blocks\.(?P<layer>\d+)\.(?P<name>"
    + "|".join(re.escape(n) for n in KEY_NAMES)
    + r")$"
)


def key(stack: str, layer: int, name: str) -> str:
    """The cache key of ``name`` in layer ``layer`` of ``stack``, e.g. ``decoder.blocks.0.resid_pre``."""
    if stack not in STACKS:
        raise ValueError(f"unknown stack {stack!r}; expected one of {STACKS}")
    if name not in KEY_NAMES:
        raise ValueError(f"unknown key name {name!r}; expected one of {KEY_NAMES}")
    return f"{stack}.blocks.{int(layer)}.{name}"


def parse_key(k: str) -> tuple[str, int, str]:
    """Split a cache key into ``(stack, layer, name)``; raises ValueError for a non-probe key."""
    m = _KEY_RE.match(k)
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
