"""Cross-attention of encoder-decoders: target tokens (queries) over source tokens (keys)."""

from __future__ import annotations

from probe.report.sections import attention

TITLE = "Cross-attention"
ORDER = 21


def build(ctx) -> dict | None:
    """Like the attention section, for the decoder's cross-attention; None for models without it."""
    return attention.build(ctx, kinds=("cross",), key="cross")
