"""Streaming per-head statistics over one cache or many: the accumulator, roles and HeadStats."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from probe.analysis.focus.metrics import METRICS, Layout, block_metrics, is_causal
from probe.analysis.focus.running import RunningStats
from probe.analysis.focus.tokens import side
from probe.analysis.table import Table
from probe.cache import Cache, load
from probe.errors import ProbeError

SINK_EPSILON = 0.3  # Gu et al. 2024: a head is a sink head when its first-token mass exceeds this
# Roles, in priority order: a head gets the first role whose rule holds (all holding rules are
# listed in the ``roles`` column). Thresholds apply to the mean over texts.
ROLE_RULES: tuple[tuple[str, str, float], ...] = (
    ("induction", "induction_prefix", 0.4),
    ("duplicate-token", "dup_prefix", 0.4),
    ("previous-token", "prev", 0.5),
    ("next-token", "next", 0.5),
    ("self", "self", 0.5),
    ("broad/uniform", "norm_entropy", 0.9),
    ("sink", "first", SINK_EPSILON),
    ("positional", "pos_frac", 0.9),
    ("local", "local", 0.7),
)
# A layer is causal when no head of it puts any weight above the diagonal (between real tokens).
# Self-attention heads are read in blocks of about a quarter of a layer, so the sort behind the
# effective span (values + int64 indices) keeps peak memory near one layer of patterns.
HEAD_BLOCKS = 4


# A template role needs this many matching queries in all (one repeated token is not evidence).
MIN_MATCHES = 5


def roles_of(values: dict[str, float]) -> list[str]:
    """Every role whose rule holds for a row of mean metric values, in priority order."""
    out = []
    for role, metric, threshold in ROLE_RULES:
        if role in ("induction", "duplicate-token"):
            matches = values.get(metric.replace("prefix", "matches"), 0)
            if not matches >= MIN_MATCHES:
                continue
        v = values.get(metric)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        if (v > threshold) if role == "sink" else (v >= threshold):
            out.append(role)
    return out


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

    def add(self, cache: Cache, *, rollout: bool = False, progress: bool = False) -> FocusAccumulator:
        """Fold every text of ``cache`` in; with ``rollout`` keep its attention rollout too."""
        meta = cache.metadata
        self.kv_group = _kv_group(meta) or self.kv_group
        captured = meta.get("heads_captured")
        layers = [
            (s, i, kind)
            for s in cache.stacks
            for i in range(cache.n_layers(s))
            for kind in ("self", "cross")
            if f"{s}.blocks.{i}.{kind}_attn.pattern" in cache
        ]
        if not layers:
            raise ProbeError("the cache holds no attention patterns; capture without dropping them")
        roll: dict[str, torch.Tensor] = {}
        layouts: dict[tuple, Layout] = {}
        sides: dict[tuple, object] = {}
        all_heads = rollout and captured is None
        batch = None
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
            values, causal, head_sum = _layer_values(cache, stack, layer, kind, qs, ks, layouts, want_sum)
            name = f"{stack}/{layer}/{kind}"
            self.stats.setdefault(name, RunningStats()).update(values)
            heads = [int(captured[h]) if captured else h for h in range(H)]
            if self.heads.setdefault(name, heads) != heads:
                raise ProbeError(f"{name}: caches captured different heads ({self.heads[name]} vs {heads})")
            self.causal[name] = self.causal.get(name, True) and causal
            if head_sum is not None:
                roll[stack] = _rollout_step(roll.get(stack), head_sum / H, qs.real)
        self.n_texts += batch or 0
        if rollout and self.rollout is None:
            self.rollout = roll
        return self

    def merge(self, other: FocusAccumulator) -> FocusAccumulator:
        """Add ``other``'s texts (exact merge of counts, means and M2); returns self."""
        for name, st in other.stats.items():
            if name in self.heads and self.heads[name] != other.heads[name]:
                raise ProbeError(f"{name}: cannot merge statistics of different heads")
            self.stats.setdefault(name, RunningStats()).merge(st)
            self.heads[name] = other.heads[name]
            self.causal[name] = self.causal.get(name, True) and other.causal[name]
        self.kv_group = self.kv_group or other.kv_group
        self.n_texts += other.n_texts
        self.rollout = None  # rollout is per text: it belongs to a single cache
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
    """``([B, H, M] per-text metrics, causal, Σ_h pattern or None)`` of one layer, read a block of
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

    values, causal, head_sum = [], None, None
    for n, (h0, h1) in enumerate(blocks):
        P = cache.pattern(stack, layer, kind, head=slice(h0, h1))
        c = kind == "self" and is_causal(P, qs, ks)
        if causal and not c:
            values = [
                block_metrics(
                    cache.pattern(stack, layer, kind, head=slice(a, b)), layout(False), self_attn=True
                )
                for a, b in blocks[:n]
            ]
        causal = c if causal is None else causal and c
        values.append(block_metrics(P, layout(causal), self_attn=kind == "self"))
        if want_sum:
            s = P.float().sum(1)
            head_sum = s if head_sum is None else head_sum + s
        del P
    return torch.cat(values, 1), bool(causal), head_sum


def _rollout_step(R: torch.Tensor | None, W: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """One layer of attention rollout: R ← (0.5·W + 0.5·I) R, padding rows kept as identity."""
    B, T, _ = W.shape
    eye = torch.eye(T).expand(B, T, T)
    A = torch.where(real[:, :, None], 0.5 * W + 0.5 * eye, eye)
    return A if R is None else A @ R


def _std_name(m: str) -> str:
    return f"{m}_std"


class HeadStats:
    """Focus statistics per (stack, layer, head, kind): mean over texts (and ``<metric>_std``,
    the sample standard deviation across texts, when there are several texts).

    ``table`` is a :class:`~probe.analysis.table.Table`; ``sink_rate`` maps ``"stack/kind"`` to
    the share of heads whose first-token mass exceeds ε = 0.3; ``kv_groups`` maps each key/value
    head to the query heads sharing it (grouped-query models, else empty); ``rollout`` maps each
    stack to its attention rollout ``[batch, T, T]`` through all layers (single cache only).
    """

    def __init__(self, acc: FocusAccumulator) -> None:
        self.accumulator = acc
        self.n_texts = acc.n_texts
        self.rollout = acc.rollout
        rows = []
        several = any(int(st.count.max()) > 1 for st in acc.stats.values())
        for name, st in acc.stats.items():
            stack, layer, kind = name.split("/")
            mean, std, count = st.mean, st.std, st.count
            for h, head in enumerate(acc.heads[name]):
                row: dict[str, Any] = {
                    "stack": stack,
                    "layer": int(layer),
                    "head": head,
                    "kind": kind,
                    "kv_head": head // acc.kv_group if acc.kv_group else None,
                    "causal": acc.causal[name],
                    "n_texts": int(count[h].max()),
                }
                vals = {m: float(mean[h, i]) for i, m in enumerate(METRICS)}
                for m in ("dup_matches", "induction_matches"):  # totals over texts, not means
                    i = METRICS.index(m)
                    vals[m] = (
                        float(round(float(mean[h, i]) * float(count[h, i])))
                        if count[h, i] > 0
                        else float("nan")
                    )
                rs = roles_of(vals)
                row["role"] = rs[0] if rs else "none"
                row["roles"] = ",".join(rs)
                row.update(vals)
                if several:
                    row.update({_std_name(m): float(std[h, i]) for i, m in enumerate(METRICS)})
                rows.append(row)
        columns = ["stack", "layer", "head", "kind", "kv_head", "causal", "n_texts", "role", "roles"]
        columns += list(METRICS) + ([_std_name(m) for m in METRICS] if several else [])
        self.table = Table(rows, columns, title=f"head statistics ({self.n_texts} texts)")
        self.sink_rate: dict[str, float] = {}
        for key in sorted({f"{r['stack']}/{r['kind']}" for r in rows}):
            fs = [
                r["first"] for r in rows if f"{r['stack']}/{r['kind']}" == key and not math.isnan(r["first"])
            ]
            self.sink_rate[key] = sum(f > SINK_EPSILON for f in fs) / len(fs) if fs else float("nan")
        self.kv_groups: dict[int, list[int]] = {}
        if acc.kv_group:
            for h in sorted({r["head"] for r in rows}):
                self.kv_groups.setdefault(h // acc.kv_group, []).append(h)

    # -- views ---------------------------------------------------------------------------------
    def map(self, metric: str, stack: str | None = None, kind: str = "self") -> torch.Tensor:
        """``[layers, heads]`` of one metric's mean (NaN where a head was not captured)."""
        if metric not in METRICS:
            raise ProbeError(f"no metric {metric!r}; choose one of: {', '.join(METRICS)}")
        rows = [r for r in self.table if r["kind"] == kind and (stack is None or r["stack"] == stack)]
        if stack is None and rows:
            rows = [r for r in rows if r["stack"] == rows[-1]["stack"]]
        if not rows:
            raise ProbeError(
                f"no {kind}-attention heads{' in ' + stack if stack else ''} in these statistics"
            )
        L = max(r["layer"] for r in rows) + 1
        H = max(r["head"] for r in rows) + 1
        out = torch.full((L, H), float("nan"))
        for r in rows:
            out[r["layer"], r["head"]] = r[metric]
        return out

    def top(self, metric: str, k: int = 10, descending: bool = True) -> Table:
        """The ``k`` heads with the largest (or smallest) mean ``metric``."""
        return self.table.top(metric, k, descending)

    # -- exports -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Rows, sink rates, key/value groups and the role thresholds: plain Python."""
        d = self.table.to_dict()
        d.update(
            {
                "n_texts": self.n_texts,
                "sink_rate": dict(self.sink_rate),
                "sink_epsilon": SINK_EPSILON,
                "kv_groups": {str(k): v for k, v in self.kv_groups.items()},
                "role_rules": [list(r) for r in ROLE_RULES],
            }
        )
        return d

    def to_json(self, path: str | os.PathLike | None = None, **kw: Any) -> str:
        """JSON of :meth:`to_dict` (NaN as null); also written atomically to ``path`` if given."""
        d = self.to_dict()
        d["rows"] = json.loads(self.table.to_json())["rows"]
        d["sink_rate"] = {k: (None if math.isnan(v) else v) for k, v in d["sink_rate"].items()}
        text = json.dumps(d, ensure_ascii=False, **kw)
        if path is not None:
            from probe.files import write_text_atomic

            write_text_atomic(path, text)
        return text

    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """CSV of the table (one row per head); also written atomically to ``path`` if given."""
        return self.table.to_csv(path)

    def to_pandas(self):
        """The table as a ``pandas.DataFrame`` (pandas is optional)."""
        return self.table.to_pandas()

    def summary(self) -> str:
        """One line per stack/kind: sink rate and how many heads hold each role."""
        lines = []
        for key, rate in self.sink_rate.items():
            stack, kind = key.split("/")
            rows = [r for r in self.table if r["stack"] == stack and r["kind"] == kind]
            counts: dict[str, int] = {}
            for r in rows:
                counts[r["role"]] = counts.get(r["role"], 0) + 1
            roles = ", ".join(f"{n} {role}" for role, n in sorted(counts.items(), key=lambda x: -x[1]))
            lines.append(f"{stack} {kind}-attention: {len(rows)} heads; sink rate {rate:.2f}; roles: {roles}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary() + "\n" + self.table.to_text()

    def __repr__(self) -> str:
        return f"<HeadStats {len(self.table)} heads, {self.n_texts} texts>"

    def _repr_html_(self) -> str:
        import html

        head = "".join(f"<p>{html.escape(line)}</p>" for line in self.summary().splitlines())
        return head + self.table._repr_html_()


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


def head_stats(cache_or_caches: Any, *, rollout: bool = True, progress: bool = True) -> HeadStats:
    """Focus statistics of every captured head (see :mod:`probe.analysis.focus` for definitions).

    ``cache_or_caches``: a :class:`probe.Cache`, a cache path, or an iterable of them (a list,
    or a generator that captures text after text: only one cache is held at a time). Returns
    :class:`HeadStats`; with several texts each metric is the mean over texts with ``_std``.
    """
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
