"""probe.plot: figures read back (image arrays, tick labels, lines, pixels) against the cache's tensors."""

from __future__ import annotations

import re
import warnings

import matplotlib as mpl
import matplotlib.image as mpimg
import numpy as np
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

import models
import probe
from probe import plot
from probe.report import fonts, seeds

SRC = [["ich", "mochte", "ein", "bier"], ["注意", "力"]]
TGT = [["S", "i", "want"], ["S", "啤酒"]]


@pytest.fixture(scope="module")
def gpt_cache():
    """minigpt on two texts; the second is right-padded from 5 to 21 positions."""
    return probe.capture(models.load("minigpt"), ["attention lets tokens", "read."])


@pytest.fixture(scope="module")
def seq_cache():
    """A hand-made encoder-decoder cache (random weights, padding in row 1, CJK tokens)."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "encoder.blocks.0.self_attn.pattern": torch.rand(2, 2, 4, 4, generator=g),
        "decoder.blocks.0.self_attn.pattern": torch.rand(2, 2, 3, 3, generator=g),
        "decoder.blocks.0.cross_attn.pattern": torch.rand(2, 2, 3, 4, generator=g),
    }
    meta = {
        "tokens": SRC,
        "attention_mask": [[1, 1, 1, 1], [1, 1, 0, 0]],
        "target_tokens": TGT,
        "target_attention_mask": [[1, 1, 1], [1, 1, 0]],
    }
    return probe.Cache(tensors, meta)


def image(fig: Figure, i: int = 0) -> np.ma.MaskedArray:
    return fig.axes[i].images[0].get_array()


def ticks(axis) -> list[str]:
    return [t.get_text() for t in axis.get_ticklabels()]


def test_heatmap_title_labels_and_every_cell(gpt_cache):
    fig = plot.heatmap(gpt_cache, 1, 2)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert ax.get_title() == "Layer 1, Head 2"  # 0-based arguments and titles, as cache.pattern
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("Key", "Query")
    shown = [t if t != " " else "␣" for t in "attention lets tokens"]
    assert ticks(ax.xaxis) == shown and ticks(ax.yaxis) == shown
    assert len(fig.axes) == 2  # the colour bar
    img = image(fig)
    assert not np.ma.is_masked(img)  # the upper triangle is drawn like every other cell
    np.testing.assert_array_equal(img.data, gpt_cache["decoder.blocks.1.self_attn.pattern"][0, 2].numpy())


def test_upper_triangle_leak_is_drawn():
    w = torch.softmax(torch.randn(1, 1, 6, 6), -1)  # no mask: weight above the diagonal
    cache = probe.Cache({"decoder.blocks.0.self_attn.pattern": w}, {"tokens": [list("abcdef")]})
    fig = plot.heatmap(cache, 0)
    img = image(fig)
    np.testing.assert_array_equal(img.data, w[0, 0].numpy())
    assert not np.ma.is_masked(img)
    im = fig.axes[0].images[0]
    assert im.norm.vmin == 0.0 and im.norm.vmax == pytest.approx(float(w.max()))


def test_padding_is_cropped(gpt_cache):
    fig = plot.heatmap(gpt_cache, 0, 1, batch=1)
    np.testing.assert_array_equal(
        image(fig).data, gpt_cache["decoder.blocks.0.self_attn.pattern"][1, 1, :5, :5]
    )
    assert ticks(fig.axes[0].xaxis) == list("read.")
    # left padding: the real positions are the last three
    w = torch.rand(1, 1, 5, 5)
    meta = {"tokens": [["x", "y", "z"]], "attention_mask": [[0, 0, 1, 1, 1]]}
    fig = plot.heatmap(probe.Cache({"decoder.blocks.0.self_attn.pattern": w}, meta), 0)
    np.testing.assert_array_equal(image(fig).data, w[0, 0, 2:, 2:])
    assert ticks(fig.axes[0].yaxis) == ["x", "y", "z"]


def test_cross_is_rectangular_target_over_source(seq_cache):
    fig = plot.cross(seq_cache, 0, head=1, batch=1)
    ax = fig.axes[0]
    assert ax.get_title() == "Decoder cross-attention, Layer 0, Head 1"
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("Source (keys)", "Target (queries)")
    # CJK key labels are stacked a character a line (upright), never rotated onto their side
    assert ticks(ax.xaxis) == ["注\n意", "力"] and ticks(ax.yaxis) == TGT[1]
    assert {t.get_rotation() for t in ax.xaxis.get_ticklabels()} == {0.0}
    np.testing.assert_array_equal(
        image(fig).data, seq_cache["decoder.blocks.0.cross_attn.pattern"][1, 1, :2, :2]
    )
    fig = plot.cross(seq_cache, 0, head=0, batch=0)
    np.testing.assert_array_equal(image(fig).data, seq_cache["decoder.blocks.0.cross_attn.pattern"][0, 0])
    enc = plot.heatmap(seq_cache, 0, 1, stack="encoder")
    assert enc.axes[0].get_title() == "Encoder self-attention, Layer 0, Head 1"
    assert ticks(enc.axes[0].xaxis) == SRC[0]
    assert {t.get_rotation() for t in enc.axes[0].xaxis.get_ticklabels()} == {90.0}  # Latin: rotated
    dec = plot.heatmap(seq_cache, 0)  # the decoder by default: target tokens on both axes
    assert ticks(dec.axes[0].xaxis) == TGT[0]


def test_bad_requests_are_probe_errors(gpt_cache, seq_cache):
    with pytest.raises(probe.ProbeError, match=r"layer 7 .* has layers \[0, 1\]"):
        plot.heatmap(gpt_cache, 7)
    with pytest.raises(probe.ProbeError, match="head 9"):
        plot.heatmap(gpt_cache, 0, 9)
    with pytest.raises(probe.ProbeError, match="batch 2 is out of range"):
        plot.heatmap(gpt_cache, 0, batch=2)
    with pytest.raises(probe.ProbeError, match="no cross-attention"):
        plot.cross(gpt_cache, 0)
    with pytest.raises(probe.ProbeError, match="queries \\[30\\]"):
        plot.over_time(gpt_cache, 0, 0, queries=[30])
    with pytest.raises(probe.ProbeError, match="labels do not match"):
        plot.matrix(np.zeros((2, 3)), ["a", "b"], ["c", "d"])


def test_captured_head_subset_keeps_model_head_numbers():
    w = torch.rand(1, 2, 3, 3)
    meta = {"tokens": [["a", "b", "c"]], "heads_captured": [1, 3]}
    cache = probe.Cache({"decoder.blocks.4.self_attn.pattern": w}, meta)
    fig = plot.heatmap(cache, 4, 3)
    assert fig.axes[0].get_title() == "Layer 4, Head 3"
    np.testing.assert_array_equal(image(fig).data, w[0, 1])
    with pytest.raises(probe.ProbeError, match=r"has heads \[1, 3\]"):
        plot.heatmap(cache, 4, 0)


def _cells(grid: np.ndarray) -> list[list[np.ndarray]]:
    """Split an overview image into its cells at the all-blank (NaN) separator rows and columns."""

    def runs(blank):
        edges = np.flatnonzero(np.diff(np.r_[1, blank.astype(int), 1]))
        return list(zip(edges[::2], edges[1::2], strict=True))

    rows, cols = runs(np.isnan(grid).all(1)), runs(np.isnan(grid).all(0))
    return [[grid[a:b, c:d] for c, d in cols] for a, b in rows]


def test_overview_grid(gpt_cache):
    fig = plot.overview(gpt_cache, batch=1)
    ax = fig.axes[0]
    assert len(fig.axes) == 2  # one image and its colour bar
    assert ticks(ax.xaxis) == ["H0", "H1", "H2", "H3"] and ticks(ax.yaxis) == ["L0", "L1"]
    cells = _cells(image(fig).filled(np.nan))
    assert [len(row) for row in cells] == [4, 4]
    for r in range(2):
        for h in range(4):
            w = gpt_cache[f"decoder.blocks.{r}.self_attn.pattern"][1, h, :5, :5].numpy()
            np.testing.assert_allclose(cells[r][h], w / w.max(), rtol=1e-6)  # each head to its max
    shared = plot.overview(gpt_cache, scale="shared")
    w = gpt_cache["decoder.blocks.1.self_attn.pattern"][0, 3].numpy()
    np.testing.assert_array_equal(_cells(image(shared).filled(np.nan))[1][3], w)


def test_overview_pools_long_inputs_by_block_maximum():
    T = 40
    w = torch.full((1, 1, T, T), 0.01)
    w[0, 0, 17, 33] = 0.9  # one strong weight, above the diagonal
    cache = probe.Cache(
        {f"decoder.blocks.{i}.self_attn.pattern": w for i in range(2)}, {"tokens": [["x"] * T]}
    )
    fig = plot.overview(cache, scale="shared", max_pixels=20)  # 10 pixels per cell: 4x4 blocks
    assert "max of 4×4 weights" in fig.axes[0].get_title()
    cell = _cells(image(fig).filled(np.nan))[1][0]
    want = np.full((10, 10), 0.01, dtype=np.float32)
    want[17 // 4, 33 // 4] = 0.9
    np.testing.assert_array_equal(cell, want)


def test_over_time_lines_are_query_rows(gpt_cache):
    fig = plot.over_time(gpt_cache, 1, 0, queries=[0, 4, 20])
    ax = fig.axes[0]
    w = gpt_cache["decoder.blocks.1.self_attn.pattern"][0, 0].numpy()
    for line, q in zip(ax.get_lines(), [0, 4, 20], strict=True):
        np.testing.assert_array_equal(line.get_ydata(), w[q])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "Query t=0: a",
        "Query t=4: n",
        "Query t=20: s",
    ]
    assert ax.get_xlabel() == "Key position"
    default = plot.over_time(gpt_cache, 0, 0)
    assert len(default.axes[0].get_lines()) == 8  # evenly spaced rows by default


def test_residual_norms_oracle(gpt_cache):
    fig = plot.residual_norms(gpt_cache, batch=1)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {
        "|E| entering the layer",
        "|E| leaving the layer",
        "|ΔE| self-attention",
        "|ΔE| MLP",
    }
    for label, name in [("|E| entering the layer", "resid_pre"), ("|ΔE| MLP", "mlp.delta")]:
        # oracle: L2 over d_model of the 5 real tokens of text 1, averaged
        want = [
            torch.linalg.vector_norm(gpt_cache[f"decoder.blocks.{i}.{name}"][1, :5], dim=-1).mean()
            for i in (0, 1)
        ]
        np.testing.assert_allclose(lines[label].get_ydata(), torch.stack(want).numpy(), rtol=1e-6)
        np.testing.assert_array_equal(lines[label].get_xdata(), [0, 1])  # layers from 0


def test_long_inputs_thin_their_labels(tmp_path):
    T = 512
    toks = [f"t{i}" for i in range(T)]
    w = torch.softmax(torch.randn(1, 1, T, T), -1)
    fig = plot.heatmap(probe.Cache({"decoder.blocks.0.self_attn.pattern": w}, {"tokens": [toks]}), 0)
    ax = fig.axes[0]
    xs = ticks(ax.xaxis)
    k = T // len(xs) if T % len(xs) == 0 else T // len(xs) + 1
    assert 1 < k < 10 and xs == toks[::k]  # every k-th token, still dense enough to read
    assert ax.get_xlabel() == f"Key (every {k}{ {2: 'nd', 3: 'rd'}.get(k, 'th') } label shown)"
    sizes = {t.get_fontsize() for t in ax.xaxis.get_ticklabels()}
    assert sizes == {6.0}
    np.testing.assert_array_equal(image(fig).data, w[0, 0])
    out = plot.save(fig, tmp_path / "long.png")
    h, wpx = mpimg.imread(out).shape[:2]
    assert (wpx, h) == (1300, 1200)


def test_save_png_svg_pdf(gpt_cache, tmp_path):
    fig = plot.heatmap(gpt_cache, 0)
    w_in, h_in = fig.get_size_inches()
    png = plot.save(fig, tmp_path / "f.png")
    assert mpimg.imread(png).shape[:2] == (round(h_in * 100), round(w_in * 100)) == (552, 652)
    assert mpimg.imread(plot.save(fig, tmp_path / "f2.png", dpi=200)).shape[:2] == (1104, 1304)
    svg = plot.save(fig, tmp_path / "f.svg").read_text()
    m = re.search(r'<svg[^>]* width="([\d.]+)pt" height="([\d.]+)pt"', svg)
    assert (float(m[1]), float(m[2])) == pytest.approx((w_in * 72, h_in * 72))
    assert "<dc:date>" not in svg  # reproducible files
    assert plot.save(fig, tmp_path / "f.pdf").read_bytes()[:5] == b"%PDF-"
    with pytest.raises(probe.ProbeError, match=r"\.png, \.svg or \.pdf"):
        plot.save(fig, tmp_path / "f.jpeg")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "f.pdf",
        "f.png",
        "f.svg",
        "f2.png",
    ]  # no temp files


def test_matrix_annotate_and_axes_given():
    vals = np.array([[0.1, 0.9], [0.5, np.nan]])
    fig = Figure()
    ax = fig.add_subplot()
    assert plot.matrix(vals, ["a", "b"], ["c", "d"], ax=ax, annotate=True, title="$x$ 注意") is fig
    assert ax.get_title() == "$x$ 注意"
    assert sorted(t.get_text() for t in ax.texts) == ["0.10", "0.50", "0.90"]  # NaN stays blank
    assert image(fig).mask.tolist() == [[False, False], [False, True]]


def test_no_global_state_leaks(gpt_cache):
    import matplotlib.pyplot as plt

    before = (list(mpl.rcParams["font.family"]), plt.get_fignums())
    plot.heatmap(gpt_cache, 0)
    plot.overview(gpt_cache)
    assert (list(mpl.rcParams["font.family"]), plt.get_fignums()) == before


def _glyph_bitmaps(props, chars: str) -> list[np.ndarray]:
    """Each char drawn alone with font properties ``props`` at the same spot: same glyph, same pixels."""
    out = []
    for ch in chars:
        fig = Figure(figsize=(0.4, 0.4), dpi=100)
        fig.text(0.1, 0.2, ch, fontproperties=props, fontsize=20)
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        out.append(np.asarray(canvas.buffer_rgba())[..., :3].copy())
    return out


def test_cjk_labels_render_with_real_glyphs(seq_cache, tmp_path):
    font = fonts.cjk_font()
    assert font is not None, f"no CJK font: {fonts.INSTALL_HINT}"  # CI installs it; never skipped
    from matplotlib.ft2font import FT2Font

    assert all(FT2Font(font.path).get_char_index(ord(c)) != 0 for c in "注意力啤酒")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns "Glyph ... missing from font" for a box
        fig = plot.matrix(np.eye(3), ["注", "意", "力"], ["a", "b", "c"])
        plot.save(fig, tmp_path / "cjk.png")  # saved outside the figure function: fallback kept
        plot.save(plot.cross(seq_cache, 0, batch=1), tmp_path / "cross.svg")
        label = fig.axes[0].get_xticklabels()[0]
        assert font.name in label.get_fontfamily()
        a, b, c = _glyph_bitmaps(label.get_fontproperties(), "注意力")
    assert all((g < 128).any() for g in (a, b, c))  # ink
    assert not np.array_equal(a, b) and not np.array_equal(b, c)  # three glyphs, not one box
    # the oracle's own check: without the fallback, two CJK characters draw the same missing-glyph box
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p, q = _glyph_bitmaps(mpl.font_manager.FontProperties(family=["DejaVu Sans"]), "注意")
    assert np.array_equal(p, q)


def test_no_cjk_font_warns_once_and_still_renders(monkeypatch, tmp_path, seq_cache):
    monkeypatch.setattr(fonts, "cjk_font", lambda: None)
    monkeypatch.setattr(fonts, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plot.heatmap(seq_cache, 0, stack="encoder")  # Latin tokens only: nothing to warn about
        assert caught == []
        p1 = plot.save(plot.cross(seq_cache, 0, batch=1), tmp_path / "a.png")
        p2 = plot.save(plot.matrix(np.eye(1), ["注"], ["力"]), tmp_path / "b.png")
    assert [str(w.message).count("apt-get install fonts-noto-cjk") for w in caught] == [1]
    assert mpimg.imread(p1).size and mpimg.imread(p2).size


# -- fonts installed after matplotlib built its font cache ----------------------------------------------
_FONT_PROBE = """
import json, sys, warnings
warnings.simplefilter("always")
from matplotlib import font_manager
listed = sorted({e.name for e in font_manager.fontManager.ttflist if "CJK" in e.name})
from probe.report import fonts, seeds
from probe.report.context import figure_uri
from probe import plot
import numpy as np
with warnings.catch_warnings(record=True) as english:
    for _ in range(3):
        figure_uri(plot.matrix(np.eye(2), ["attention", "lets"], ["tokens", "read"]))
with warnings.catch_warnings(record=True) as chinese:
    for _ in range(3):  # the tutorial's figures have Chinese axis labels
        for f in seeds.figures_for(plot.seed_caches(["minigpt"]), names=["minigpt"]):
            figure_uri(f.figure)
        figure_uri(plot.matrix(np.eye(2), ["注意", "力"], ["啤酒", "力"]))
with warnings.catch_warnings(record=True) as rare:
    for _ in range(3):  # a character beyond GB 2312 level 1, and kana
        figure_uri(plot.matrix(np.eye(2), ["龘", "力"], ["ひ", "力"]))
font = fonts.cjk_font()
print(json.dumps({
    "listed_at_start": listed,
    "font": None if font is None else [font.name, font.path, font.bundled],
    "english": [str(w.message) for w in english],
    "chinese": [str(w.message) for w in chinese],
    "rare": [str(w.message) for w in rare],
}))
"""


@pytest.fixture(scope="module")
def stale_mplconfig(tmp_path_factory):
    """An MPLCONFIGDIR whose font cache was built before the CJK fonts were installed: this
    process's font list with every CJK entry removed, written where matplotlib reads its cache."""
    import copy

    from matplotlib import font_manager

    d = tmp_path_factory.mktemp("mplconfig")
    stale = copy.copy(font_manager.fontManager)
    stale.ttflist = [e for e in font_manager.fontManager.ttflist if "CJK" not in e.name]
    font_manager.json_dump(stale, d / f"fontlist-v{font_manager.FontManager.__version__}.json")
    return d


def _font_probe(mplconfig, **env) -> dict:
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FONT_PROBE],
        env={**os.environ, "MPLCONFIGDIR": str(mplconfig), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_fonts_installed_after_matplotlib_built_its_cache_are_found(stale_mplconfig):
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    assert any("Noto Sans CJK" in e.name for e in font_manager.fontManager.ttflist), fonts.INSTALL_HINT

    r = _font_probe(stale_mplconfig)
    assert r["listed_at_start"] == []  # matplotlib read the stale cache: it lists no CJK font
    name, path, bundled = r["font"]
    assert name.startswith("Noto Sans CJK") and not bundled
    assert all(FT2Font(path).get_char_index(ord(c)) != 0 for c in "注意力啤酒")  # real glyphs
    assert r["english"] == [] and r["chinese"] == [] and r["rare"] == []  # nothing to warn about


def test_without_a_system_cjk_font_the_bundled_one_draws_and_only_rare_characters_warn(stale_mplconfig):
    # matplotlib told to ignore the system's fonts: only the font probe ships
    r = _font_probe(stale_mplconfig, MPL_IGNORE_SYSTEM_FONTS="1")
    assert r["font"] == [fonts.BUNDLED_NAME, str(fonts.BUNDLED), True]
    # the tutorial's labels and common Chinese: drawn, no warning at all
    assert r["english"] == [] and r["chinese"] == []
    # characters the subset lacks in 3 figures: probe's one warning naming them and the fix
    assert len(r["rare"]) == 1 and "龘ひ" in r["rare"][0] and fonts.INSTALL_HINT in r["rare"][0], r["rare"]


def test_the_bundled_font_draws_the_tutorial_labels_and_common_chinese():
    from fontTools.ttLib import TTFont

    cmap = TTFont(str(fonts.BUNDLED)).getBestCmap()  # the font file itself, read by fontTools
    labels = [c for c in "Key / 被读取的位置 Query / 当前预测的位置" if fonts.has_cjk(c)]
    assert all(ord(c) in cmap for c in [*labels, *"注意力啤酒的一是了我不人在他有这"])
    assert fonts.bundled_chars() == {chr(c) for c in cmap}
    props = mpl.font_manager.FontProperties(fname=str(fonts.BUNDLED))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns "Glyph ... missing from font" for a box
        a, b, c = _glyph_bitmaps(props, "被读取")
    assert all((g < 128).any() for g in (a, b, c)) and len({x.tobytes() for x in (a, b, c)}) == 3
    bundled = fonts.CJKFont(fonts.BUNDLED_NAME, str(fonts.BUNDLED), bundled=True)
    assert fonts.missing(["被读 x", "龘"], bundled) == "龘"
    assert fonts.missing(["被读 龘"], fonts.CJKFont("Noto Sans CJK SC", "/x.otf")) == ""


def test_a_pages_css_embeds_exactly_its_own_cjk_glyphs():
    import base64
    import io
    import re

    from fontTools.ttLib import TTFont

    assert fonts.css_font_face("attention only") == ""
    css = fonts.css_font_face("<p>被读取的位置 attention 龘 被</p>")
    assert css.startswith('@font-face { font-family: "Probe CJK Fallback"')
    data = base64.b64decode(re.search(r"base64,([A-Za-z0-9+/=]+)\)", css)[1])
    font = TTFont(io.BytesIO(data))
    assert {chr(c) for c in font.getBestCmap() if c > 0x2E80} == set("被读取的位置")  # 龘: not in the subset
    assert len(data) < 20_000


def test_seed_figures_minigpt_and_fused(tmp_path):
    caches = plot.seed_caches(["minigpt", "fused_decoder"])
    figs = seeds.figures_for(caches)
    assert [f.name for f in figs] == [
        "minigpt_layer1_head1",
        "fused_decoder_head0",
        "fused_decoder_over_time",
    ]
    ax = figs[0].figure.axes[0]
    # the tutorial's own title, saying in place which probe layer and head it is
    assert ax.get_title() == (
        "Layer 1, Head 1 attention weights\n(the tutorial counts from 1: probe's layer 0, head 0)"
    )
    assert "被读取的位置 'the position being read'" in figs[0].caption  # the Chinese labels explained
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("Key / 被读取的位置", "Query / 当前预测的位置")
    assert ticks(ax.xaxis) == [t if t != " " else "␣" for t in seeds.MINIGPT_TEXT]
    # the tutorial's printed rows: first row 1, 0, 0, ...; each row sums to 1 over keys <= query
    w = image(figs[0].figure).data
    assert w.shape == (21, 21) and np.allclose(w.sum(1), 1, atol=1e-6) and np.all(np.triu(w, 1) == 0)
    assert figs[1].figure.axes[0].get_title() == "Attention Weights Heatmap (Head 0)"
    assert ticks(figs[1].figure.axes[0].xaxis) == [str(i) for i in range(10)]
    legend = [t.get_text() for t in figs[2].figure.axes[0].get_legend().get_texts()]
    assert legend == [f"Query t={t}: {seeds.FUSED_TEXT[t]}" for t in (0, 2, 4, 6, 8)]
    paths = plot.seed_figures(tmp_path, names=["minigpt"], caches=caches)
    assert [p.name for p in paths] == ["minigpt_layer1_head1.png"] and paths[0].stat().st_size > 5000


def test_seed_figures_translator_layout(seq_cache):
    figs = seeds.figures_for({"translator": seq_cache}, names=["translator"])
    titles = [f.figure.axes[0].get_title() for f in figs]
    assert titles == [
        "Encoder self-attention, Layer 0, Head 0",
        "Decoder self-attention, Layer 0, Head 0",
        "Decoder cross-attention, Layer 0, Head 0",
    ]
    np.testing.assert_array_equal(
        image(figs[2].figure).data, seq_cache["decoder.blocks.0.cross_attn.pattern"][0, 0]
    )
    with pytest.raises(probe.ProbeError, match="no tutorial figures"):
        seeds.figures_for({}, names=["gpt5"])


def test_font_lookup_checks_glyphs_not_names():
    from matplotlib import font_manager

    dejavu = font_manager.findfont("DejaVu Sans")
    assert not fonts.covers(dejavu)  # a Latin font has no glyph for 注
    assert fonts.covers(fonts.cjk_font().path)
    assert fonts.has_cjk("x 注意力") and fonts.has_cjk("ひらがな") and not fonts.has_cjk("attention ␣ é")


def test_import_probe_does_not_load_matplotlib():
    import subprocess
    import sys

    code = (
        "import sys, probe; assert 'seaborn' not in sys.modules; "
        "probe.plot.heatmap; assert 'seaborn' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
