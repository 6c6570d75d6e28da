"""Report section: word alignment read from the decoder's cross-attention (``probe.align``).

Shows, for the first sentence pair, the rectangular soft word matrix of the chosen layer/head with
gold links overlaid (sure: filled squares, possible: hollow circles), the chosen hard links drawn
between the two sentences, and a layer x head map over all pairs: AER when gold links are known
(``ctx.results["alignment_gold"]``: a talp path/text or a list of ``Gold``), else diagonality.
"""

from __future__ import annotations

import math

import numpy as np

from probe.analysis.alignment import align, cross_layers
from probe.analysis.alignment.core import MEAN
from probe.analysis.alignment.diagonal import candidates
from probe.cache.pictures import stack_positions
from probe.report.matrix import NO_HEAD, label_axis, mark_missing

TITLE = "Cross-attention alignment"
ORDER = 60
N_CANDIDATES = 5
MAX_INCHES = 14.0  # a figure's widest and tallest side at 100 dpi: long sentences thin their labels
# which decoder row stands for target word j (see probe.analysis.alignment.core)
CONVENTION_WORDS = {
    "input": "input convention (row j: the decoder reading word j)",
    "output": "output convention (row j: the decoder predicting word j)",
}


def _head_name(head) -> str:
    return "mean of the heads" if head == MEAN else f"head {head}"


def _layer_name(layer) -> str:
    return "mean of the layers" if layer == MEAN else f"layer {layer}"


def not_words(meta: dict) -> str | None:
    """What the cross-attention's keys are when they are not the source's words: ``"audio
    frames"`` or ``"picture patches"``, read from the recorded positions of the stacks the decoder
    reads (``metadata["stacks"][stack]["positions"]``: ``frames``, an image ``grid``, or each
    position's kind); None when they are tokens (a text's words, split or whole)."""
    for stack in meta.get("stacks") or {}:
        pos = stack_positions(meta, stack)
        if stack == "decoder" or pos is None:
            continue
        kinds = set(pos.get("kinds") or [])
        if pos.get("frames") or "frame" in kinds:
            return "audio frames"
        if pos.get("grid") or pos.get("layer_grids") or "patch" in kinds:
            return "picture patches"
    return None


def _fit(width: float, height: float) -> tuple[float, float]:
    """A figure size in inches, each side at most :data:`MAX_INCHES`."""
    return min(width, MAX_INCHES), min(height, MAX_INCHES)


def _heatmap(al, b: int):
    from matplotlib.figure import Figure

    M = al.matrix(b).numpy()
    src, tgt = al.source[b].words, al.target[b].words
    fig = Figure(figsize=_fit(1.2 + 0.55 * len(src), 1.0 + 0.45 * len(tgt)))
    ax = fig.subplots()
    im = ax.imshow(M, cmap="Blues", vmin=0, vmax=max(1e-9, float(M.max())), aspect="auto")
    label_axis(ax, "x", src)  # tokens shown as in every figure: whitespace visible, CJK upright
    label_axis(ax, "y", tgt)
    ax.set_xlabel("source words")
    ax.set_ylabel("target words")
    if al.gold is not None:
        g = al.gold[b]
        marks = (  # sure: red squares; possible-only: orange circles
            (sorted(g.sure), "s", 90, "#d62728", 2.0, "gold sure"),
            (sorted(g.possible - g.sure), "o", 70, "#ff7f0e", 1.5, "gold possible"),
        )
        for links, marker, size, color, width, label in marks:
            if links:
                ax.scatter(
                    [i for i, _ in links],
                    [j for _, j in links],
                    marker=marker,
                    s=size,
                    facecolors="none",
                    edgecolors=color,
                    linewidths=width,
                    label=label,
                )
        ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.01), ncol=2, fontsize=8, frameon=False)
    links = sorted(al.links[b])
    ax.scatter([i for i, _ in links], [j for _, j in links], marker="x", s=30, c="black", label="chosen")
    fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02, label="attention mass")
    return fig


def _links(al, b: int):
    from matplotlib.figure import Figure

    src, tgt = al.source[b].words, al.target[b].words
    n = max(len(src), len(tgt), 1)
    width, _ = _fit(1.0 + 0.9 * n, 0)
    # words side by side while each has 0.54 in (10 pt, shrinking to 6 pt); past that, upright
    # and every k-th word with 0.15 in between them (every link is drawn)
    size = max(6.0, min(10.0, 10.0 * (width - 1.0) / (0.9 * n)))
    upright = 0.09 * n * size > width - 1.0
    step = math.ceil(0.15 * n / (width - 1.0)) if upright else 1
    fig = Figure(figsize=(width, 3.2 if upright else 1.8))
    ax = fig.subplots()
    xs = [k * (n - 1) / max(len(src) - 1, 1) for k in range(len(src))]
    xt = [k * (n - 1) / max(len(tgt) - 1, 1) for k in range(len(tgt))]
    turn = 90 if upright else 0
    for k, w in enumerate(src):
        if k % step == 0:
            ax.text(xs[k], 1.0, w, ha="center", va="bottom", fontsize=size, rotation=turn)
    for k, w in enumerate(tgt):
        if k % step == 0:
            ax.text(xt[k], 0.0, w, ha="center", va="top", fontsize=size, rotation=turn)
    sure = al.gold[b].sure if al.gold is not None else set()
    for i, j in sorted(al.links[b]):
        hit = al.gold is None or (i, j) in al.gold[b].possible
        ax.plot(
            [xs[i], xt[j]],
            [0.95, 0.05],
            color="#1f77b4" if hit else "#d62728",
            lw=2 if (i, j) in sure or al.gold is None else 1.2,
            ls="-" if hit else ":",
        )
    ax.set_xlim(-0.8, n - 0.2)
    ax.set_ylim(-0.35, 1.35)
    ax.axis("off")
    return fig


def _map(al, values: dict, label: str, convention: str):
    from matplotlib.figure import Figure

    # every head some layer has (layers may differ in heads), then their mean
    own = sorted({h for _, h in values if h != MEAN}) or list(range(al.n_heads))
    heads = [*own, MEAN]
    grid = [[values.get((layer, h), math.nan) for h in heads] for layer in al.layers]
    missing = np.array([[h != MEAN and (layer, h) not in values for h in heads] for layer in al.layers])
    fig = Figure(figsize=_fit(1.5 + 0.55 * len(heads), 0.9 + 0.4 * len(al.layers)))
    ax = fig.subplots()
    im = ax.imshow(grid, cmap="viridis_r" if label == "AER" else "viridis", aspect="auto")
    ax.set_xticks(range(len(heads)), [str(h) for h in heads])
    ax.set_yticks(range(len(al.layers)), [str(x) for x in al.layers])
    ax.set_xlabel("head")
    ax.set_ylabel("decoder layer")
    title = f"{label}, {CONVENTION_WORDS[convention]}"
    if values and mark_missing(ax, missing):
        title += f"\n({NO_HEAD})"
    ax.set_title(title, fontsize=9)
    for r, row in enumerate(grid):
        for c, v in enumerate(row):
            if not math.isnan(v):
                ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white")
    fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02, label=label)
    return fig


def build(ctx) -> dict | None:
    """The alignment figures and tables; None when the cache has no cross-attention, or when its
    keys are not words (audio frames: "What the transcript heard" reads them as time; picture
    patches: the cross-attention views show them)."""
    cache = ctx.cache
    if not cross_layers(cache) or not_words(cache.metadata) is not None:
        return None
    ctx.progress("alignment")
    al = ctx.results.get("alignment")
    if al is None:
        al = align(cache, gold=ctx.results.get("alignment_gold"))
        ctx.results["alignment"] = al
    conv = al.convention
    if al.scores is not None:
        label, table = "AER", al.scores
        values = {(r["layer"], r["head"]): r["aer"] for r in table if r["convention"] == conv}
    else:
        label, table = "diagonality", al.stats
        values = {(r["layer"], r["head"]): r["diagonality"] for r in table if r["convention"] == conv}
    stats = next(
        r for r in al.stats if r["convention"] == conv and r["layer"] == al.layer and r["head"] == al.head
    )
    top = table.top(label.lower(), 8, descending=label != "AER")
    sel = al.selection()
    return {
        "selection": sel,
        "chosen_words": f"{_layer_name(al.layer)}, {_head_name(al.head)}",
        "candidates": candidates(al, N_CANDIDATES) if al.gold is None else [],
        "chosen_links": ", ".join(
            f"{al.source[0].words[i]}→{al.target[0].words[j]}"
            for i, j in sorted(al.links[0], key=lambda x: x[1])
        ),
        "source": " ".join(al.source[0].words),
        "target": " ".join(al.target[0].words),
        "pairs": len(al.links),
        "has_gold": al.gold is not None,
        "best": al.best,
        "heatmap": ctx.figure(_heatmap(al, 0), "soft word alignment with gold links"),
        "links": ctx.figure(_links(al, 0), "chosen alignment links"),
        "map": ctx.figure(_map(al, values, label, conv), f"{label} per layer and head"),
        "convention_words": CONVENTION_WORDS[conv],
        "map_label": label,
        "table_html": top._repr_html_() if al.gold is not None else "",
        "pharaoh": al.pharaoh().splitlines()[:20],
        "stats": {
            k: round(v, 3) if isinstance(v, float) and not math.isnan(v) else v for k, v in stats.items()
        },
        "notes": al.notes,
    }
