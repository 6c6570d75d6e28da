"""Statistics that mean something for images (issue 30, item 4): the mass on class and register
tokens, the share of a word's attention that lands on the picture, and artifact patches.

Oracles: HF eager ``output_attentions`` / ``output_hidden_states`` of the same weights, reduced by
loops written here; never probe's own output.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf
from test_images import SMALL, _llava, _pair

import probe
from probe.errors import ProbeError

tf.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def dino_run():
    # [CLS], two registers, then 2 x 3 patches; two pictures
    cfg = tf.Dinov2WithRegistersConfig(**SMALL, image_size=28, patch_size=14, num_register_tokens=2)
    model, eager = _pair(tf.Dinov2WithRegistersModel, cfg)
    x = torch.randn(2, 3, 28, 42, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = eager(pixel_values=x, output_attentions=True, output_hidden_states=True)
    return model, x, probe.capture(model, {"pixel_values": x}), out


def test_mass_on_class_and_register_tokens_against_a_loop(dino_run):
    _, _, cache, out = dino_run
    rows = {(r["layer"], r["head"]): r for r in probe.head_stats(cache, progress=False).table}
    T = 9
    for layer in range(2):
        for head in range(4):
            on_cls, on_reg = [], []
            for b in range(2):
                w = out.attentions[layer][b, head].double()
                on_cls.append(sum(float(w[i, 0]) for i in range(T)) / T)  # every query counts
                on_reg.append(sum(float(w[i, 1] + w[i, 2]) for i in range(T)) / T)
            row = rows[(layer, head)]
            assert abs(row["on_class"] - sum(on_cls) / 2) < 1e-5
            assert abs(row["on_register"] - sum(on_reg) / 2) < 1e-5
            assert math.isnan(row["on_image"])  # no text beside the picture


@pytest.fixture(scope="module")
def llava_run():
    """A LLaVA-shaped model, its eager twin, a text holding two pictures and its capture."""
    model, eager = _llava()
    ids = torch.tensor([[1, 5] + [95] * 16 + [7] + [95] * 16 + [8, 9]])
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    inputs = {"input_ids": ids, "pixel_values": pixels, "attention_mask": torch.ones_like(ids)}
    return model, eager, inputs, probe.capture(model, inputs)


def test_on_image_is_the_share_of_text_attention_on_the_picture(llava_run):
    # ids: text 0-1, image 2-17, text 18, image 19-34, text 35-36; the language model is causal,
    # so text 0 and 1 read no image and are left out
    model, eager, inputs, cache = llava_run
    with torch.no_grad():
        want = eager(**inputs, output_attentions=True).attentions
    image = [j for j in range(37) if 2 <= j <= 17 or 19 <= j <= 34]
    lm = "model.language_model.layers"
    stats = probe.head_stats(cache, progress=False)
    rows = {(r["stack"], r["layer"], r["head"]): r for r in stats.table}
    for layer in range(2):
        for head in range(4):
            w = want[layer][0, head].double()
            expect = sum(sum(float(w[i, j]) for j in image) for i in (18, 35, 36)) / 3
            row = rows[(lm, layer, head)]
            assert abs(row["on_image"] - expect) < 1e-5
            assert math.isnan(row["on_class"]) and math.isnan(row["on_register"])
    # the vision tower has a class token ([CLS] + 4 x 4 patches) and no text
    tower = "model.vision_tower.encoder.layers"
    assert all(rows[(tower, layer, h)]["on_class"] >= 0 for layer in range(2) for h in range(4))
    # kept rows: the last position only, the same definition over that one row
    kept = probe.capture(model, inputs, keep={"rows": [-1]})
    krows = {(r["stack"], r["layer"], r["head"]): r for r in probe.head_stats(kept, progress=False).table}
    for layer in range(2):
        for head in range(4):
            w = want[layer][0, head].double()
            expect = sum(float(w[36, j]) for j in image)
            assert abs(krows[(lm, layer, head)]["on_image"] - expect) < 1e-5
    # statistics computed while the model runs do not know the positions yet: they say so
    streamed = probe.head_stats(model, inputs, progress=False)
    assert all(math.isnan(r["on_image"]) for r in streamed.table)
    assert "image grid" in streamed.not_computed["on_image"]


def test_artifact_patches_against_a_loop(dino_run):
    _, _, cache, out = dino_run
    T, patches = 9, range(3, 9)
    expect = {}
    for layer in range(2):
        for b in range(2):
            w = out.attentions[layer][b].double()  # [heads, T, T]; every query sees every key
            norms = out.hidden_states[layer + 1][b].double().norm(dim=-1)  # leaving layer `layer`
            median = float(norms[3:9].median())
            for p in patches:
                received = sum(float(w[h, i, p]) * T for h in range(4) for i in range(T)) / (4 * T)
                expect[(layer, b, p)] = (received, float(norms[p]), float(norms[p]) / median)
    found = probe.artifacts(cache, received_min=1.0, norm_min=1.0)
    assert len(found.table) == 2 * 2 * 6
    for r in found.table:
        received, norm, ratio = expect[(r["layer"], r["batch"], r["pos"])]
        assert abs(r["received"] - received) < 1e-4 and abs(r["norm"] - norm) < 1e-3 * norm
        assert abs(r["norm_ratio"] - ratio) < 1e-5
        assert r["artifact"] == (received >= 1.0 and ratio >= 1.0)
        assert (r["row"], r["col"]) == divmod(r["pos"] - 3, 3) and r[
            "label"
        ] == f"patch ({r['row']}, {r['col']})"
    flagged = {(k[0], k[1], k[2]) for k, v in expect.items() if v[0] >= 1.0 and v[2] >= 1.0}
    assert {(r["layer"], r["batch"], r["pos"]) for r in found.found} == flagged and flagged
    layer, b = next(iter(flagged))[:2]
    assert set(found.positions(layer, batch=b)) == {
        divmod(p - 3, 3) for (ly, bb, p) in flagged if (ly, bb) == (layer, b)
    }
    # the paper's thresholds on a random model: its patches are not artifacts
    assert len(probe.artifacts(cache).found) == 0
    assert "received >= 5x uniform and norm >= 2x median" in repr(probe.artifacts(cache, 1))


def test_artifacts_need_the_residual_stream(dino_run):
    from probe.cache.cache import Cache

    cache = dino_run[2]
    patterns_only = Cache({k: cache[k] for k in cache.keys() if "resid" not in k}, cache.metadata)
    with pytest.raises(ProbeError, match="no residual stream for encoder layer 0"):
        probe.artifacts(patterns_only)


def test_artifact_patches_are_outlined_in_the_figure_and_named_in_the_report(dino_run, tmp_path):
    from matplotlib.patches import Rectangle

    cache = dino_run[2]
    found = probe.artifacts(cache, received_min=1.0, norm_min=1.0)
    fig = probe.plot.image_layers(cache, batch=1, artifacts=found)
    per_layer = [len(found.positions(layer, batch=1)) for layer in range(2)]
    outlined = [sum(isinstance(p, Rectangle) for p in ax.patches) for ax in fig.axes[:2]]
    assert outlined == per_layer and sum(per_layer) > 0
    # the report's picture section says what the default thresholds find (none, in a random model)
    page = probe.report(cache, tmp_path / "r", progress=False).read_text(encoding="utf-8")
    assert "Artifact patches (Darcet et al. 2024): no artifact patches (receiving at least 5x" in page


def test_artifacts_of_a_vision_language_models_tower_per_picture(llava_run):
    model, eager, inputs, cache = llava_run
    with torch.no_grad():
        pixels = inputs["pixel_values"]
        tower = eager.model.vision_tower(pixels, output_attentions=True, output_hidden_states=True)
    found = probe.artifacts(cache, 1, stack="model.vision_tower.encoder.layers", received_min=0, norm_min=0)
    assert {r["batch"] for r in found.table} == {0, 1} and len(found.table) == 2 * 16
    for r in found.table:  # the tower's one sequence per picture: [CLS] + 4 x 4, none padded
        w = tower.attentions[1][r["batch"]].double()
        received = float(w[:, :, r["pos"]].sum()) * 17 / (4 * 17)
        norm = float(tower.hidden_states[2][r["batch"], r["pos"]].norm())
        assert abs(r["received"] - received) < 1e-4 and abs(r["norm"] - norm) < 1e-3 * norm
