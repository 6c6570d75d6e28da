"""``probe.lookback``: what each generated token read, from a generation cache.

The lookback ratio is Chuang et al. (2024), "Lookback Lens: Detecting and Mitigating Contextual
Hallucinations in Large Language Models Using Only Attention Maps" (EMNLP 2024, Eq. 1): for the
query that writes generated token ``t`` (``t = 0..N-1``), in layer ``l`` and head ``h``,

    A_context = (1 / P) * sum of its weights on the P prompt positions
    A_new     = (1 / t) * sum of its weights on the t tokens generated before it
    LR        = A_context / (A_context + A_new)

A mean per position, so a long prompt does not win by its length alone. ``t = 0`` has no earlier
output and its ratio is NaN (their code takes the mean of an empty slice there too).
"""

from __future__ import annotations

from typing import Any

import torch

from probe.analysis.generation.cross import source_reads
from probe.analysis.generation.result import Lookback
from probe.analysis.generation.rows import check_kept, kept_steps, writer_rows
from probe.analysis.generation.steps import Steps, generation_meta, steps
from probe.errors import ProbeError

CELLS = 1 << 24  # float64 weights read at once: steps are taken in chunks of this many


def self_layers(cache: Any, stack: str, kind: str = "self") -> list[int]:
    """The layers of ``stack`` holding ``kind`` attention rows in whatever form the cache kept."""
    field = {"patterns": "pattern", "rows": "rows", "topk": "topk_values"}[check_kept(cache)]
    layers = cache.layer_indices(stack, f"{kind}_attn.{field}")
    if not layers and kind == "self":
        raise ProbeError(f"the {stack} stack of this cache holds no self-attention {field}")
    return layers


class _Acc:
    """Per-layer, per-head, per-step sums for one text (see :func:`lookback`)."""

    def __init__(self, n_layers: int, n_heads: int, st: Steps, top: int, image: bool):
        shape = (n_layers, n_heads, st.n_steps)
        nan = float("nan")
        self.prompt = torch.full(shape, nan, dtype=torch.float64)
        self.output = torch.full(shape, nan, dtype=torch.float64)
        self.sink = torch.full(shape, nan, dtype=torch.float64)
        self.image = torch.full(shape, nan, dtype=torch.float64) if image else None
        k = min(top, len(st.prompt))
        self.top_index = torch.full((*shape, k), -1, dtype=torch.long)
        self.top_weight = torch.full((*shape, k), nan, dtype=torch.float64)
        self.mean_index = torch.full((n_layers, st.n_steps, k), -1, dtype=torch.long)
        self.mean_weight = torch.full((n_layers, st.n_steps, k), nan, dtype=torch.float64)
        self.on_prompt = torch.zeros(
            st.n_steps, len(st.prompt), dtype=torch.float64
        )  # sum over layers of head means
        self.counted = torch.zeros(st.n_steps, dtype=torch.long)
        self.k = k


def _top(w: torch.Tensor, k: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest known weights of ``w [..., P]`` (NaN unknown) as (positions, weights);
    position -1 and weight NaN where fewer are known."""
    filled = torch.nan_to_num(w, nan=float("-inf"))
    vals, idx = filled.topk(k, dim=-1)
    known = torch.isfinite(vals)
    pos = torch.where(known, positions[idx], torch.full_like(idx, -1))
    return pos, torch.where(known, vals, torch.full_like(vals, float("nan")))


def _masked_sum(r: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``r [H, n, K]`` over the keys ``mask [n, K]`` (NaN where a needed weight is unknown)."""
    return torch.where(mask, r, torch.zeros((), dtype=r.dtype)).sum(-1)


def _layer(acc: _Acc, li: int, r: torch.Tensor, chunk: list[int], st: Steps, sink: int) -> None:
    """Fill layer ``li`` of ``acc`` for generated tokens ``chunk`` from their rows ``r [H, n, K]``
    (``H``: this layer's own heads; the rows of heads it does not have stay NaN)."""
    H, K = r.shape[0], r.shape[-1]
    n = len(chunk)
    t = torch.tensor(chunk)
    prompt = torch.tensor(st.prompt)
    gen = torch.tensor(st.generated, dtype=torch.long)
    pmask = torch.zeros(n, K, dtype=torch.bool)
    pmask[:, prompt] = True
    omask = torch.zeros(n, K, dtype=torch.bool)
    if len(gen):
        omask[:, gen] = torch.arange(len(gen))[None, :] < t[:, None]  # the t tokens written before
    smask = torch.zeros(n, K, dtype=torch.bool)
    smask[:, prompt[:sink]] = True
    acc.prompt[li, :H, t] = _masked_sum(r, pmask)
    acc.output[li, :H, t] = _masked_sum(r, omask)
    acc.sink[li, :H, t] = _masked_sum(r, smask)
    if acc.image is not None:
        imask = torch.zeros(n, K, dtype=torch.bool)
        imask[:, torch.tensor(st.image_positions(), dtype=torch.long)] = True
        acc.image[li, :H, t] = _masked_sum(r, imask)
    on_prompt = r[:, :, prompt]  # [H, n, P]
    acc.top_index[li, :H, t], acc.top_weight[li, :H, t] = _top(on_prompt, acc.k, prompt)
    mean = on_prompt.mean(0)  # [n, P]
    acc.mean_index[li, t], acc.mean_weight[li, t] = _top(mean, acc.k, prompt)
    known = ~mean.isnan().any(-1)
    acc.on_prompt[t[known]] += mean[known]
    acc.counted[t[known]] += 1


def lookback(
    cache: Any, *, batch: int = 0, top: int = 5, sink: int = 1, stack: str | None = None
) -> Lookback:
    """What each generated token of a generation cache read, per layer and head.

    For every generated token and head: the lookback ratio (Chuang et al. 2024, see the module
    docstring), the attention mass on the prompt and on the model's earlier output, on the first
    ``sink`` positions (the sink profile as the output grows) and, for a vision-language prompt,
    on its image tokens; and the ``top`` prompt tokens it read most, per head, per layer's head
    mean and over all layers and heads; for an encoder-decoder also the source tokens each read
    most through the cross-attention (``reads(..., source=True)``). ``batch`` picks the text,
    ``stack`` the stack that generated (default: the cache's ``metadata["generation"]["stack"]``).

    Whole patterns give every number. A ``keep={"rows": ...}`` cache gives them for the generated
    tokens whose writing row was kept (NaN elsewhere); a ``keep={"topk": k}`` cache gives the
    top prompt tokens (the kept keys are the largest) and, where the kept keys hold the whole row,
    the masses and ratio (NaN elsewhere); ``keep="stats"`` is refused. Returns a
    :class:`~probe.analysis.generation.result.Lookback`.
    """
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ProbeError(f"top must be a positive integer, not {top!r}")
    if isinstance(sink, bool) or not isinstance(sink, int) or sink < 1:
        raise ProbeError(f"sink must be a positive integer (how many first positions), not {sink!r}")
    generation_meta(cache)  # a plain capture is refused first, then keep='stats'
    check_kept(cache)
    st = steps(cache, batch, stack)
    layers = self_layers(cache, st.stack)
    layer_heads = [cache.shape(_first_key(cache, st.stack, layer))[1] for layer in layers]
    n_heads = max(layer_heads)  # layers may differ: a layer's missing heads stay NaN
    acc = _Acc(len(layers), n_heads, st, top, bool(st.image_positions()))
    missing: dict[int, int] = {}
    for li, layer in enumerate(layers):
        have = kept_steps(cache, st, layer)
        if len(have) < st.n_steps:
            missing[layer] = st.n_steps - len(have)
        size = max(1, CELLS // max(1, n_heads * st.length))
        whole = cache.pattern(st.stack, layer, batch=batch) if cache.kept == "patterns" else None
        for i in range(0, len(have), size):
            chunk = have[i : i + size]
            _layer(acc, li, writer_rows(cache, st, layer, "self", chunk, whole), chunk, st, sink)
    source = source_reads(cache, st, self_layers(cache, st.stack, "cross"), top)
    return Lookback(
        st,
        layers,
        n_heads,
        acc,
        sink=sink,
        kept=check_kept(cache),
        missing=missing,
        source=source,
        layer_heads=layer_heads,
    )


def _first_key(cache: Any, stack: str, layer: int) -> str:
    prefix = f"{stack}.blocks.{layer}.self_attn."
    for k in cache.keys():
        if k.startswith(prefix) and k.rsplit(".", 1)[-1] in ("pattern", "rows", "topk_values"):
            return k
    raise ProbeError(f"layer {layer} of the {stack} stack holds no self-attention")


__all__ = ["lookback", "self_layers"]
