"""What the generated text read: for a generation cache (``probe.generate``, ``probe generate``),
the prompt and the output; hover a generated token to see what it read of the prompt and of the
output before it, per layer and head or averaged (``static/generation_hover.js``); each head's
lookback ratio (Chuang et al. 2024, :func:`probe.lookback`) over the steps; the attention the
first position receives as the output grows (and, with a picture in the prompt, the share on its
image tokens); for an encoder-decoder the cross-attention of each generated token over the source:
the alignment as it was written. The hover views' data is
:mod:`probe.report.sections._generation_views`'."""

from __future__ import annotations

import warnings
from typing import Any

from markupsafe import Markup

from probe.analysis.generation import generation_meta, lookback, steps
from probe.analysis.generation.lookback import self_layers
from probe.analysis.generation.rows import check_kept
from probe.errors import ProbeError
from probe.report.matrix import label_axis, layer_ticks
from probe.report.sections._image_hover import view_script

TITLE = "What the generated text read"
ORDER = 21
MAX_TEXTS = 2  # texts of a batch drawn; the rest are left out (the section says so)


def _text(gen: dict[str, Any], key: str, b: int) -> str | None:
    v = gen.get(key)
    v = v[b] if isinstance(v, list) else v
    return v if isinstance(v, str) else None


def _own_heads(cache, stack: str, layers: list[int]) -> list[int]:
    """How many self-attention heads each of ``layers`` has in ``cache`` (layers may differ: the
    zoo's induction model has 4, then 1); the lookback's arrays hold as many as the first layer."""
    out = []
    for layer in layers:
        prefix = f"{stack}.blocks.{layer}.self_attn."
        k = next(
            k
            for k in cache.keys()
            if k.startswith(prefix) and k.rsplit(".", 1)[-1] in ("pattern", "rows", "topk_values")
        )
        out.append(cache.shape(k)[1])
    return out


def _ratio_fig(lb, own: list[int] | None = None):
    """The lookback ratio per head (rows: layer.head, each layer's ``own`` heads, default all the
    lookback holds) over the generated tokens (columns), and its mean over heads above."""
    import numpy as np
    from matplotlib.figure import Figure

    own = own or [lb.ratio.shape[1]] * len(lb.layers)
    N = lb.ratio.shape[-1]
    grid = np.concatenate([lb.ratio[li, :n].numpy() for li, n in enumerate(own)]).reshape(-1, N)
    rows = [f"L{layer} H{h}" for layer, n in zip(lb.layers, own, strict=True) for h in range(n)]
    fig = Figure(figsize=(min(14.0, 2.5 + 0.3 * N), 2.2 + min(10.0, 0.16 * len(rows))))
    top, ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 3]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a step with no ratio (the first) is blank
        mean = np.nanmean(grid, 0)
    top.plot(range(N), mean, marker="o", ms=3, color="#2b6cb0")
    top.set_ylim(0, 1)
    top.set_ylabel("mean")
    top.grid(alpha=0.3)
    im = ax.imshow(
        np.ma.masked_invalid(grid), cmap="viridis", vmin=0, vmax=1, aspect="auto", interpolation="nearest"
    )
    label_axis(ax, "x", list(lb.steps.output))
    label_axis(ax, "y", rows)
    ax.set_xlabel("generated token")
    ax.set_ylabel("layer, head")
    fig.colorbar(im, ax=[top, ax], fraction=0.03, pad=0.02, label="lookback ratio")
    return fig


MAX_SINK_LINES = 12  # layers drawn as lines with a legend; more are a heatmap (layer x step)


def _sink_fig(lb, own: list[int] | None = None):
    """The attention on the first ``sink`` positions (and on image tokens) per layer over the
    steps: a line per layer with a legend up to :data:`MAX_SINK_LINES` layers, else a heatmap of
    layers (rows) by generated tokens (columns) with a colour bar (30 unlabelled lines could not be
    told apart)."""
    import numpy as np
    from matplotlib.figure import Figure

    own = own or [lb.sink_mass.shape[1]] * len(lb.layers)  # each layer's heads (default: all held)
    panels = [("sink_mass", f"on the first {lb.sink} positions" if lb.sink > 1 else "on the first position")]
    if lb.image_mass is not None:
        panels.append(("image_mass", "on the prompt's image tokens"))
    lines = len(lb.layers) <= MAX_SINK_LINES
    height = 2.4 if lines else 1.2 + min(4.0, 0.12 * len(lb.layers))
    fig = Figure(
        figsize=(min(12.0, 3.0 + 0.25 * lb.steps.n_steps) + (0 if lines else 1.0), height * len(panels))
    )
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, what) in zip(axes, panels, strict=True):
        values = getattr(lb, name).numpy()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            # [layers, steps]: the mean over each layer's own heads
            means = np.stack([np.nanmean(values[li, :n], 0) for li, n in enumerate(own)])
        if lines:
            for li, layer in enumerate(lb.layers):
                ax.plot(range(means.shape[1]), means[li], marker=".", label=f"layer {layer}")
            ax.set_ylabel("attention")
            ax.grid(alpha=0.3)
        else:
            shown = np.ma.masked_invalid(means)
            top = float(shown.max()) if shown.count() else 1.0
            im = ax.imshow(
                shown, cmap="viridis", vmin=0, vmax=max(top, 1e-6), aspect="auto", interpolation="nearest"
            )
            layer_ticks(ax, lb.layers, range(len(lb.layers)), which="y")
            ax.set_ylabel("layer")
            fig.colorbar(im, ax=ax, fraction=0.03, pad=0.02, label="attention")
        ax.set_title(f"mean over heads of the attention {what}", fontsize=9)
    if lines:
        axes[0].legend(fontsize=7, ncol=min(6, len(lb.layers)), loc="upper left", bbox_to_anchor=(1.0, 1.0))
    label_axis(axes[-1], "x", list(lb.steps.output))
    axes[-1].set_xlabel("generated token")
    return fig


def _cross_fig(cache, st, layer: int):
    """The cross-attention of each generated token (rows) over the source (columns), head mean."""
    from matplotlib.figure import Figure

    from probe.analysis.generation import writer_rows

    _, k = cache.axes(st.stack, "cross", st.batch)
    m = writer_rows(cache, st, layer, "cross")[:, :, k.positions].mean(0).numpy()
    fig = Figure(figsize=(1.5 + 0.55 * len(k.positions), 1.2 + 0.35 * st.n_steps))
    ax = fig.subplots()
    im = ax.imshow(m, cmap="Blues", vmin=0, aspect="auto", interpolation="nearest")
    label_axis(ax, "x", k.tokens)
    label_axis(ax, "y", list(st.output))
    ax.set_xlabel("source token")
    ax.set_ylabel("generated token (in the order written)")
    fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02, label="attention")
    return fig


def _item(ctx, cache, b: int, views: list) -> dict[str, Any]:
    """One text: its output, figures and hover views (data filled after planning)."""
    from probe.report.sections import _generation_views as gv

    gen = cache.metadata["generation"]
    st = steps(cache, b)
    ctx.progress(f"generation: lookback of text {b}")
    lb = lookback(cache, batch=b)
    own = _own_heads(cache, st.stack, lb.layers)
    mine = [gv.self_view(cache, st, lb.layers, max(own), lb)]
    cross = self_layers(cache, st.stack, "cross")
    if cross:
        mine.append(gv.cross_view(cache, st, cross, cache.shape(_cross_key(cache, st.stack, cross[0]))[1]))
    views.extend(mine)
    prompt = _text(gen, "prompt_text", b) or "".join(st.tokens[p] for p in st.prompt)
    return {
        "label": f"text {b}" if cache.n_texts > 1 else "",
        "translation": bool(cross),  # an encoder-decoder: the prompt text is the source
        "prompt": prompt,
        "output": _text(gen, "output_text", b) or "".join(st.output),
        "n_prompt": len(st.prompt),
        "n_new": st.n_steps,
        "strategy": gen.get("strategy") or "?",
        "seed": gen.get("seed"),
        "summary": lb.summary().splitlines(),
        "table": lb.by_step.select(
            ["step", "token", "lookback_ratio", "prompt_mass", "sink_mass", "read_most"]
        ),
        "ratio_fig": ctx.figure(_ratio_fig(lb, own)),
        "sink_fig": ctx.figure(_sink_fig(lb, own)),
        "has_image": lb.image_mass is not None,
        "cross_fig": ctx.figure(_cross_fig(cache, st, cross[-1])) if cross else None,
        "cross_layer": cross[-1] if cross else None,
        "views": mine,
    }


def _cross_key(cache, stack: str, layer: int) -> str:
    prefix = f"{stack}.blocks.{layer}.cross_attn."
    return next(
        k
        for k in cache.keys()
        if k.startswith(prefix) and k.rsplit(".", 1)[-1] in ("pattern", "rows", "topk_values")
    )


def build(ctx) -> dict | None:
    """The first generation cache's texts (up to :data:`MAX_TEXTS`); None when no cache of the
    report is a generation."""
    from probe.report.sections import _generation_views as gv

    found = [c for c in ctx.caches if isinstance(c.metadata.get("generation"), dict)]
    if not found:
        return None
    cache = found[0]
    gen = generation_meta(cache)
    if cache.kept == "stats":  # no row kept: the text, and what to capture for the rest
        try:
            check_kept(cache)
        except ProbeError as e:
            note = str(e)
        texts = [
            {"prompt": _text(gen, "prompt_text", b) or "", "output": _text(gen, "output_text", b) or ""}
            for b in range(min(MAX_TEXTS, cache.n_texts))
        ]
        return {"stats_only": True, "note": note, "texts": texts}
    views: list = []
    items = [_item(ctx, cache, b, views) for b in range(min(MAX_TEXTS, cache.n_texts))]
    gv.plan(views)
    for it in items:
        it["views"] = [_view(ctx, v) for v in it["views"]]
        it["table_html"] = Markup(it.pop("table")._repr_html_())
    return {
        "stats_only": False,
        "texts": items,
        "left_out": cache.n_texts - len(items),
        "kept": cache.kept if cache.partial else None,
        "lut": _lut(),
        "js": Markup(view_script("generation_hover.js")),
    }


def _view(ctx, v) -> dict[str, Any]:
    from probe.report.sections import _generation_views as gv

    ctx.progress(f"generation: hover maps ({v.kind})")
    data = gv.view_data(v)
    left = len(v.st.output) - len(v.mapped)
    return {"kind": v.kind, "data": data, "left_out": left, "heads_all": len(v.head_layers) == len(v.layers)}


def _lut() -> str:
    from probe.report.sections._patterns import colour_lut

    return colour_lut("Blues")
