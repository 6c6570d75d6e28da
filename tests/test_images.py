"""Image models: keyword inputs, what each position is, and maps on the patch grid (issue 30, first part).

Oracles: HF eager ``output_attentions`` with the same weights, the layout each model's own code
gives its sequence (written here per family), and maps and rollout computed here from those
eager weights; never probe's own output.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

import probe
from probe.errors import ProbeError

tf.logging.set_verbosity_error()
TOL = 1e-6
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def _pair(cls, cfg):
    torch.manual_seed(0)
    model = cls._from_config(cfg).eval()  # the default implementation (sdpa: no weights returned)
    eager = cls._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    return model, eager


def _eager(eager, **inputs):
    with torch.no_grad():
        return eager(**inputs, output_attentions=True).attentions


def _vit():
    # a non-square picture (32 x 48 pixels, 8-pixel patches: 4 rows, 6 columns), so rows and
    # columns cannot be swapped unnoticed
    return _pair(tf.ViTModel, tf.ViTConfig(**SMALL, image_size=(32, 48), patch_size=8))


@pytest.fixture(scope="module")
def vit_run():
    model, eager = _vit()
    x = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(1))
    return model, x, probe.capture(model, {"pixel_values": x}), _eager(eager, pixel_values=x)


def test_vit_keyword_inputs_are_captured_exactly_and_positions_are_named(vit_run):
    model, x, cache, want = vit_run
    for i in range(2):
        torch.testing.assert_close(cache.pattern("encoder", i), want[i], atol=TOL, rtol=0)
    pos = cache.metadata["stacks"]["encoder"]["positions"]
    assert pos["grid"] == {"rows": 4, "cols": 6, "patch": [8, 8], "image": [32, 48], "offset": 1}
    assert pos["kinds"] == ["class"] + ["patch"] * 24
    assert cache.tokens[1][:3] == ["[CLS]", "patch (0, 0)", "patch (0, 1)"]
    assert cache.tokens[1][7] == "patch (1, 0)"  # row-major: the 7th patch starts row 1
    assert cache.metadata["input_kind"] == "inputs" and cache.metadata["image_shape"] == [2, 3, 32, 48]
    # a processor's BatchFeature is taken as it is
    again = probe.capture(model, tf.BatchFeature({"pixel_values": x}))
    torch.testing.assert_close(again.pattern("encoder", 1), want[1], atol=TOL, rtol=0)


def test_attention_map_lays_a_query_on_the_grid(vit_run):
    _, _, cache, want = vit_run
    w = want[1][1]  # layer 1, image 1: [head, 25, 25]
    got = probe.attention_map(cache, 1, query="cls", batch=1)
    torch.testing.assert_close(got, w[:, 0, 1:].mean(0).reshape(4, 6), atol=TOL, rtol=0)
    got = probe.attention_map(cache, 1, head=2, query=(3, 5), batch=1)
    torch.testing.assert_close(got, w[2, 1 + 3 * 6 + 5, 1:].reshape(4, 6), atol=TOL, rtol=0)
    # by hand: the weight of patch (r, c) is column 1 + 6 r + c
    got = probe.attention_map(cache, 0, head=0, query=4)
    for r in range(4):
        for c in range(6):
            assert abs(float(got[r, c]) - float(want[0][0, 0, 4, 1 + 6 * r + c])) <= TOL


def test_rollout_against_a_loop_written_here(vit_run):
    _, _, cache, want = vit_run
    T = 25
    joint = torch.eye(T, dtype=torch.float64)
    for layer in range(2):
        a = want[layer][0].double().mean(0)
        a = (a + torch.eye(T, dtype=torch.float64)) / 2
        a = a / a.sum(-1, keepdim=True)
        joint = a @ joint
    got = probe.attention_map(cache, 1, query="rollout")
    torch.testing.assert_close(got, joint[0, 1:].float().reshape(4, 6), atol=1e-6, rtol=0)


def test_registers_and_distillation_tokens_are_named():
    # DINOv2 with registers: [CLS], the registers, then the patches (its embeddings' own order)
    cfg = tf.Dinov2WithRegistersConfig(**SMALL, image_size=28, patch_size=14, num_register_tokens=2)
    model, eager = _pair(tf.Dinov2WithRegistersModel, cfg)
    x = torch.randn(1, 3, 28, 42)  # 2 x 3 patches (its position embeddings interpolate)
    cache = probe.capture(model, {"pixel_values": x})
    for i, w in enumerate(_eager(eager, pixel_values=x)):
        torch.testing.assert_close(cache.pattern("encoder", i), w, atol=TOL, rtol=0)
    assert cache.tokens[0][:4] == ["[CLS]", "reg 0", "reg 1", "patch (0, 0)"]
    pos = cache.metadata["stacks"]["encoder"]["positions"]
    assert pos["kinds"][:3] == ["class", "register", "register"] and pos["grid"]["offset"] == 3
    assert (pos["grid"]["rows"], pos["grid"]["cols"]) == (2, 3)
    # DeiT: [CLS], the distillation token, then the patches
    model, eager = _pair(tf.DeiTModel, tf.DeiTConfig(**SMALL, image_size=32, patch_size=8))
    x = torch.randn(1, 3, 32, 32)
    cache = probe.capture(model, {"pixel_values": x})
    torch.testing.assert_close(
        cache.pattern("encoder", 1), _eager(eager, pixel_values=x)[1], atol=TOL, rtol=0
    )
    assert cache.tokens[0][:3] == ["[CLS]", "[DIST]", "patch (0, 0)"] and len(cache.tokens[0]) == 18


def test_clip_vision_tower_class_embedding():
    cfg = tf.CLIPVisionConfig(**SMALL, image_size=32, patch_size=8)
    model, eager = _pair(tf.CLIPVisionModel, cfg)
    x = torch.randn(1, 3, 32, 32)
    cache = probe.capture(model, {"pixel_values": x})
    want = _eager(eager, pixel_values=x)
    for i in range(2):
        torch.testing.assert_close(cache.pattern("encoder", i), want[i], atol=TOL, rtol=0)
    assert cache.tokens[0][0] == "[CLS]" and cache.tokens[0][-1] == "patch (3, 3)"
    torch.testing.assert_close(
        probe.attention_map(cache, 0), want[0][0, :, 0, 1:].mean(0).reshape(4, 4), atol=TOL, rtol=0
    )


def test_bad_keyword_inputs_say_what_the_forward_takes(vit_run):
    model, x, cache, _ = vit_run
    with pytest.raises(ProbeError, match=r"forward takes no 'pixels'; it takes pixel_values, "):
        probe.capture(model, {"pixels": x})
    with pytest.raises(ProbeError, match="empty dict of inputs"):
        probe.capture(model, {})
    with pytest.raises(ProbeError, match="outside the 4x6 grid"):
        probe.attention_map(cache, 0, query=(4, 0))
    with pytest.raises(ProbeError, match="leave head=None"):
        probe.attention_map(cache, 0, head=1, query="rollout")
    import models

    text = probe.capture(models.load("minigpt"), "attention lets tokens read.")
    with pytest.raises(ProbeError, match="no stack of this cache has an image patch grid"):
        probe.attention_map(text, 0)


def test_a_sequence_that_is_not_prefix_plus_grid_says_so():
    # ViT-MAE drops a random 75% of the patches: the sequence is no longer [CLS] + the grid
    cfg = tf.ViTMAEConfig(**SMALL, image_size=32, patch_size=8, mask_ratio=0.75)
    torch.manual_seed(0)
    model = tf.ViTMAEModel(cfg).eval()
    cache = probe.capture(model, {"pixel_values": torch.randn(1, 3, 32, 32)})
    assert "positions" not in cache.metadata["stacks"]["encoder"]
    assert "could not tell which positions are which patches" in cache.metadata["positions_note"]
    assert cache.tokens[0] == [str(i) for i in range(5)]  # [CLS] + 4 kept patches, numbered
    with pytest.raises(ProbeError, match="could not tell"):
        probe.attention_map(cache, 0)


# -- pictures through the model's processor -----------------------------------------------------------------
def _processor():
    # what ViTImageProcessor does for this ViT: resize to 32 x 48, scale to [0, 1], normalise
    return tf.ViTImageProcessor(size={"height": 32, "width": 48}, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def test_pictures_files_and_arrays_through_a_processor(vit_run, tmp_path):
    import numpy as np
    from PIL import Image

    model, _, _, _ = vit_run
    _, eager = _vit()
    rng = np.random.default_rng(0)
    arrays = [
        rng.integers(0, 256, (40, 60, 3), dtype=np.uint8),
        rng.integers(0, 256, (64, 96, 3), dtype=np.uint8),
    ]
    Image.fromarray(arrays[0]).save(tmp_path / "cat.png")
    proc = _processor()
    # the oracle: the processor's own tensors, run through eager attention
    want = _eager(
        eager,
        pixel_values=proc(images=[Image.fromarray(a) for a in arrays], return_tensors="pt")["pixel_values"],
    )
    for inputs in (
        [tmp_path / "cat.png", Image.fromarray(arrays[1])],
        [str(tmp_path / "cat.png"), arrays[1]],
    ):
        cache = probe.capture(model, inputs, processor=proc)
        for i in range(2):
            torch.testing.assert_close(cache.pattern("encoder", i), want[i], atol=1e-5, rtol=0)
        assert cache.metadata["images"] == ["cat.png", "image 1"]
        assert cache.metadata["image_shape"] == [2, 3, 32, 48] and cache.tokens[0][1] == "patch (0, 0)"


def test_bad_pictures_are_one_line_each(vit_run, tmp_path):
    import numpy as np
    from PIL import Image

    model, _, _, _ = vit_run
    proc = _processor()
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not a picture")
    with pytest.raises(ProbeError, match=r"^image 0: cannot read '.*broken\.png' as a picture"):
        probe.capture(model, broken, processor=proc)
    picture = Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8))
    picture.save(tmp_path / "ok.png")
    with pytest.raises(ProbeError, match=r"^image 1: no such file '.*missing\.jpg'"):
        probe.capture(model, [tmp_path / "ok.png", tmp_path / "missing.jpg"], processor=proc)
    with pytest.raises(ProbeError, match=r"pictures need processor="):
        probe.capture(model, picture)
    with pytest.raises(ProbeError, match=r"processor= takes pictures"):
        probe.capture(model, 42, processor=proc)
    # a processor that is not the model's: 64 x 64 pictures for a 32 x 48 ViT
    wrong = tf.ViTImageProcessor(size={"height": 64, "width": 64})
    with pytest.raises(ProbeError, match=r"refused these inputs \(Input image size .*belong to the model"):
        probe.capture(model, picture, processor=wrong)


def test_cli_capture_of_images_from_a_hugging_face_folder(tmp_path, capsys):
    import numpy as np
    from PIL import Image

    from probe.cli import main

    model, eager = _vit()
    folder = tmp_path / "my-vit"
    model.save_pretrained(folder)
    _processor().save_pretrained(folder)
    rng = np.random.default_rng(3)
    paths = []
    for name in ("cat.png", "dog.png"):
        Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)).save(tmp_path / name)
        paths.append(tmp_path / name)
    out = tmp_path / "vit.safetensors"
    argv = [
        "capture",
        "--hf",
        str(folder),
        "--image",
        str(paths[0]),
        "--image",
        str(paths[1]),
        "-o",
        str(out),
    ]
    assert main(argv) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    cache = probe.load(out)
    pixels = _processor()(images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt")
    want = _eager(eager, pixel_values=pixels["pixel_values"])
    torch.testing.assert_close(cache.pattern("encoder", 1), want[1], atol=1e-5, rtol=0)
    assert cache.metadata["images"] == ["cat.png", "dog.png"] and cache.tokens[1][0] == "[CLS]"
    # no processor anywhere: one line, exit 2, nothing written
    bare = tmp_path / "bare"
    model.save_pretrained(bare)
    capsys.readouterr()
    again = tmp_path / "again.safetensors"
    assert main(["capture", "--hf", str(bare), "--image", str(paths[0]), "-o", str(again)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("probe: error: --image needs the model's image processor") and "\n" not in err
    assert main(["capture", "--hf", str(folder), "-o", str(again)]) == 2
    assert "give a TEXT or --image PATH" in capsys.readouterr().err
    assert not again.exists() and not list(tmp_path.glob("*.tmp*"))


# -- the pointing game ---------------------------------------------------------------------------------------
def test_pointing_game_against_loops_written_here():
    # a 4 x 6 grid over a 32 x 48 image: patch (r, c) covers rows 8r..8r+7 and columns 8c..8c+7
    m = torch.zeros(4, 6)
    m[1, 2], m[3, 5], m[0, 0] = 0.5, 0.3, 0.2
    box = (16, 8, 32, 20)  # x 16..32 (columns 2 and 3), y 8..20 (row 1 whole, row 2 half)
    got = probe.pointing({"L0.H0": m, "flat": torch.ones(4, 6)}, box, image=(32, 48))
    rows = {r["map"]: r for r in got.table}
    assert rows["L0.H0"]["hit"] is True and rows["L0.H0"]["peak"] == [1, 2]
    # the mass inside by a loop over pixels: each patch's weight times its share of object pixels
    inside = 0.0
    for r in range(4):
        for c in range(6):
            pixels = [(y, x) for y in range(8 * r, 8 * r + 8) for x in range(8 * c, 8 * c + 8)]
            share = sum(16 <= x + 0.5 < 32 and 8 <= y + 0.5 < 20 for y, x in pixels) / 64
            inside += float(m[r, c]) * share
    assert abs(rows["L0.H0"]["mass_inside"] - inside / float(m.sum())) < 1e-6  # float32 weights
    assert rows["flat"]["peak"] == [0, 0] and rows["flat"]["hit"] is False  # ties: the first patch
    assert abs(rows["flat"]["mass_inside"] - (16 * 12) / (32 * 48)) < 1e-12
    assert [r["map"] for r in got.by_map] == ["L0.H0", "flat"] and got.by_map[0]["hit_rate"] == 1.0
    # masks, several images, one object each
    mask = torch.zeros(32, 48, dtype=torch.bool)
    mask[24:, 40:] = True  # patch (3, 5) exactly
    both = probe.pointing(torch.stack([m, m.flip(0)]), [mask, mask], image=(32, 48))
    assert [r["hit"] for r in both.table] == [False, False]
    assert abs(both.table[0]["mass_inside"] - 0.3) < 1e-6
    with pytest.raises(ProbeError, match="2 objects for 3 images"):
        probe.pointing(torch.zeros(3, 4, 6), [box, box], image=(32, 48))
    with pytest.raises(ProbeError, match="box .* is empty"):
        probe.pointing(m, (5, 5, 5, 9), image=(32, 48))


def test_pointing_on_maps_of_a_capture(vit_run):
    _, _, cache, _ = vit_run
    grid = cache.metadata["stacks"]["encoder"]["positions"]["grid"]
    maps = {f"L1.H{h}": probe.attention_map(cache, 1, head=h) for h in range(4)}
    got = probe.pointing(maps, (0, 0, 48, 32), image=tuple(grid["image"]))  # the whole picture
    assert all(r["hit"] for r in got.table)
    for r in got.table:  # the whole picture holds the whole map
        assert abs(r["mass_inside"] - 1.0) < 1e-6


# -- vision-language models --------------------------------------------------------------------------------
def _llava():
    vision = tf.CLIPVisionConfig(**SMALL, image_size=32, patch_size=8)  # 4 x 4 patches + [CLS]
    text = tf.LlamaConfig(**SMALL, vocab_size=96, num_key_value_heads=2, max_position_embeddings=128)
    cfg = tf.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=95, vision_feature_layer=-1
    )
    return _pair(tf.LlavaForConditionalGeneration, cfg)


def test_llava_text_positions_read_the_picture_they_hold():
    # LLaVA (its default feature strategy drops [CLS]): each image token is one vision patch, in
    # the tower's row-major order; two pictures in one text take two runs of 16 image tokens
    model, eager = _llava()
    ids = torch.tensor([[1, 5] + [95] * 16 + [7] + [95] * 16 + [8, 9]])
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    inputs = {"input_ids": ids, "pixel_values": pixels, "attention_mask": torch.ones_like(ids)}
    cache = probe.capture(model, inputs)
    with torch.no_grad():
        want = eager(**inputs, output_attentions=True).attentions  # the language model's
    lm = "model.language_model.layers"
    for i in range(2):
        torch.testing.assert_close(cache.pattern(lm, i), want[i], atol=TOL, rtol=0)
    rows = cache.metadata["stacks"][lm]["positions"]["rows"]
    assert [g["offset"] for g in rows[0]["grids"]] == [2, 19]
    assert rows[0]["kinds"][:3] == ["text", "text", "image"] and rows[0]["kinds"][18] == "text"
    assert cache.tokens[0][2] == "img 0 (0, 0)" and cache.tokens[0][34] == "img 1 (3, 3)"
    # what the last text position reads of each picture, by hand from eager's weights
    for image, offset in ((0, 2), (1, 19)):
        got = probe.attention_map(cache, 1, query=36, stack=lm, image=image)
        expect = want[1][0, :, 36, offset : offset + 16].mean(0).reshape(4, 4)
        torch.testing.assert_close(got, expect, atol=TOL, rtol=0)
    # the vision tower keeps its own grid ([CLS] + 4 x 4) and its maps
    tower = cache.metadata["stacks"]["model.vision_tower.encoder.layers"]["positions"]
    assert tower["grid"]["offset"] == 1 and (tower["grid"]["rows"], tower["grid"]["cols"]) == (4, 4)
    with pytest.raises(ProbeError, match="text 0 holds 2 images"):
        probe.attention_map(cache, 1, query=36, stack=lm, image=2)


# -- figures on the picture ------------------------------------------------------------------------------
def test_image_map_figures_draw_the_maps_over_the_pixels(vit_run):
    import numpy as np

    _, _, cache, want = vit_run
    fig = probe.plot.image_map(cache, 1, query="cls", batch=1)
    drawn = fig.axes[0].get_images()[-1]
    expect = want[1][1, :, 0, 1:].mean(0).reshape(4, 6).numpy()  # eager's [CLS] row, by hand
    np.testing.assert_allclose(np.asarray(drawn.get_array()), expect, atol=TOL)
    assert drawn.get_extent() == [0, 48, 32, 0]  # 6 columns and 4 rows of 8-pixel patches
    assert fig.axes[0].get_title() == "Layer 1, mean over heads: what [CLS] reads"
    # a picture beneath: a pure red 40 x 60 picture, resized to the processed 32 x 48
    red = np.zeros((40, 60, 3), dtype=np.uint8)
    red[..., 0] = 255
    fig = probe.plot.image_map(cache, 0, head=3, query=(2, 1), picture=red)
    under, over = fig.axes[0].get_images()
    assert np.asarray(under.get_array()).shape == (32, 48, 3)
    assert np.all(np.asarray(under.get_array()) == np.array([1.0, 0.0, 0.0], dtype=np.float32))
    np.testing.assert_allclose(
        np.asarray(over.get_array()), want[0][0, 3, 1 + 2 * 6 + 1, 1:].reshape(4, 6), atol=TOL
    )
    # one map per head
    heads = probe.plot.image_heads(cache, 1, query=5)
    for h in range(4):
        got = np.asarray(heads.axes[h].get_images()[-1].get_array())
        np.testing.assert_allclose(got, want[1][0, h, 5, 1:].reshape(4, 6), atol=TOL)


# -- the picture kept, and the report ------------------------------------------------------------------
def test_the_picture_the_model_saw_is_kept(vit_run):
    import base64
    import io

    import numpy as np
    from PIL import Image

    model, x, cache, _ = vit_run
    colour = np.zeros((40, 60, 3), dtype=np.uint8)
    colour[...] = (200, 100, 50)
    # through the processor: its normalisation undone, at the processed size
    seen = probe.capture(model, colour, processor=_processor()).metadata["image_png"]
    img = np.asarray(Image.open(io.BytesIO(base64.b64decode(seen[0]))))
    assert img.shape == (32, 48, 3) and np.abs(img.astype(int) - (200, 100, 50)).max() <= 1
    # pixel_values given as they are: each picture scaled to [0, 1] (its normalisation unknown)
    img = np.asarray(Image.open(io.BytesIO(base64.b64decode(cache.metadata["image_png"][1])))).astype(float)
    want = x[1].permute(1, 2, 0).numpy()
    want = (want - want.min()) / (want.max() - want.min()) * 255
    assert np.abs(img - want).max() <= 1.0


def test_probe_report_image_writes_the_picture_section(tmp_path, capsys):
    import numpy as np
    from PIL import Image

    from probe.cli import main

    model, _ = _vit()
    folder = tmp_path / "my-vit"
    model.save_pretrained(folder)
    _processor().save_pretrained(folder)
    Image.fromarray(np.random.default_rng(4).integers(0, 256, (40, 60, 3), dtype=np.uint8)).save(
        tmp_path / "cat.png"
    )
    capsys.readouterr()
    out = tmp_path / "rep"
    assert main(["report", "--hf", str(folder), "--image", str(tmp_path / "cat.png"), "-o", str(out)]) == 0
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "<h2>Attention on the picture</h2>" in page and "cat.png" in page
    assert page.count('data-section="images"') == 1 and "could not be built" not in page
    assert (
        main(
            [
                "report",
                "--hf",
                str(folder),
                "--image",
                str(tmp_path / "cat.png"),
                "text",
                "-o",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    # a text beside the pictures is for a vision-language model: its processor is not in a ViT's folder
    assert "--image with a TEXT needs the vision-language model's processor" in capsys.readouterr().err


# -- statistics ---------------------------------------------------------------------------------------
def test_distance_px_against_a_loop_written_here(vit_run):
    import math

    _, _, cache, want = vit_run
    stats = probe.head_stats(cache, progress=False)
    rows = {(r["layer"], r["head"]): r for r in stats.table}
    for layer in range(2):
        for head in range(4):
            per_image = []
            for b in range(2):
                w = want[layer][b, head].double()
                total = 0.0
                for i in range(24):  # patch queries: sequence positions 1..24
                    ri, ci = divmod(i, 6)
                    for j in range(24):
                        rj, cj = divmod(j, 6)
                        dist = math.hypot((ri - rj) * 8, (ci - cj) * 8)  # centres 8 pixels apart
                        total += float(w[1 + i, 1 + j]) * dist
                per_image.append(total / 24)
            expect = sum(per_image) / 2  # the table's mean over texts
            assert abs(rows[(layer, head)]["distance_px"] - expect) < 1e-4
    # text models have no grid: NaN; statistics computed while a model runs say why they lack it
    streamed = probe.head_stats(vit_run[0], {"pixel_values": vit_run[1]}, progress=False)
    assert all(math.isnan(r["distance_px"]) for r in streamed.table)
    assert "image grid" in streamed.not_computed["distance_px"]


def test_distance_against_depth_plots_the_tables_values(vit_run):
    import numpy as np

    import models

    _, _, cache, _ = vit_run
    stats = probe.head_stats(cache, progress=False)
    fig = probe.plot.distance_depth(stats)
    dots = np.asarray(fig.axes[0].collections[0].get_offsets())
    want = sorted((r["layer"], r["distance_px"]) for r in stats.table)
    np.testing.assert_allclose(sorted(map(tuple, dots)), want, atol=1e-6)
    text = probe.head_stats(
        probe.capture(models.load("minigpt"), "attention lets tokens read."), progress=False
    )
    with pytest.raises(ProbeError, match="no distance_px in these statistics"):
        probe.plot.distance_depth(text)


def test_ablating_a_head_of_an_image_classifier_from_keyword_inputs():
    # the interventions take the same keyword inputs; oracle: a pre-hook on layer 1's output
    # projection zeroing head 2's slice of its input (8 dims a head), logits compared by hand
    cfg = tf.ViTConfig(**SMALL, image_size=(32, 48), patch_size=8, num_labels=3)
    torch.manual_seed(0)
    model = tf.ViTForImageClassification(cfg).eval()
    x = {"pixel_values": torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(5))}
    result = probe.ablate(model, x, [(1, 2)])
    dense = model.vit.layers[1].attention.o_proj

    def zero_head(module, args):
        h = args[0].clone()
        h[..., 16:24] = 0
        return (h,)

    with torch.no_grad():
        clean = model(**x).logits
        handle = dense.register_forward_pre_hook(zero_head)
        try:
            ablated = model(**x).logits
        finally:
            handle.remove()
    assert abs(result.summary["max_abs_change"] - float((ablated - clean).abs().max())) < 1e-6
    assert result.summary["max_abs_change"] > 0
