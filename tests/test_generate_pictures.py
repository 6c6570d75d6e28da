"""A vision-language generation on its picture (issues 30 and 31): where on the picture each
generated word read, from ``probe.generate`` with the prompt's inputs or with pictures, a
processor and a text.

Oracles, never probe's own output: the eager twin's ``generate(output_attentions=True)`` (the
ragged per-step weights of the language model), each generated token's row over the image
tokens reshaped here on the 4 x 4 grid of the tower's 8-pixel patches; the tower's own eager
weights; the processor's ``input_ids`` for where the image tokens are.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from generation_caches import llava_pair
from PIL import Image
from test_vlm_text import llava_processor

import probe
from probe.errors import ProbeError

ATOL = 1e-5
N = 4
TOWER = "model.vision_tower.encoder.layers"


@pytest.fixture(scope="module")
def pair():
    return llava_pair()


def _eager_rows(eager, inputs: dict) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """The sequences and, per generated token, each layer's row ``[heads, keys]`` of eager generate."""
    with torch.no_grad():
        out = eager.generate(
            **inputs, max_new_tokens=N, min_new_tokens=N, output_attentions=True, return_dict_in_generate=True
        )
    # step 0 is the prefill (its last row wrote the first new token); later steps one row each
    steps = [[layer[0, :, -1] for layer in step] for step in out.attentions]
    return out.sequences, steps


def _on_grid(row: torch.Tensor, at: int) -> torch.Tensor:
    """A row ``[keys]``'s weights on the 16 image tokens from ``at``, as the 4 x 4 picture."""
    return row[at : at + 16].reshape(4, 4)


@pytest.mark.parametrize("keep", [None, "rows"])
def test_each_generated_word_reads_the_picture(pair, keep, tmp_path):
    model, eager, inputs = pair
    g = probe.generate(model, inputs, max_new_tokens=N, min_new_tokens=N, keep=keep)
    sequences, steps = _eager_rows(eager, inputs)
    assert torch.equal(g.ids, sequences)
    P = inputs["input_ids"].size(1)
    meta = g.cache.metadata
    tower = meta["stacks"][TOWER]["positions"]
    assert tower["kinds"] == ["class"] + ["patch"] * 16
    assert tower["grid"] == {"rows": 4, "cols": 4, "patch": [8, 8], "image": [32, 32], "offset": 1}
    (row,) = meta["stacks"]["decoder"]["positions"]["rows"]
    assert row["grids"] == [{"rows": 4, "cols": 4, "patch": [8, 8], "image": [32, 32], "offset": 2}]
    assert row["kinds"] == ["text"] * 2 + ["image"] * 16 + ["text"] * (P - 18 + N - 1)
    assert meta["tokens"][0][2] == "patch (0, 0)" and meta["tokens"][0][17] == "patch (3, 3)"
    assert meta["image_shape"] == [1, 3, 32, 32] and len(meta["image_png"]) == 1
    for s, layers in enumerate(steps):  # query P - 1 + s wrote new token s
        q = P - 1 + s
        for layer, want in enumerate(layers):
            got = probe.attention_map(g.cache, layer, query=q, stack="decoder")
            torch.testing.assert_close(got, _on_grid(want.double().mean(0).float(), 2), atol=ATOL, rtol=0)
            one = probe.attention_map(g.cache, layer, head=3, query=q, stack="decoder")
            torch.testing.assert_close(one, _on_grid(want[3], 2), atol=ATOL, rtol=0)
    g.save(tmp_path / "gen.safetensors")  # the tower's positions are patches, not the text's tokens
    back = probe.load(tmp_path / "gen.safetensors")
    q = P + N - 2
    torch.testing.assert_close(
        probe.attention_map(back, 1, query=q, stack="decoder"),
        probe.attention_map(g.cache, 1, query=q, stack="decoder"),
    )
    if keep == "rows":  # a prompt row was not kept: said, not guessed
        with pytest.raises(ProbeError, match="row was not kept"):
            probe.attention_map(g.cache, 0, query=3, stack="decoder")


def test_tower_map_of_a_generation_is_the_towers_own(pair):
    model, eager, inputs = pair
    g = probe.generate(model, inputs, max_new_tokens=2, min_new_tokens=2)
    with torch.no_grad():
        want = eager.model.vision_tower(inputs["pixel_values"], output_attentions=True).attentions
    got = probe.attention_map(g.cache, 1, query="cls", stack=TOWER)
    torch.testing.assert_close(got, want[1][0, :, 0, 1:].mean(0).reshape(4, 4), atol=ATOL, rtol=0)


def test_statistics_of_a_vision_language_generation(pair):
    model, _eager, inputs = pair
    g = probe.generate(model, inputs, max_new_tokens=N, min_new_tokens=N, keep="stats")
    meta = g.cache.metadata
    assert meta["generation"]["stack"] == "decoder" and "decoder" in meta["stacks"]
    (row,) = meta["stacks"]["decoder"]["positions"]["rows"]
    assert row["grids"][0]["offset"] == 2 and row["kinds"].count("image") == 16
    assert meta["stacks"]["decoder"]["positions"]["kinds"][-N + 1 :] == ["generated"] * (N - 1)
    stats = probe.head_stats(g.cache)
    # every head of the language model and of the tower, named as in the stepped capture
    assert sorted(set(stats.table.column("stack"))) == ["decoder", TOWER]
    with pytest.raises(ProbeError, match="statistics"):
        probe.attention_map(g.cache, 0, query=20, stack="decoder")


def test_generate_from_pictures_a_processor_and_a_text(pair, tmp_path):
    model, eager, _inputs = pair
    proc = llava_processor()
    pixels = np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "cat.png")
    text = "USER: <image> what is the cat ASSISTANT:"
    g = probe.generate(
        model, tmp_path / "cat.png", processor=proc, text=text, max_new_tokens=N, min_new_tokens=N
    )
    inputs = dict(proc(images=[Image.fromarray(pixels)], text=[text], return_tensors="pt"))
    sequences, steps = _eager_rows(eager, inputs)
    assert torch.equal(g.ids, sequences)
    ids = inputs["input_ids"][0].tolist()
    at = ids.index(95)
    assert g.cache.metadata["stacks"]["decoder"]["positions"]["rows"][0]["grids"][0]["offset"] == at
    assert g.cache.metadata["tokens"][0][0] == "USER:"
    q = len(ids) - 1 + N - 1  # the last generated token's row
    got = probe.attention_map(g.cache, 1, query=q, stack="decoder")
    torch.testing.assert_close(got, _on_grid(steps[-1][1].double().mean(0).float(), at), atol=ATOL, rtol=0)


def test_pictures_prompt_bad_input(pair):
    model, _eager, _inputs = pair
    picture = np.zeros((32, 32, 3), dtype=np.uint8)
    proc = llava_processor()
    with pytest.raises(ProbeError, match="processor=..., text="):
        probe.generate(model, picture, processor=proc, max_new_tokens=2)
    with pytest.raises(ProbeError, match="processor=..., text="):
        probe.generate(model, picture, text="<image> a", max_new_tokens=2)
    with pytest.raises(ProbeError, match="one text"):
        probe.generate(model, picture, processor=proc, text=["<image> a", "<image> b"], max_new_tokens=2)
    with pytest.raises(ProbeError, match="image"):  # a text without the image token: the model's own check
        probe.generate(model, picture, processor=proc, text="a red dog", max_new_tokens=2)


@pytest.mark.slow
def test_cli_generate_from_a_picture(pair, tmp_path, capsys):
    from probe.cli import main

    model, eager, _inputs = pair
    folder = tmp_path / "my-llava"
    model.save_pretrained(folder)
    llava_processor().save_pretrained(folder)
    pixels = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "cat.png")
    text = "USER: <image> what is the cat ASSISTANT:"
    out = tmp_path / "rep"
    argv = [
        "generate",
        "--hf",
        str(folder),
        "--image",
        str(tmp_path / "cat.png"),
        text,
        "-n",
        "3",
        "-o",
        str(out),
    ]
    assert main([*argv, "-q"]) == 0
    cache = probe.load(out / "generation.safetensors")
    inputs = dict(llava_processor()(images=[Image.fromarray(pixels)], text=[text], return_tensors="pt"))
    sequences, _ = _eager_rows(eager, inputs)  # N = 4 new tokens: the first 3 are the CLI's
    assert (
        cache.metadata["generation"]["output_ids"] == sequences[0, inputs["input_ids"].size(1) :].tolist()[:3]
    )
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "<h2>Attention on the picture</h2>" in page and "What the generated text read" in page
    capsys.readouterr()
    assert main(["generate", "--model", "minigpt", "--image", str(tmp_path / "cat.png"), "at", "-q"]) == 2
    assert "image model" in capsys.readouterr().err


@pytest.mark.parametrize("keep", [None, "rows", "stats"])
def test_idefics3_generation_reads_its_tiles(keep):
    """Idefics3's tiles (two, 8 x 8 patches each, pixel-shuffled into 4 x 4 image tokens): each
    generated token's map over a tile is its eager row on that tile's 16 image tokens."""
    from test_idefics import _inputs, _model

    model, eager = _model("idefics3")
    inputs = {k: v[:1] for k, v in _inputs().items()}  # one text: two tiles, the second half-padded
    g = probe.generate(model, inputs, max_new_tokens=N, min_new_tokens=N, keep=keep)
    meta = g.cache.metadata
    (row,) = meta["stacks"]["decoder"]["positions"]["rows"]
    ids = inputs["input_ids"][0].tolist()
    starts = [i for i in range(len(ids)) if ids[i] == 120 and ids[i - 1] != 120]
    assert [(g_["offset"], g_["tile"], g_["rows"], g_["cols"]) for g_ in row["grids"]] == [
        (starts[0], 0, 4, 4),
        (starts[1], 1, 4, 4),
    ]
    assert meta["tiles"] == [[0, 0], [0, 1]] and meta["tokens"][0][starts[1]] == "tile 1 (0, 0)"
    if keep == "stats":
        assert sorted(set(probe.head_stats(g.cache).table.column("stack"))) == [
            "decoder",
            "model.vision_model.encoder.layers",
        ]
        return
    sequences, steps = _eager_rows(eager, inputs)
    assert torch.equal(g.ids, sequences)
    P = inputs["input_ids"].size(1)
    for s, layers in enumerate(steps):
        for tile, at in enumerate(starts):
            got = probe.attention_map(g.cache, 1, query=P - 1 + s, stack="decoder", image=tile)
            torch.testing.assert_close(
                got, _on_grid(layers[1].double().mean(0).float(), at), atol=ATOL, rtol=0
            )


def test_qwen2_vl_generation_reads_two_pictures_of_their_own_sizes():
    """Qwen2-VL: two pictures at their own sizes (merged 2 x 3 and 1 x 2 tokens from its
    ``image_grid_thw``); each generated token's map over each equals its eager row there."""
    from test_image_families import END, IMAGE, START, _qwen2_vl, _qwen_inputs

    model, eager = _qwen2_vl()
    inputs = _qwen_inputs([1, 2, START] + [IMAGE] * 6 + [END, 5, START] + [IMAGE] * 2 + [END, 7, 8])
    inputs.pop("mm_token_type_ids")
    g = probe.generate(model, inputs, max_new_tokens=3, min_new_tokens=3)
    grids = g.cache.metadata["stacks"]["decoder"]["positions"]["rows"][0]["grids"]
    assert [(x["offset"], x["rows"], x["cols"]) for x in grids] == [(3, 2, 3), (12, 1, 2)]
    with torch.no_grad():
        out = eager.generate(
            **inputs, max_new_tokens=3, min_new_tokens=3, output_attentions=True, return_dict_in_generate=True
        )
    assert torch.equal(out.sequences, g.ids)
    P = inputs["input_ids"].size(1)
    for s, step in enumerate(out.attentions):
        row = step[1][0, :, -1].double().mean(0).float()
        for image, (at, r, c) in enumerate([(3, 2, 3), (12, 1, 2)]):
            got = probe.attention_map(g.cache, 1, query=P - 1 + s, stack="decoder", image=image)
            torch.testing.assert_close(got, row[at : at + r * c].reshape(r, c), atol=ATOL, rtol=0)
