""":class:`Lookback`: what each generated token read, its tables, views and exports."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from probe.analysis.generation.steps import Steps
from probe.analysis.table import Exports, Table
from probe.errors import ProbeError


def _nanmean(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return x.nanmean(dims) if x.numel() else x.sum(dims)


def _f(v: Any) -> float:
    return float(v)


class Lookback(Exports):
    """What each generated token of one text read (see :func:`probe.lookback`).

    Tensors ``[layer, head, step]`` (``layers`` lists the model's layer of each entry, ``step``
    counts the generated tokens from 0): ``ratio`` (the lookback ratio, NaN at step 0 and where the
    cache did not keep the row), ``prompt_mass`` and ``output_mass`` (the attention on the prompt
    and on the tokens generated before), ``sink_mass`` (on the first ``sink`` positions),
    ``image_mass`` (on the prompt's image tokens; None without). ``top_index``/``top_weight``
    ``[layer, head, step, k]``: the prompt positions each head read most and their weights
    (``-1``/NaN where fewer are known); ``mean_top_*`` ``[layer, step, k]`` the same over each
    layer's head mean, ``all_top_*`` ``[step, k]`` over every layer and head.

    ``table`` (one row per step, layer and head), ``by_step`` (means over layers and heads, with
    the prompt tokens read most) and ``by_head`` (means over the steps) are
    :class:`~probe.analysis.table.Table` s; ``steps`` says which positions are which
    (:class:`~probe.analysis.generation.steps.Steps`).
    """

    def __init__(
        self,
        st: Steps,
        layers: list[int],
        n_heads: int,
        acc: Any,
        *,
        sink: int,
        kept: str,
        missing: dict[int, int],
        source: Any = None,
        layer_heads: list[int] | None = None,
    ):
        self.steps = st
        self.source = source  # an encoder-decoder's SourceReads (cross-attention), else None
        self.layers = list(layers)
        self.n_heads = n_heads  # the most any layer has
        self.layer_heads = list(layer_heads) if layer_heads is not None else [n_heads] * len(self.layers)
        self.sink = sink
        self.kept = kept
        self.missing = dict(missing)  # layer -> generated tokens whose row the cache did not keep
        self.prompt_mass, self.output_mass = acc.prompt, acc.output
        self.sink_mass, self.image_mass = acc.sink, acc.image
        P = len(st.prompt)
        t = torch.arange(st.n_steps, dtype=torch.float64)
        ctx = self.prompt_mass / P
        new = self.output_mass / t.clamp(min=1)
        ratio = ctx / (ctx + new)
        ratio[..., 0] = float("nan")  # nothing generated yet: A_new is a mean over no token
        self.ratio = ratio
        self.top_index, self.top_weight = acc.top_index, acc.top_weight
        self.mean_top_index, self.mean_top_weight = acc.mean_index, acc.mean_weight
        counted = acc.counted.clamp(min=1).double()[:, None]
        all_mean = torch.where(acc.counted[:, None] > 0, acc.on_prompt / counted, float("nan"))
        k = acc.k
        vals, idx = torch.nan_to_num(all_mean, nan=float("-inf")).topk(k, dim=-1)
        ok = torch.isfinite(vals)
        prompt = torch.tensor(st.prompt)
        self.all_top_index = torch.where(ok, prompt[idx], -1)
        self.all_top_weight = torch.where(ok, vals, float("nan"))
        self._long: Table | None = None
        self.by_step = _step_table(self)
        self.by_head = _head_table(self)

    # -- tables --------------------------------------------------------------------------------
    @property
    def table(self) -> Table:
        """One row per step, layer and head (built on first use: a long generation has many)."""
        if self._long is None:
            self._long = _long_table(self)
        return self._long

    def _masses(self) -> list[tuple[str, torch.Tensor]]:
        out = [
            ("lookback_ratio", self.ratio),
            ("prompt_mass", self.prompt_mass),
            ("output_mass", self.output_mass),
            ("sink_mass", self.sink_mass),
        ]
        return out + ([("image_mass", self.image_mass)] if self.image_mass is not None else [])

    def reads(
        self, step: int, layer: int | None = None, head: int | None = None, *, source: bool = False
    ) -> Table:
        """The prompt tokens generated token ``step`` read most, with their weights: over every
        layer and head (default), one ``layer``'s head mean, or one ``layer`` and ``head``. With
        ``source=True`` (an encoder-decoder): the source tokens it read most through the
        decoder's cross-attention, the same way."""
        n = self.steps.n_steps
        if isinstance(step, bool) or not isinstance(step, int) or not -n <= step < n:
            raise ProbeError(f"step {step!r} is out of range: {n} tokens were generated (0-{n - 1})")
        step %= n
        if head is not None and layer is None:
            raise ProbeError("give layer= with head= (a head belongs to a layer)")
        if source and self.source is None:
            raise ProbeError("source=True reads cross-attention; this generation's model has none")
        idx, w, who = self._picked(step, layer, head, source)
        labels = dict(zip(self.source.positions, self.source.tokens, strict=True)) if source else None
        rows = [
            {
                "rank": r,
                "position": int(p),
                "token": labels[int(p)] if labels else self.steps.tokens[int(p)],
                "weight": _f(x),
            }
            for r, (p, x) in enumerate(zip(idx.tolist(), w.tolist(), strict=True))
            if p >= 0
        ]
        what = "the source" if source else "the prompt"
        title = f"what {self.steps.output[step]!r} (step {step}) read most of {what}, {who}"
        return Table(rows, ["rank", "position", "token", "weight"], title=title)

    def _picked(self, step: int, layer: int | None, head: int | None, source: bool):
        """``(positions, weights, words)`` of one step's top keys (see :meth:`reads`)."""
        src = self.source
        if layer is None:
            if source:
                return src.all_index[step], src.all_weight[step], "mean over layers and heads"
            return self.all_top_index[step], self.all_top_weight[step], "mean over layers and heads"
        layers = src.layers if source else self.layers
        if layer not in layers:
            raise ProbeError(f"layer {layer} is not in this result; it has layers {layers}")
        li = layers.index(layer)
        if head is None:
            if source:
                return src.mean_index[li, step], src.mean_weight[li, step], f"layer {layer}, head mean"
            return self.mean_top_index[li, step], self.mean_top_weight[li, step], f"layer {layer}, head mean"
        n_heads = src.index.shape[1] if source else self.layer_heads[li]
        if not 0 <= head < n_heads:
            raise ProbeError(
                f"head {head} is out of range: layer {layer} has {n_heads} heads (0-{n_heads - 1})"
            )
        if source:
            return src.index[li, head, step], src.weight[li, head, step], f"layer {layer}, head {head}"
        return self.top_index[li, head, step], self.top_weight[li, head, step], f"layer {layer}, head {head}"

    def ratio_map(self) -> torch.Tensor:
        """``[layer, head]``: each head's lookback ratio averaged over the steps (NaN-skipping; NaN
        for the heads a layer does not have, when layers differ)."""
        return _nanmean(self.ratio, (2,))

    # -- exports -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The long table (a row per step, layer and head), ``by_step`` and what the result covers."""
        d = self.table.to_dict()
        st = self.steps
        d.update(
            {
                "prompt_length": len(st.prompt),
                "new_tokens": st.n_steps,
                "output": list(st.output),
                "layers": list(self.layers),
                "heads": self.n_heads,
                "layer_heads": list(self.layer_heads),
                "sink": self.sink,
                "kept": self.kept,
                "missing": {str(k): v for k, v in self.missing.items()},
                "by_step": self.by_step.to_dict()["rows"],
            }
        )
        return d

    def _export_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` with the long table's rows (a row per step, layer and head) and the
        per-step rows, for :meth:`to_json` (CSV and pandas: the long table)."""
        return {**self.to_dict(), "rows": self.table.to_dict()["rows"]}

    def _shape(self) -> str:
        """``"2 layers x 4 heads"``, or with uneven layers ``"2 layers of 4, 1 heads"``."""
        if len(set(self.layer_heads)) <= 1:
            return f"{len(self.layers)} layers x {self.n_heads} heads"
        return f"{len(self.layers)} layers of {', '.join(map(str, self.layer_heads))} heads"

    def summary(self) -> str:
        """A few lines: what was generated, the mean ratio, the heads that read the prompt least."""
        st = self.steps
        lines = [
            f"{st.n_steps} tokens generated after a prompt of {len(st.prompt)} ({st.stack} stack, "
            f"{self._shape()})"
        ]
        m = _nanmean(self.ratio, (0, 1, 2))
        if not math.isnan(float(m)):
            lines.append(
                f"lookback ratio over steps 1-{st.n_steps - 1}, layers and heads: mean {float(m):.3f}"
            )
            low = self.by_head.sorted("lookback_ratio", descending=False)[0]
            lines.append(
                f"reads its own output most: layer {low['layer']} head {low['head']} "
                f"(mean ratio {low['lookback_ratio']:.3f})"
            )
        if self.image_mass is not None:
            lines.append(
                "attention on the image tokens, mean over everything: "
                f"{float(_nanmean(self.image_mass, (0, 1, 2))):.3f}"
            )
        if self.missing:
            lines.append(
                "rows not kept (NaN): " + ", ".join(f"layer {k}: {v} tokens" for k, v in self.missing.items())
            )
        if self.kept == "topk" and bool(self.prompt_mass.isnan().any()):
            lines.append(
                "top-k rows that do not hold the whole row give no masses or ratio (NaN); "
                "their top prompt tokens are exact"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary() + "\n" + self.by_step.to_text()

    def __repr__(self) -> str:
        st = self.steps
        return f"<Lookback {st.n_steps} generated tokens, {self._shape()}>"

    def _repr_html_(self) -> str:
        import html

        head = "".join(f"<p>{html.escape(line)}</p>" for line in self.summary().splitlines())
        return head + self.by_step._repr_html_()


def _long_table(lb: Lookback) -> Table:
    st, masses = lb.steps, lb._masses()
    rows = []
    for t in range(st.n_steps):
        for li, layer in enumerate(lb.layers):
            for h in range(lb.layer_heads[li]):
                row = {
                    "step": t,
                    "token": st.output[t],
                    "query": st.writers[t],
                    "layer": layer,
                    "head": h,
                }
                row.update({name: _f(m[li, h, t]) for name, m in masses})
                rows.append(row)
    cols = ["step", "token", "query", "layer", "head"] + [n for n, _ in masses]
    return Table(rows, cols, title="lookback per generated token, layer and head")


def _step_table(lb: Lookback) -> Table:
    st, masses = lb.steps, lb._masses()
    means = {name: _nanmean(m, (0, 1)) for name, m in masses}
    rows = []
    for t in range(st.n_steps):
        row = {"step": t, "token": st.output[t], "query": st.writers[t]}
        row.update({name: _f(means[name][t]) for name, _ in masses})
        pos = [int(p) for p in lb.all_top_index[t] if p >= 0]
        row["read_most"] = [st.tokens[p] for p in pos]
        row["read_weights"] = [round(_f(w), 6) for w in lb.all_top_weight[t][: len(pos)]]
        rows.append(row)
    cols = ["step", "token", "query"] + [n for n, _ in masses] + ["read_most", "read_weights"]
    return Table(rows, cols, title="per generated token, over layers and heads")


def _head_table(lb: Lookback) -> Table:
    masses = lb._masses()
    means = {name: _nanmean(m, (2,)) for name, m in masses}
    rows = []
    for li, layer in enumerate(lb.layers):
        for h in range(lb.layer_heads[li]):
            row = {"layer": layer, "head": h}
            row.update({name: _f(means[name][li, h]) for name, _ in masses})
            rows.append(row)
    return Table(
        rows, ["layer", "head"] + [n for n, _ in masses], title="per head, over the generated tokens"
    )


# -- views ---------------------------------------------------------------------------------


__all__ = ["Lookback"]
