"""models.vit_zoo and models.shapes: the generated pictures, the model, its checkpoint, and probe's
capture of it as an image model (issue 30, item 7).

Oracles: boxes and masks from loops over pixels written here, the attention weights recomputed
here from the `qkv` projection each block computed (a forward hook), the sequence layout the
model's own forward builds ([CLS], two registers, then the patches row by row).
"""

from __future__ import annotations

import math

import pytest
import torch

import models
import probe
from models import shapes, vit_zoo

TOL = 1e-6


@pytest.fixture(scope="module")
def vit():
    return models.load("vit_zoo")


# -- the pictures ---------------------------------------------------------------------------------------
def test_boxes_are_the_masks_tight_boxes_by_a_loop_over_pixels():
    data = shapes.generate(12, seed=3)
    assert data.images.shape == (12, 3, 64, 64) and data.masks.dtype == torch.bool
    assert 0 <= float(data.images.min()) and float(data.images.max()) <= 1
    for mask, box in zip(data.masks, data.boxes, strict=True):
        xs = [x for y in range(64) for x in range(64) if mask[y, x]]
        ys = [y for y in range(64) for x in range(64) if mask[y, x]]
        assert xs, "every picture has an object"
        assert box.tolist() == [min(xs), min(ys), max(xs) + 1, max(ys) + 1]


def test_shape_masks_against_the_geometry_written_here():
    # a circle of half-size 6 at (20.0, 30.0) and a square (half-side 0.8 r) at (40.0, 12.0)
    labels = torch.tensor([shapes.CLASSES.index("circle"), shapes.CLASSES.index("square")])
    got = shapes.shape_masks(
        labels, torch.tensor([20.0, 40.0]), torch.tensor([30.0, 12.0]), torch.tensor([6.0, 6.0]), 64
    )
    for y in range(64):
        for x in range(64):
            px, py = x + 0.5, y + 0.5
            assert bool(got[0, y, x]) == (math.hypot(px - 20, py - 30) <= 6)
            assert bool(got[1, y, x]) == (abs(px - 40) <= 4.8 and abs(py - 12) <= 4.8)


def test_without_noise_the_object_is_one_colour_far_from_its_background():
    data = shapes.generate(30, seed=5, noise=0.0)
    # the background just around the object: pixels within one step of it, not in it
    near = torch.nn.functional.max_pool2d(data.masks.float()[:, None], 3, 1, 1)[:, 0].bool() & ~data.masks
    for img, mask, ring in zip(data.images, data.masks, near, strict=True):
        inside = img[:, mask]  # [3, pixels]
        assert torch.equal(inside, inside[:, :1].expand_as(inside))  # one flat colour
        assert float((inside[:, 0] - img[:, ring].mean(1)).norm()) > 0.3  # drawn >= 0.45 from under it
    again = shapes.generate(30, seed=5, noise=0.0)
    assert torch.equal(again.images, data.images) and torch.equal(again.labels, data.labels)
    assert not torch.equal(shapes.generate(30, seed=6).labels, data.labels)


def test_classes_are_balanced_and_objects_lie_inside_the_picture():
    data = shapes.generate(60, seed=8)
    assert torch.bincount(data.labels, minlength=6).tolist() == [10] * 6
    assert (data.boxes[:, :2] >= 0).all() and (data.boxes[:, 2:] <= 64).all()
    widths = data.boxes[:, 2] - data.boxes[:, 0]
    assert int(widths.min()) >= 10 and int(widths.max()) <= 32


# -- the model ------------------------------------------------------------------------------------------
def test_forward_shapes_and_a_wrong_picture_size():
    model = vit_zoo.build().eval()
    cfg = model.config
    assert (cfg.image_size, cfg.patch_size, cfg.n_registers) == (64, 8, 2)
    conv = model.patch_embed
    assert isinstance(conv, torch.nn.Conv2d) and conv.kernel_size == conv.stride == (8, 8)
    assert model.cls_token.shape == (1, 1, cfg.n_embd) and model.register_tokens.shape == (1, 2, cfg.n_embd)
    assert model.pos_embed.shape == (1, 1 + 2 + 64, cfg.n_embd) and model.context_length == 67
    with torch.no_grad():
        assert model(torch.randn(3, 3, 64, 64)).shape == (3, 6)
    with pytest.raises(ValueError, match=r"\[2, 3, 32, 32\]; it takes \[batch, 3, 64, 64\]"):
        model(torch.randn(2, 3, 32, 32))
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert models.checkpoint_bytes("vit_zoo") == size < 2_000_000


def test_processor_resizes_and_normalises_like_the_training_data(vit):
    import numpy as np

    proc = vit.processor
    data = shapes.generate(2, seed=11)
    pil = [shapes.to_pil(img) for img in data.images]
    out = proc(images=pil, return_tensors="pt")["pixel_values"]
    want = vit_zoo.normalise(data.images, vit.config)
    assert out.shape == (2, 3, 64, 64)
    assert float((out - want).abs().max()) <= 0.5 / 255 / 0.25 + 1e-6  # 8-bit rounding only
    arr = np.asarray(pil[0])
    torch.testing.assert_close(proc(images=[arr])["pixel_values"], out[:1])
    torch.testing.assert_close(proc(images=data.images[:1])["pixel_values"], want[:1])
    big = proc(images=[pil[0].resize((100, 80))])["pixel_values"]
    assert big.shape == (1, 3, 64, 64)
    with pytest.raises(ValueError, match="no images"):
        proc(images=[])


def test_the_shipped_checkpoint_names_the_shapes(vit):
    assert not vit.training and vit.name == "vit_zoo" and vit.tokenizer is None
    assert vit.train_info["steps"] == vit.train_info["recipe"]["steps"] > 0
    assert vit_zoo.accuracy(vit, n=300) > 0.9
    data = shapes.generate(6, seed=12_345)
    names = vit.classify(list(data.images))
    assert sum(n == shapes.CLASSES[i] for n, i in zip(names, data.labels, strict=True)) >= 5


def test_training_is_deterministic():
    first, stats = vit_zoo.train(steps=3, batch_size=8, warmup=2)
    second, _ = vit_zoo.train(steps=3, batch_size=8, warmup=2)
    assert stats.steps == 3 and len(stats.losses) == 3
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name]), name


# -- probe sees an image model -----------------------------------------------------------------------------
def _weights_by_hook(model, x):
    """Each layer's attention weights [B, heads, T, T], recomputed here from the qkv output."""
    got = []

    def keep(module, args, out):
        got.append(out.detach())

    handles = [b.attn.qkv.register_forward_hook(keep) for b in model.blocks]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    H = model.config.n_head
    weights = []
    for qkv in got:
        B, T, C3 = qkv.shape
        hs = C3 // 3 // H
        q = qkv[..., : C3 // 3].reshape(B, T, H, hs).transpose(1, 2)
        k = qkv[..., C3 // 3 : 2 * C3 // 3].reshape(B, T, H, hs).transpose(1, 2)
        weights.append(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hs), dim=-1))
    return weights


@pytest.fixture(scope="module")
def captured(vit):
    x = vit_zoo.normalise(shapes.generate(3, seed=21).images, vit.config)
    return x, probe.capture(vit, {"pixel_values": x}), _weights_by_hook(vit, x)


def test_capture_is_exact_and_positions_are_named(vit, captured):
    x, cache, want = captured
    assert cache.stacks == ["encoder"]
    for layer, w in enumerate(want):
        torch.testing.assert_close(cache.pattern("encoder", layer), w, atol=TOL, rtol=0)
    pos = cache.metadata["stacks"]["encoder"]["positions"]
    assert pos["grid"] == {"rows": 8, "cols": 8, "patch": [8, 8], "image": [64, 64], "offset": 3}
    assert pos["kinds"] == ["class", "register", "register"] + ["patch"] * 64
    assert cache.tokens[2][:4] == ["[CLS]", "reg 0", "reg 1", "patch (0, 0)"]
    assert cache.tokens[2][3 + 8] == "patch (1, 0)" and cache.tokens[2][-1] == "patch (7, 7)"
    last = vit.config.n_layer - 1
    for b in range(3):  # the class token's row, its 64 patch columns laid row by row
        torch.testing.assert_close(
            probe.attention_map(cache, last, batch=b),
            want[last][b, :, 0, 3:].mean(0).reshape(8, 8),
            atol=TOL,
            rtol=0,
        )
        torch.testing.assert_close(
            probe.attention_map(cache, 1, 2, batch=b), want[1][b, 2, 0, 3:].reshape(8, 8), atol=TOL, rtol=0
        )


def test_pictures_through_the_models_own_processor(vit, tmp_path):
    data = shapes.generate(2, seed=22)
    pil = shapes.to_pil(data.images[0])
    path = tmp_path / "shape.png"
    shapes.to_pil(data.images[1]).save(path)
    cache = probe.capture(vit, [pil, str(path)], processor=vit.processor)
    x = vit.processor(images=[pil, shapes.to_pil(data.images[1])])["pixel_values"]
    for layer, w in enumerate(_weights_by_hook(vit, x)):
        torch.testing.assert_close(cache.pattern("encoder", layer), w, atol=TOL, rtol=0)
    grid = cache.metadata["stacks"]["encoder"]["positions"]["grid"]
    assert grid["rows"] == grid["cols"] == 8 and cache.tokens[1][0] == "[CLS]"
    assert probe.attention_map(cache, 0, batch=1).shape == (8, 8)


def test_probe_report_of_the_zoo_vit_on_a_picture(tmp_path, capsys):
    from probe.cli import main

    picture = tmp_path / "cat.png"
    shapes.to_pil(shapes.generate(1, seed=23).images[0]).resize((96, 96)).save(picture)
    out = tmp_path / "rep"
    assert main(["report", "--model", "vit-zoo", "--image", str(picture), "-o", str(out)]) == 0
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "<h2>Attention on the picture</h2>" in page and "cat.png" in page and "vit_zoo" in page
    assert "could not be built" not in page
    capsys.readouterr()
    assert main(["report", "--model", "minigpt", "--image", str(picture), "-o", str(tmp_path / "x")]) == 2
    assert "needs an image model" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    # probe capture takes the zoo model's own processor the same way
    saved = tmp_path / "cat.safetensors"
    assert main(["capture", "--model", "vit-zoo", "--image", str(picture), "-o", str(saved)]) == 0
    cache = probe.load(saved)
    x = vit_processor_pixels(picture)
    torch.testing.assert_close(
        cache.pattern("encoder", 3), _weights_by_hook(models.load("vit_zoo"), x)[3], atol=TOL, rtol=0
    )
    assert cache.metadata["images"] == ["cat.png"] and cache.tokens[0][:2] == ["[CLS]", "reg 0"]


def vit_processor_pixels(path):
    from PIL import Image

    return models.load("vit_zoo").processor(images=[Image.open(path).convert("RGB")])["pixel_values"]


def test_the_benchmarks_pointing_game_against_a_loop_written_here(vit):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "pointing_zoo.py"
    spec = importlib.util.spec_from_file_location("pointing_zoo", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    table, note = bench.table(vit, 24)
    rows = {r["map"].split(",")[0].split(" (")[0]: r for r in table}
    # oracle: the last layer's weights from the hook, the class token's row averaged over heads,
    # its peak patch's centre pixel tested against the box, pixel by pixel
    test = shapes.generate(24, seed=bench.TEST_SEED)
    last = _weights_by_hook(vit, vit_zoo.normalise(test.images, vit.config))[-1]
    hits = 0
    for b in range(24):
        r, c = divmod(int(last[b, :, 0, 3:].mean(0).argmax()), 8)
        x0, y0, x1, y1 = test.boxes[b].tolist()
        hits += x0 <= c * 8 + 4 < x1 and y0 <= r * 8 + 4 < y1
    assert rows["last-layer [CLS] map"]["hit rate (box)"] == round(hits / 24, 3)
    inside = [(x1 - x0) * (y1 - y0) / 64**2 for x0, y0, x1, y1 in test.boxes.tolist()]
    assert rows["random patch"]["mass in box"] == round(sum(inside) / 24, 3)
    assert "24 test pictures" in note
