"""Streaming per-head statistics over one cache or many: the accumulator, roles and HeadStats."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from probe.analysis.focus.definitions.reach import received
from probe.analysis.focus.definitions.roles import ROLE_RULES, SINK_EPSILON, roles_of
from probe.analysis.focus.definitions.running import RunningStats
from probe.analysis.focus.definitions.terms import METRICS, Layout, block_metrics, is_causal
from probe.analysis.focus.definitions.tokens import side
from probe.analysis.focus.result import HeadStats
from probe.cache import Cache, load
from probe.errors import ProbeError

# A layer is causal when no head of it puts any weight above the diagonal (between real tokens).
# Self-attention heads are read in blocks of about a quarter of a layer, so the sort behind the
# effective span (values + int64 indices) keeps peak memory near one layer of patterns.
HEAD_BLOCKS = 4


def _kv_group(meta: dict[str, Any]) -> int | None:
    """Query heads per key/value head from the recorded model config (grouped-query attention)."""
    cfg = (meta.get("model") or {}).get("config") or {}
    n_kv = cfg.get("num_key_value_heads")
    n_q = cfg.get("num_attention_heads") or cfg.get("n_head")
    if not isinstance(n_kv, int) or not isinstance(n_q, int) or n_kv <= 0 or n_kv >= n_q:
        return None
    if n_q % n_kv:
        raise ProbeError(f"model config has {n_q} heads but {n_kv} key/value heads (not a divisor)")
    return n_q // n_kv


def _numbered(cache: Cache) -> list[str]:
    """The attentions numbered within their layer (several of one kind: ``self_attn.0``, ...)."""
    out = []
    for s in cache.stacks:
        for i in cache.layer_indices(s):
            out += [f"{s}.blocks.{i}.{k}_attn.{n}" for k, n in cache.attentions(s, i) if n is not None]
    return out


class FocusAccumulator:
    """Per-head statistics accumulated cache by cache (one pattern block in memory at a time).

    ``add(cache)`` folds in every text of a cache; ``merge(other)`` combines accumulators exactly
    (shards, ranks); ``to_dict``/``from_dict`` round-trip through JSON; ``result()`` is the
    :class:`HeadStats`.
    """

    def __init__(self) -> None:
        self.stats: dict[str, RunningStats] = {}
        self.heads: dict[str, list[int]] = {}
        self.causal: dict[str, bool] = {}
        self.kv_group: int | None = None
        self.n_texts = 0
        self.rollout: dict[str, torch.Tensor] | None = None
        self.kept: dict | None = None  # a rows cache's keep (statistics over its kept rows)
        # statistics not computed, with the reason (a statistic needing whole patterns)
        self.not_computed: dict[str, str] = {}
        # the sink profile per layer, [B, H, K] (single cache or model run: positions are per batch)
        self.received: dict[str, torch.Tensor] | None = None

    def add(self, cache: Cache, *, rollout: bool = False, progress: bool = False) -> FocusAccumulator:
        """Fold every text of ``cache`` in; with ``rollout`` keep its attention rollout too."""
        meta = cache.metadata
        self.kv_group = _kv_group(meta) or self.kv_group
        if cache.kept == "stats":  # statistics computed while the model ran
            from probe.analysis.focus.streamed.keepstats import add_stats

            if self.kept is not None:
                raise ProbeError(
                    "cannot combine statistics over every query (a keep='stats' cache) with statistics "
                    "over kept query rows; compute them apart"
                )
            add_stats(self, cache)
            return self
        if cache.partial or self.kept is not None:  # kept rows: the per-row metrics over them
            from probe.analysis.focus.whole.kept import add_rows

            add_rows(self, cache)
            return self
        captured = meta.get("heads_captured")
        layers = [
            (s, i, kind)
            for s in cache.stacks
            for i in cache.layer_indices(s)  # the layers it holds: some, with capture(layers=)
            for kind in ("self", "cross")
            if f"{s}.blocks.{i}.{kind}_attn.pattern" in cache
        ]
        several = _numbered(cache)
        if not layers and several:
            raise ProbeError(
                f"head_stats reads one attention of a kind per layer, and this cache's layers hold several "
                f"({', '.join(several[:2])}{', ...' if len(several) > 2 else ''}: Swin's blocks in a stage, "
                "two attention sublayers); read them with cache.pattern(stack, layer, index=i)"
            )
        if not layers:
            raise ProbeError("the cache holds no attention patterns; capture without dropping them")
        if several:
            self.not_computed["several attentions per layer"] = (
                f"not read: {', '.join(several)} (head_stats reads one attention of a kind per layer; "
                "read them with cache.pattern(stack, layer, index=i))"
            )
        roll: dict[str, torch.Tensor] = {}
        roll_causal: dict[str, bool] = {}
        layouts: dict[tuple, Layout] = {}
        sides: dict[tuple, object] = {}
        all_heads = rollout and captured is None
        batch = None
        got: dict[str, torch.Tensor] = {}
        for stack, layer, kind in tqdm(
            layers, desc="head stats", unit="layer", disable=not progress, leave=False
        ):
            k = f"{stack}.blocks.{layer}.{kind}_attn.pattern"
            B, H, Q, K = cache.shape(k)
            batch = B
            qs = sides.get((stack, "own", B, Q)) or side(meta, stack, "own", B, Q)
            ks_role = "own" if kind == "self" else "source"
            ks = sides.get((stack, ks_role, B, K)) or side(meta, stack, ks_role, B, K)
            sides[(stack, "own", B, Q)], sides[(stack, ks_role, B, K)] = qs, ks
            want_sum = all_heads and kind == "self" and Q == K
            values, causal, head_sum, recv = _layer_values(
                cache, stack, layer, kind, qs, ks, layouts, want_sum
            )
            name = f"{stack}/{layer}/{kind}"
            got[name] = recv
            self.stats.setdefault(name, RunningStats()).update(values)
            heads = [int(captured[h]) if captured else h for h in range(H)]
            if self.heads.setdefault(name, heads) != heads:
                raise ProbeError(f"{name}: caches captured different heads ({self.heads[name]} vs {heads})")
            self.causal[name] = self.causal.get(name, True) and causal
            if head_sum is not None:
                # every layer so far lower-triangular (is_causal ignores padding: dense if any)
                tri = roll_causal.get(stack, True) and causal and bool(qs.real.all())
                roll_causal[stack] = tri
                roll[stack] = _rollout_step(roll.get(stack), head_sum / H, qs.real, lower=tri)
        # per batch positions: kept for the first cache only (merged runs have none)
        self.received = got if self.n_texts == 0 else None
        self.n_texts += batch or 0
        if rollout and self.rollout is None:
            self.rollout = roll
        return self

    def merge(self, other: FocusAccumulator) -> FocusAccumulator:
        """Add ``other``'s texts (exact merge of counts, means and M2); returns self."""
        if self.kept != other.kept and self.stats and other.stats:
            raise ProbeError(f"cannot merge statistics over kept rows {self.kept} with {other.kept}")
        self.kept = self.kept or other.kept
        for name, st in other.stats.items():
            if name in self.heads and self.heads[name] != other.heads[name]:
                raise ProbeError(f"{name}: cannot merge statistics of different heads")
            self.stats.setdefault(name, RunningStats()).merge(st)
            self.heads[name] = other.heads[name]
            self.causal[name] = self.causal.get(name, True) and other.causal[name]
        self.kv_group = self.kv_group or other.kv_group
        self.n_texts += other.n_texts
        self.rollout = None  # rollout is per text: it belongs to a single cache
        self.received = None  # so is the sink profile
        return self

    def to_dict(self) -> dict[str, Any]:
        """Everything needed to resume or merge: JSON-ready."""
        return {
            "metrics": list(METRICS),
            "n_texts": self.n_texts,
            "kv_group": self.kv_group,
            "layers": {
                name: {"heads": self.heads[name], "causal": self.causal[name], "stats": st.to_dict()}
                for name, st in self.stats.items()
            },
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FocusAccumulator:
        """The accumulator :meth:`to_dict` described."""
        if list(d.get("metrics", [])) != list(METRICS):
            raise ProbeError("these head statistics were written by another probe version; recompute them")
        acc = cls()
        acc.n_texts = int(d["n_texts"])
        acc.kv_group = d.get("kv_group")
        for name, e in d["layers"].items():
            acc.stats[name] = RunningStats.from_dict(e["stats"])
            acc.heads[name] = list(e["heads"])
            acc.causal[name] = bool(e["causal"])
        return acc

    def result(self) -> HeadStats:
        """The :class:`HeadStats` of everything added so far."""
        return HeadStats(self)


def _layer_values(cache, stack, layer, kind, qs, ks, layouts, want_sum):
    """``([B, H, M] per-text metrics, causal, Σ_h pattern or None, [B, H, K] sink profile)`` of one
    layer, read a block of
    heads at a time. A layer is causal only if no block has weight above the diagonal; if a later
    block shows some, the earlier blocks are computed again as non-causal."""
    B, H, Q, K = cache.shape(f"{stack}.blocks.{layer}.{kind}_attn.pattern")
    step = max(1, math.ceil(H / HEAD_BLOCKS))
    blocks = [(h0, min(H, h0 + step)) for h0 in range(0, H, step)]

    def layout(c: bool) -> Layout:
        key = (stack, kind, B, Q, K, c)
        if key not in layouts:
            layouts[key] = Layout(qs, ks, Q, K, causal=c)
        return layouts[key]

    values, causal, head_sum, recv = [], None, None, []
    for n, (h0, h1) in enumerate(blocks):
        # a cache kept on a GPU is reduced on the CPU, a block of heads at a time (the layouts live there)
        P = cache.pattern(stack, layer, kind, head=slice(h0, h1)).cpu()
        c = kind == "self" and is_causal(P, qs, ks)
        if causal and not c:
            values, recv = [], []
            for a, b in blocks[:n]:
                Pa = cache.pattern(stack, layer, kind, head=slice(a, b)).cpu()
                values.append(block_metrics(Pa, layout(False), self_attn=True))
                recv.append(_received(Pa, layout(False)))
        causal = c if causal is None else causal and c
        values.append(block_metrics(P, layout(causal), self_attn=kind == "self"))
        recv.append(_received(P, layout(causal)))
        if want_sum:
            s = P.float().sum(1)
            head_sum = s if head_sum is None else head_sum + s
        del P
    return torch.cat(values, 1), bool(causal), head_sum, torch.cat(recv, 1)


def _received(P: torch.Tensor, lay: Layout) -> torch.Tensor:
    """The sink profile ``[B, h, K]`` of a block of heads (padding keys get no weight)."""
    P = P.float()
    if lay.any_pad:
        P = torch.where(lay.k.real[:, None, None, :], P, 0)
    return received(P, lay.counted)


def _rollout_step(
    R: torch.Tensor | None, W: torch.Tensor, real: torch.Tensor, *, lower: bool
) -> torch.Tensor:
    """One layer of attention rollout: R ← (0.5·W + 0.5·I) R, padding rows kept as identity.
    ``lower``: W and R are lower-triangular (causal layers), so the product is too."""
    B, T, _ = W.shape
    eye = torch.eye(T).expand(B, T, T)
    A = torch.where(real[:, :, None], 0.5 * W + 0.5 * eye, eye)
    if R is None:
        return A
    return _lower_matmul(A, R) if lower else A @ R


def _lower_matmul(A: torch.Tensor, R: torch.Tensor, leaf: int = 256) -> torch.Tensor:
    """``A @ R`` for lower-triangular ``A`` and ``R`` (``[B, T, T]``), skipping the zero blocks:
    with A = [[A11, 0], [A21, A22]] and R likewise, the product is [[A11 R11, 0], [A21 R11 + A22 R21,
    A22 R22]], recursively (about a third of the dense product's multiplications)."""
    T = A.shape[-1]
    if T <= leaf:
        return A @ R
    m = T // 2
    out = A.new_zeros(A.shape)
    R11 = R[..., :m, :m]
    out[..., :m, :m] = _lower_matmul(A[..., :m, :m], R11, leaf)
    out[..., m:, :m] = A[..., m:, :m] @ R11 + A[..., m:, m:] @ R[..., m:, :m]
    out[..., m:, m:] = _lower_matmul(A[..., m:, m:], R[..., m:, m:], leaf)
    return out


def _as_caches(obj: Any) -> tuple[Iterable[Cache], int | None]:
    if isinstance(obj, (Cache, str, os.PathLike)):
        obj = [obj]
    try:
        n = len(obj)
    except TypeError:
        n = None

    def gen():
        for c in obj:
            if isinstance(c, (str, os.PathLike)):
                c = load(Path(c))
            if not isinstance(c, Cache):
                raise ProbeError(f"head_stats reads probe caches (or their paths), not {type(c).__name__}")
            yield c

    return gen(), n


def head_stats(
    cache_or_caches: Any,
    inputs: Any = None,
    *,
    rollout: bool = True,
    progress: bool = True,
    tokenizer: Any = None,
    target: Any = None,
    layers: list[int] | None = None,
    block: int | None = None,
    processor: Any = None,
    text: Any = None,
    sampling_rate: int | None = None,
) -> HeadStats:
    """Focus statistics of every captured head (see :mod:`probe.analysis.focus` for definitions).

    ``cache_or_caches``: a :class:`probe.Cache`, a cache path, or an iterable of them (a list,
    or a generator that captures text after text: only one cache is held at a time). Returns
    :class:`HeadStats`; with several texts each metric is the mean over texts with ``_std``.

    Or a model with its ``inputs`` (``tokenizer``, ``target``, ``layers``, and pictures or sound
    with ``processor``, ``text``, ``sampling_rate``, as for :func:`probe.capture`): one forward,
    every statistic computed ``block`` query rows at a time
    while it runs, no pattern ever held whole (:mod:`probe.analysis.focus.streamed.reader`); the same
    table as for the captured cache, without the rollout (``HeadStats.not_computed``).
    ``progress``: a bar (over caches, or over the attentions a model's forward reads).
    """
    if isinstance(cache_or_caches, torch.nn.Module):
        from probe.analysis.focus.streamed.run import model_head_stats

        if inputs is None:
            raise ProbeError("head_stats(model, inputs): give the inputs to run the model on")
        return model_head_stats(
            cache_or_caches,
            inputs,
            tokenizer=tokenizer,
            target=target,
            layers=layers,
            block=block,
            progress=progress,
            processor=processor,
            text=text,
            sampling_rate=sampling_rate,
        )
    if processor is not None or text is not None or sampling_rate is not None:
        raise ProbeError("processor=, text= and sampling_rate= are for a model's inputs, not a cache")
    if inputs is not None:
        raise ProbeError("head_stats(cache) takes no inputs; pass a model to run it on inputs")
    caches, n = _as_caches(cache_or_caches)
    acc = FocusAccumulator()
    single = n == 1
    it = caches if single else tqdm(caches, total=n, desc="head stats", unit="cache", disable=not progress)
    for c in it:
        acc.add(c, rollout=rollout and single, progress=progress and single)
    if acc.n_texts == 0:
        raise ProbeError("no caches given; pass a probe.Cache, a path, or a list of them")
    return acc.result()


__all__ = ["HeadStats", "FocusAccumulator", "head_stats", "roles_of", "ROLE_RULES", "SINK_EPSILON"]
