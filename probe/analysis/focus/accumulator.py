"""The per-head statistics accumulated cache by cache, run by run: :class:`FocusAccumulator`.

Every path that computes the statistics fills one through its methods (:meth:`~FocusAccumulator.fold`
one attention's per-text values, :meth:`~FocusAccumulator.add_texts`,
:meth:`~FocusAccumulator.leave_out`, ...): the whole patterns of a cache
(:mod:`probe.analysis.focus.whole.read`), a rows cache's kept rows
(:mod:`probe.analysis.focus.whole.kept`), a ``keep="stats"`` cache and a model run
(:mod:`probe.analysis.focus.streamed`). :meth:`~FocusAccumulator.result` is the
:class:`~probe.analysis.focus.result.HeadStats` table.
"""

from __future__ import annotations

from typing import Any

import torch

from probe.analysis.focus.definitions.running import RunningStats
from probe.analysis.focus.definitions.table import METRICS
from probe.analysis.focus.result import HeadStats
from probe.analysis.focus.streamed.keepstats import CONTRIB, add_stats
from probe.analysis.focus.streamed.keepstats import holds_contributions as holds_contrib_stats
from probe.analysis.focus.whole.kept import add_rows
from probe.analysis.focus.whole.read import add_patterns, holds_contributions
from probe.errors import ProbeError

NO_CONTRIB = "contributions"
NO_CONTRIB_WHY = (
    "not every cache added holds contributions (probe.contributions captures them): the statistics by "
    "contribution are left out"
)


def kv_group(meta: dict[str, Any]) -> int | None:
    """Query heads per key/value head from the recorded model config (grouped-query attention)."""
    cfg = (meta.get("model") or {}).get("config") or {}
    n_kv = cfg.get("num_key_value_heads")
    n_q = cfg.get("num_attention_heads") or cfg.get("n_head")
    if not isinstance(n_kv, int) or not isinstance(n_q, int) or n_kv <= 0 or n_kv >= n_q:
        return None
    if n_q % n_kv:
        raise ProbeError(f"model config has {n_q} heads but {n_kv} key/value heads (not a divisor)")
    return n_q // n_kv


class FocusAccumulator:
    """Per-head statistics accumulated cache by cache (one pattern block in memory at a time).

    ``add(cache)`` folds in every text of a cache; ``merge(other)`` combines accumulators exactly
    (shards, ranks); ``to_dict``/``from_dict`` round-trip through JSON; ``result()`` is the
    :class:`HeadStats`. ``by_contribution``: the same statistics over the caches' patterns by
    contribution (rows renormalised to sum 1), another accumulator, while every cache added holds
    them (``probe.contributions``), else None.
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
        self.by_contribution: FocusAccumulator | None = None

    def add(self, cache: Any, *, rollout: bool = False, progress: bool = False) -> FocusAccumulator:
        """Fold every text of ``cache`` in; with ``rollout`` keep its attention rollout too."""
        self.note_model(cache.metadata)
        first = self.n_texts == 0
        if cache.kept == "stats":  # statistics computed while the model ran
            if self.kept is not None:
                raise ProbeError(
                    "cannot combine statistics over every query (a keep='stats' cache) with statistics "
                    "over kept query rows; compute them apart"
                )
            add_stats(self, cache)
            self._contributions(cache, holds_contrib_stats(cache), first, stats=True)
            return self
        if cache.partial or self.kept is not None:  # kept rows: the per-row metrics over them
            add_rows(self, cache)
            self._contributions(cache, False, first)
            return self
        add_patterns(self, cache, rollout=rollout, progress=progress)
        self._contributions(cache, holds_contributions(cache), first)
        return self

    def _contributions(self, cache: Any, holds: bool, first: bool, stats: bool = False) -> None:
        """Fold ``cache``'s statistics by contribution into :attr:`by_contribution` while every
        cache so far held them (``first``: the first cache added, which decides)."""
        if holds and (first or self.by_contribution is not None):
            sub = self.by_contribution or FocusAccumulator()
            sub.note_model(cache.metadata)
            if stats:
                add_stats(sub, cache, prefix=CONTRIB)
            else:
                add_patterns(sub, cache, by="contribution")
            self.by_contribution = sub
        elif self.by_contribution is not None or (holds and not first):
            self.by_contribution = None
            self.leave_out({NO_CONTRIB: NO_CONTRIB_WHY})

    # -- what each path fills it through --------------------------------------------------------
    def fold(
        self, name: str, values: torch.Tensor, heads: list[int], causal: bool, *, same_heads: bool = True
    ) -> None:
        """Add one attention's per-text metrics ``values`` ``[B, H, M]`` under ``name``
        (``"stack/layer/kind"``), the model's index of each of its ``H`` heads and whether it was
        causal (it stays causal only while every batch is). ``same_heads``: refuse heads that differ
        from the earlier batches' (off: the first batch's are kept)."""
        self.stats.setdefault(name, RunningStats()).update(values)
        if self.heads.setdefault(name, heads) != heads and same_heads:
            raise ProbeError(f"{name}: caches captured different heads ({self.heads[name]} vs {heads})")
        self.causal[name] = self.causal.get(name, True) and causal

    def add_texts(self, n: int, received: dict[str, torch.Tensor] | None = None) -> None:
        """Count ``n`` more texts; ``received``: their sink profile per attention, kept only while
        these are the first texts (positions are per batch: merged batches have none)."""
        self.received = received if self.n_texts == 0 else None
        self.n_texts += n

    def leave_out(self, reasons: dict[str, str]) -> None:
        """Statistics not computed, each with the reason (``HeadStats.not_computed``)."""
        self.not_computed.update(reasons)

    def keep_rows(self, kept: dict) -> None:
        """The statistics are over the kept query rows of a rows cache (its ``keep``)."""
        self.kept = kept

    def keep_rollout(self, rollout: dict[str, torch.Tensor]) -> None:
        """Each stack's attention rollout, where none is kept yet (it belongs to one cache)."""
        if self.rollout is None:
            self.rollout = rollout

    def note_model(self, meta: dict[str, Any]) -> None:
        """What the capture's metadata says of the model: its key/value head groups."""
        self.kv_group = kv_group(meta) or self.kv_group

    # -- combining and storing ------------------------------------------------------------------
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
        if self.by_contribution is not None and other.by_contribution is not None:
            self.by_contribution.merge(other.by_contribution)
        elif self.by_contribution is not None or other.by_contribution is not None:
            self.by_contribution = None
            self.leave_out({NO_CONTRIB: NO_CONTRIB_WHY})
        self.n_texts += other.n_texts
        self.rollout = None  # rollout is per text: it belongs to a single cache
        self.received = None  # so is the sink profile
        return self

    def to_dict(self) -> dict[str, Any]:
        """Everything needed to resume or merge: JSON-ready."""
        extra = {"by_contribution": self.by_contribution.to_dict()} if self.by_contribution else {}
        return extra | {
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
        if d.get("by_contribution"):
            acc.by_contribution = cls.from_dict(d["by_contribution"])
        return acc

    def result(self) -> HeadStats:
        """The :class:`HeadStats` of everything added so far."""
        return HeadStats(self)


__all__ = ["FocusAccumulator", "kv_group"]
