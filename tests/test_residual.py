"""probe.residual: |E|, |ΔE|, ratio and cos(ΔE, E) per layer, sublayer and token, against hand
computations (a cache built by hand with Pythagorean vectors) and against hooks on minigpt's own
sublayers; layers without deltas; the CLI; the report section on a stand-in context."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import models
import probe
from probe.cache import Cache

TEXT = "attention lets tokens read"


def _hand_cache() -> Cache:
    """Layer 0: E = (3, 4, 0); attention writes (0, 0, 12), the MLP then writes -(3, 4, 12)/2.
    Layer 1: only resid_pre/resid_post (no deltas, as a capture that could not split the layer).
    Two texts, the second one token shorter (its position 1 is padding)."""
    E = torch.tensor([3.0, 4.0, 0.0])
    a = torch.tensor([0.0, 0.0, 12.0])
    m = -(E + a) / 2
    pre = torch.stack([torch.stack([E, 2 * E]), torch.stack([E, 100 * E])])  # (2, 2, 3)
    att = torch.stack([torch.stack([a, a]), torch.stack([a, a])])
    mlp = torch.stack([torch.stack([m, m]), torch.stack([m, m])])
    post0 = pre + att + mlp
    post1 = post0 * 2
    tensors = {
        "decoder.blocks.0.resid_pre": pre,
        "decoder.blocks.0.self_attn.delta": att,
        "decoder.blocks.0.mlp.delta": mlp,
        "decoder.blocks.0.resid_post": post0,
        "decoder.blocks.1.resid_pre": post0,
        "decoder.blocks.1.resid_post": post1,
    }
    meta = {
        "tokens": [["x", "y"], ["z", "<pad>"]],
        "attention_mask": [[1, 1], [1, 0]],
        "layers": [
            {"stack": "decoder", "layer": 0},
            {"stack": "decoder", "layer": 1, "residual_note": "deltas not separable here"},
        ],
        "stacks": {"decoder": {"layers": 2}},
    }
    return Cache(tensors, meta)


def test_norms_ratio_and_cosine_by_hand():
    stats = probe.residual(_hand_cache())
    rows = {(r["layer"], r["sublayer"], r["batch"], r["pos"]): r for r in stats.tokens}
    # padding is left out: 3 real tokens x (2 sublayers in layer 0 + 1 whole-layer row in layer 1)
    assert len(stats.tokens) == 9 and (0, "self_attn", 1, 1) not in rows
    r = rows[(0, "self_attn", 0, 0)]  # |E| = 5, |ΔE| = 12, ΔE ⟂ E
    assert r["norm_E"] == pytest.approx(5.0) and r["norm_dE"] == pytest.approx(12.0)
    assert r["ratio"] == pytest.approx(12 / 5) and r["cos"] == pytest.approx(0.0, abs=1e-7)
    assert r["writes_most"] is True
    r = rows[(0, "mlp", 0, 0)]  # E = (3, 4, 12): |E| = 13, ΔE = -E/2: |ΔE| = 6.5, cos = -1
    assert r["norm_E"] == pytest.approx(13.0) and r["norm_dE"] == pytest.approx(6.5)
    assert r["ratio"] == pytest.approx(0.5) and r["cos"] == pytest.approx(-1.0)
    assert r["writes_most"] is False
    r = rows[(0, "self_attn", 0, 1)]  # E = (6, 8, 0): |E| = 10, cos(ΔE, E) = 0
    assert r["norm_E"] == pytest.approx(10.0) and r["ratio"] == pytest.approx(1.2)
    agg = {(r["layer"], r["sublayer"]): r for r in stats.layers}
    # mean over the 3 real tokens of |E| for attention: (5 + 10 + 5) / 3
    assert agg[(0, "self_attn")]["mean_norm_E"] == pytest.approx(20 / 3)
    assert agg[(0, "self_attn")]["writes_most_share"] == pytest.approx(1.0)
    assert agg[(0, "self_attn")]["tokens"] == 3


def test_layer_without_deltas_is_one_whole_layer_row_with_a_note():
    stats = probe.residual(_hand_cache())
    whole = [r for r in stats.tokens if r["layer"] == 1]
    assert {r["sublayer"] for r in whole} == {"layer"}
    # resid_post = 2 * resid_pre, so ΔE = E: ratio 1, cos 1
    assert all(r["ratio"] == pytest.approx(1.0) and r["cos"] == pytest.approx(1.0) for r in whole)
    assert any("layer 1" in n and "deltas not separable here" in n for n in stats.notes)


def test_minigpt_against_hooks_on_its_sublayers():
    model = models.load("minigpt")
    seen = {}

    def keep(name):
        def hook(mod, args, out):
            seen[name] = (args[0].detach().clone(), out.detach().clone())

        return hook

    handles = []
    for i, block in enumerate(model.blocks):
        handles.append(block.attn.register_forward_hook(keep(f"attn{i}")))
        handles.append(block.ffwd.register_forward_hook(keep(f"mlp{i}")))
        handles.append(block.register_forward_hook(keep(f"block{i}")))
    cache = probe.capture(model, TEXT)
    for h in handles:
        h.remove()
    stats = probe.residual(cache)
    rows = {(r["layer"], r["sublayer"], r["pos"]): r for r in stats.tokens}
    for i in range(2):
        E0 = seen[f"block{i}"][0][0].double()  # the block's input: the stream attention writes into
        dA = seen[f"attn{i}"][1][0].double()
        dM = seen[f"mlp{i}"][1][0].double()
        for sub, E, d in (("self_attn", E0, dA), ("mlp", E0 + dA, dM)):
            for t in (0, 7, len(TEXT) - 1):
                r = rows[(i, sub, t)]
                nE = math.sqrt(sum(x * x for x in E[t].tolist()))
                nD = math.sqrt(sum(x * x for x in d[t].tolist()))
                cos = sum(a * b for a, b in zip(E[t].tolist(), d[t].tolist(), strict=True)) / (nE * nD)
                assert r["norm_E"] == pytest.approx(nE, rel=1e-5)
                assert r["norm_dE"] == pytest.approx(nD, rel=1e-5)
                assert r["cos"] == pytest.approx(cos, abs=1e-5)
                assert r["writes_most"] == (nD >= (dA if sub == "mlp" else dM)[t].norm().item())


def test_exports_round_trip(tmp_path):
    stats = probe.residual(_hand_cache())
    d = json.loads(stats.to_json())
    assert len(d["rows"]) == len(stats.layers) == 3
    assert stats.tokens.to_csv().count("\n") == len(stats.tokens) + 1
    assert "<table>" in stats._repr_html_() and "note:" in stats._repr_html_()
    stats.to_csv(tmp_path / "r.csv")
    assert (tmp_path / "r.csv").read_text().startswith("stack,layer,sublayer")


def test_cache_without_residuals_is_a_clear_error():
    c = Cache({"decoder.blocks.0.self_attn.pattern": torch.ones(1, 1, 2, 2)}, {})
    with pytest.raises(probe.ProbeError, match="no residual stream"):
        probe.residual(c)


def run(*args):
    return subprocess.run([sys.executable, "-m", "probe", *args], capture_output=True, text=True, timeout=300)


def test_cli_residual(tmp_path):
    path = tmp_path / "run.safetensors"
    probe.capture(models.load("minigpt"), TEXT, out=path)
    r = run("residual", str(path), "--csv", str(tmp_path / "r.csv"))
    assert r.returncode == 0, r.stderr
    assert "mean_norm_dE" in r.stdout and "mlp" in r.stdout
    assert (tmp_path / "r.csv").read_text().count("\n") == 5  # header + 2 layers x 2 sublayers
    r = run("residual", str(tmp_path / "missing.safetensors"))
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr


# -- the report section, through the report host (REPORT_CONTRACT) ---------------------------
def _section(path: Path) -> str:
    html = path.read_text()
    start = html.index("Residual stream and anatomy</h2>")
    return html[start : html.index("</section>", start)]


def test_report_without_model_shows_norms_only(tmp_path):
    model = models.load("minigpt")
    html = _section(probe.report(probe.capture(model, TEXT), tmp_path, progress=False))
    assert "data:image/png;base64," in html and "mean_norm_dE" in html
    assert "Logit lens" not in html and "Parameter budget" not in html


def test_report_with_minigpt_shows_lens_attribution_and_budget(tmp_path):
    model = models.load("minigpt")
    cache = probe.capture(model, TEXT)
    html = _section(probe.report(cache, tmp_path, model=model, tokenizer=model.tokenizer, progress=False))
    assert "Logit lens" in html and "Direct logit attribution" in html and "Parameter budget" in html
    # the grid's bottom row is the model's own prediction at every position
    final_row = html[html.index("<th>final</th>") :].split("</tr>")[0]
    assert final_row.count("<b>") == len(TEXT)
    from probe.report.labels import display  # tokens shown as everywhere in probe (␣ for a space)

    pred = [display(model.tokenizer.decode([i]), None) for i in _argmax(model, TEXT)]
    assert final_row.replace("<td><b>", "|").replace("</b></td>", "").split("|")[1:] == pred
    assert html.count("<details") >= len(TEXT) + 1  # one attribution per position, and the table
    assert "104,598 parameters" in html
    assert "http://" not in html and "https://" not in html


@pytest.mark.slow  # about 12 s on two cores: CI's slow job runs it (the default pytest keeps to ~15 min)
def test_report_with_translator(tmp_path):
    model = models.load("translator")
    cache = probe.capture(model, "ich mochte ein bier", target="S i want a beer")
    html = _section(probe.report(cache, tmp_path, model=model, tokenizer=model.tokenizer, progress=False))
    assert "cross_attn" in html and "Logit lens" in html and "44,165,632 parameters" in html
    assert "not split by head" in html  # post-norm: the deltas include a LayerNorm, and it says so


def _argmax(model, text):
    ids = torch.tensor([model.tokenizer.encode(text)])
    with torch.no_grad():
        return model(ids)[0][0].argmax(-1).tolist()
