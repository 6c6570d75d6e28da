""":class:`HeadStats`: the table of per-head statistics, its views and exports."""

from __future__ import annotations

import math
from typing import Any

import torch

from probe.analysis.focus.definitions.roles import roles_of
from probe.analysis.focus.definitions.table import METRICS, ROLE_RULES, SINK_EPSILON
from probe.analysis.focus.whole.kept import NOT_COMPUTED
from probe.analysis.table import Exports, Table
from probe.errors import ProbeError

_EVERY = "they need every query row"
# the metrics by contribution shown beside those by weight (<metric>_contrib columns); every one of
# them is in HeadStats.by_contribution
BESIDE = ("first", "distance")


def _std_name(m: str) -> str:
    return f"{m}_std"


class HeadStats(Exports):
    """Focus statistics per (stack, layer, head, kind): mean over texts (and ``<metric>_std``,
    the sample standard deviation across texts, when there are several texts).

    ``table`` is a :class:`~probe.analysis.table.Table`; ``sink_rate`` maps ``"stack/kind"`` to
    the share of heads whose first-token mass exceeds ε = 0.3; ``kv_groups`` maps each key/value
    head to the query heads sharing it (grouped-query models, else empty); ``rollout`` maps each
    stack to its attention rollout ``[batch, T, T]`` through all layers (single cache only);
    ``not_computed`` maps each statistic left out to the reason (``"rollout"`` when computed from a
    model block by block, which never holds a whole pattern); ``received`` maps
    ``"stack/layer/kind"`` to the sink profile ``[batch, heads, K]`` (the mean weight each key
    position gets over the counted queries; single cache or model run only, see
    :meth:`sink_profile`). Made by ``FocusAccumulator.result()`` from the accumulator ``acc``.

    ``by_contribution``: where every cache held contributions (``probe.contributions``), the
    statistics of the patterns by contribution, rows renormalised to sum 1, as a HeadStats of
    its own (every metric, roles, sink rate), and the table holds :data:`BESIDE`'s metrics by
    contribution beside those by weight: ``first_contrib``, ``distance_contrib``. Else None.
    """

    def __init__(self, acc: Any) -> None:
        self.accumulator = acc
        self.n_texts = acc.n_texts
        self.rollout = acc.rollout
        # statistics of a rows cache: over its kept rows; the metrics needing every row are NaN
        self.kept = getattr(acc, "kept", None)
        self.not_computed: dict[str, str] = dict(NOT_COMPUTED) if self.kept else {}
        self.not_computed.update(getattr(acc, "not_computed", {}))
        self.received: dict[str, torch.Tensor] | None = getattr(acc, "received", None)
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
        columns += list(METRICS)
        sub = getattr(acc, "by_contribution", None)
        self.by_contribution: HeadStats | None = HeadStats(sub) if sub is not None and sub.stats else None
        if self.by_contribution is not None:
            columns += _beside(rows, self.by_contribution)
        columns += [_std_name(m) for m in METRICS] if several else []
        over = f", over the kept query rows {self.kept['rows']}" if self.kept else ""
        self.table = Table(rows, columns, title=f"head statistics ({self.n_texts} texts{over})")
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

    def sink_profile(self, layer: int, stack: str | None = None, kind: str = "self") -> torch.Tensor:
        """``[heads, K]``: the attention each key position receives in ``layer``, averaged over the
        counted queries of each text, then over the texts (NaN-skipping). Positions are those of
        the batch as padded. Needs a single cache or a model run (``received``)."""
        if not self.received:
            raise ProbeError(
                "these statistics hold no sink profile (they merge several caches); "
                "compute head_stats on one cache or on the model"
            )
        stacks = [k.split("/")[0] for k in self.received]
        key = f"{stack or stacks[-1]}/{layer}/{kind}"
        if key not in self.received:
            raise ProbeError(
                f"no {kind}-attention layer {layer} in these statistics; have: {sorted(self.received)}"
            )
        return self.received[key].nanmean(0).float()

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
        if self.kept:
            d.update({"kept": self.kept, "not_computed": dict(self.not_computed)})
        return d

    def _export_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` and the table's rows (one per head), for :meth:`to_json`."""
        return {**self.to_dict(), "rows": self.table.to_dict()["rows"]}

    def summary(self) -> str:
        """One line per stack/kind: sink rate and how many heads hold each role."""
        lines = []
        for key, rate in self.sink_rate.items():
            stack, kind = key.split("/")
            rows = [r for r in self.table if r["stack"] == stack and r["kind"] == kind]
            counts: dict[str, int] = {}
            for r in rows:
                counts[r["role"]] = counts.get(r["role"], 0) + 1
            roles = ", ".join(
                f"{n} {role}" if role != "none" else f"{n} with no role"
                for role, n in sorted(counts.items(), key=lambda x: -x[1])
            )
            lines.append(f"{stack} {kind}-attention: {len(rows)} heads; sink rate {rate:.2f}; roles: {roles}")
        if self.kept:
            lines.append(
                f"computed over the kept query rows {self.kept['rows']} of each text, not every query; "
                f"not computed ({_EVERY}): {', '.join(self.not_computed)}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary() + "\n" + self.table.to_text()

    def __repr__(self) -> str:
        return f"<HeadStats {len(self.table)} heads, {self.n_texts} texts>"

    def _repr_html_(self) -> str:
        import html

        head = "".join(f"<p>{html.escape(line)}</p>" for line in self.summary().splitlines())
        return head + self.table._repr_html_()


def _beside(rows: list[dict], by: HeadStats) -> list[str]:
    """Add each row's :data:`BESIDE` metrics by contribution (NaN for a head without them);
    returns the new columns."""
    got = {(r["stack"], r["layer"], r["head"], r["kind"]): r for r in by.table}
    cols = [f"{m}_contrib" for m in BESIDE]
    for row in rows:
        other = got.get((row["stack"], row["layer"], row["head"], row["kind"]))
        for m, c in zip(BESIDE, cols, strict=True):
            row[c] = other[m] if other is not None else float("nan")
    return cols


__all__ = ["HeadStats", "BESIDE"]
