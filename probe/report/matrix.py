"""The generic labelled heatmap (:func:`matrix`) and :func:`save`, shared by every figure.

Built on a bare :class:`matplotlib.figure.Figure` with the object-oriented API (never pyplot): no
global state, no backend chosen for the user, nothing shown. Token labels go through
:mod:`probe.report.labels` (whitespace made visible, thinned to fit) and CJK text through
:mod:`probe.report.fonts`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import seaborn as sns
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from probe.errors import ProbeError
from probe.files import atomic_path
from probe.report import fonts
from probe.report import labels as lab

DPI = 100
FORMATS = ("png", "svg", "pdf")


# -- the generic labelled heatmap ------------------------------------------------------------
def _as_2d(values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().float().cpu().numpy()
    a = np.asarray(values, dtype=np.float64)
    if a.ndim != 2:
        raise ProbeError(f"a heatmap needs a 2-D matrix, got shape {tuple(a.shape)}")
    if a.size == 0:
        raise ProbeError(f"nothing to draw: the matrix has shape {tuple(a.shape)}")
    return a


def side_inches(n: int) -> float:
    return float(np.clip(3.0 + 0.12 * n, 4.0, 12.0))


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def label_axis(ax: Axes, which: str, names: Sequence[str]) -> int:
    """Put ``names`` on the ``which`` ("x"/"y") axis, thinned to fit; returns the step k."""
    n = len(names)
    size = lab.font_size(n)
    fig, box = ax.figure, ax.get_position()
    length_pt = 72 * (box.width * fig.get_figwidth() if which == "x" else box.height * fig.get_figheight())
    k = lab.step(n, length_pt, size)
    idx = np.arange(0, n, k)
    shown = [lab.display(names[i]) for i in idx]
    if which == "x":
        if any(fonts.has_cjk(s) for s in shown):
            # rotated text would turn CJK characters on their side: stack every label's characters
            # one above the other instead (upright, read top to bottom)
            stacked = ["\n".join(s) for s in shown]
            ax.set_xticks(idx, stacked, fontsize=size, parse_math=False, linespacing=1.0)
            return k
        rotation = 90 if any(len(s) > 1 for s in shown) else 0
        ax.set_xticks(idx, shown, fontsize=size, rotation=rotation, parse_math=False)
    else:
        ax.set_yticks(idx, shown, fontsize=size, parse_math=False)
    return k


MAX_LAYER_LABELS = 15  # past this many layers an axis labels every 5th (labels ran together at 30)


def layer_ticks(ax: Axes, layers: Sequence[int], positions: Sequence[float] | None = None, which: str = "x"):
    """Label an axis of layers (numbers ``layers`` drawn at ``positions``, default the numbers
    themselves): every layer up to :data:`MAX_LAYER_LABELS`, past that every 5th (every 10th past
    75), the multiples of the step (0, 5, 10, ...) labelled and every layer kept as a minor tick,
    so the numbers never run together and each layer can still be counted. Returns the step."""
    layers = [int(x) for x in layers]
    pos = list(layers if positions is None else positions)
    if len(pos) != len(layers):
        raise ProbeError(f"{len(layers)} layers but {len(pos)} tick positions")
    n = len(layers)
    step = 1 if n <= MAX_LAYER_LABELS else 5 * -(-n // 75)
    shown = [i for i, layer in enumerate(layers) if layer % step == 0]
    if len(shown) < n // (2 * step):  # layers that skip the multiples (a sparse capture): every step-th one
        shown = list(range(0, n, step))
    set_ticks = ax.set_xticks if which == "x" else ax.set_yticks
    set_ticks([pos[i] for i in shown], [str(layers[i]) for i in shown])
    if step > 1:
        set_ticks(pos, minor=True)
    return step


def head_grid(
    rows: Sequence[Sequence[float]], heads: Sequence[Sequence[int]]
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """A layers × heads grid of layers that may have different heads: ``rows[i]`` the values of
    layer i's heads, ``heads[i]`` their numbers. Returns ``(columns, values, missing)``: every head
    number some layer has (ascending), the values placed in their columns (NaN elsewhere), and
    where a layer has no such head (``missing``, to be drawn with :func:`mark_missing`)."""
    if len(rows) != len(heads) or any(len(r) != len(h) for r, h in zip(rows, heads, strict=False)):
        raise ProbeError(f"{[len(r) for r in rows]} values per layer for {[len(h) for h in heads]} heads")
    columns = sorted({int(h) for hs in heads for h in hs})
    col = {h: j for j, h in enumerate(columns)}
    values = np.full((len(rows), len(columns)), np.nan)
    missing = np.ones((len(rows), len(columns)), dtype=bool)
    for i, (r, hs) in enumerate(zip(rows, heads, strict=True)):
        for v, h in zip(r, hs, strict=True):
            values[i, col[int(h)]] = v
            missing[i, col[int(h)]] = False
    return columns, values, missing


NO_HEAD = "hatched: a head that layer does not have"


def mark_missing(ax: Axes, missing: np.ndarray) -> bool:
    """Hatch the cells of a layers × heads image (cell (i, j) centred at (j, i)) where ``missing``:
    heads a layer does not have, drawn empty and marked, never as values. Returns whether any."""
    from matplotlib.patches import Rectangle

    for i, j in zip(*np.nonzero(missing), strict=True):
        ax.add_patch(
            Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="#f2f2f2", edgecolor="#b0b0b0", hatch="///", lw=0)
        )
    return bool(missing.any())


def axis_title(text: str | None, k: int) -> str | None:
    if k == 1 or text is None:
        return text
    return f"{text} (every {_ordinal(k)} label shown)"


def _annotate(ax: Axes, a: np.ndarray, image) -> None:
    n = max(a.shape)
    size = 8 if n <= 12 else 6 if n <= 24 else 4
    for (i, j), v in np.ndenumerate(a):
        if not np.isfinite(v):
            continue
        dark = sns.utils.relative_luminance(image.cmap(image.norm(v))) < 0.408
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=size, color="white" if dark else "black")


def matrix(
    values,
    x_labels: Sequence[str],
    y_labels: Sequence[str],
    *,
    title: str | None = None,
    xlabel: str | None = None,
    ylabel: str | None = None,
    cmap: str = "Blues",
    ax: Axes | None = None,
    vmin: float | None = None,
    vmax: float | None = None,
    annotate: bool = False,
    colorbar: bool = True,
) -> Figure:
    """A labelled heatmap of a 2-D ``values`` [rows, cols] (array or tensor).

    ``x_labels`` name the columns, ``y_labels`` the rows (row 0 at the top). ``vmin``/``vmax``
    default to the finite minimum/maximum; NaN cells stay blank. ``annotate`` writes each value
    in its cell. Draws into ``ax`` if given, else into a new figure sized to the matrix. Returns
    the Figure.
    """
    a = _as_2d(values)
    x_labels, y_labels = [str(s) for s in x_labels], [str(s) for s in y_labels]
    if len(x_labels) != a.shape[1] or len(y_labels) != a.shape[0]:
        raise ProbeError(
            f"labels do not match the matrix: {len(y_labels)} row and {len(x_labels)} column labels "
            f"for shape {tuple(a.shape)}"
        )
    finite = a[np.isfinite(a)]
    lo = float(finite.min()) if vmin is None and finite.size else vmin
    hi = float(finite.max()) if vmax is None and finite.size else vmax
    with fonts.context([*x_labels, *y_labels, title or "", xlabel or "", ylabel or ""]):
        if ax is None:
            extra = 1.0 if colorbar else 0.0
            fig = Figure(
                figsize=(side_inches(a.shape[1]) + extra, side_inches(a.shape[0])),
                dpi=DPI,
                layout="constrained",
            )
            ax = fig.add_subplot()
        fig = ax.figure
        # Downsampling (more cells than pixels) with "nearest" could drop a single bright cell.
        pixels = ax.get_position().width * fig.get_figwidth() * fig.dpi
        interpolation = "nearest" if max(a.shape) <= pixels else "antialiased"
        image = ax.imshow(
            np.ma.masked_invalid(a), cmap=cmap, vmin=lo, vmax=hi, aspect="auto", interpolation=interpolation
        )
        kx = label_axis(ax, "x", x_labels)
        ky = label_axis(ax, "y", y_labels)
        if title is not None:
            ax.set_title(title, parse_math=False)
        ax.set_xlabel(axis_title(xlabel, kx) or "", parse_math=False)
        ax.set_ylabel(axis_title(ylabel, ky) or "", parse_math=False)
        ax.tick_params(length=2)
        if annotate:
            _annotate(ax, a, image)
        if colorbar:
            fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    return fig


def save(fig: Figure, path: str | os.PathLike, *, dpi: float | None = None) -> Path:
    """Write ``fig`` to ``path`` (PNG, SVG or PDF by suffix) atomically; returns the path.

    The pixel size of a PNG is the figure size times ``dpi`` (default: the figure's, 100).
    """
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise ProbeError(f"cannot save a figure as {path.name!r}: use a .png, .svg or .pdf file name")
    # No timestamps, so the same figure gives the same file.
    metadata = {"svg": {"Date": None}, "pdf": {"CreationDate": None, "ModDate": None}}.get(fmt)
    with fonts.quiet_missing_glyphs(), atomic_path(path) as tmp:
        fig.savefig(tmp, format=fmt, dpi=dpi or fig.dpi, metadata=metadata)
    return path
