"""Idefics3 and SmolVLM (issue 30): pictures cut into tiles, ``pixel_values`` of ``[batch, images,
C, H, W]`` with a ``pixel_attention_mask``, each tile's patches merged ``s x s`` by the connector's
pixel shuffle before they replace the text's image tokens.

Oracles: HF eager ``output_attentions`` of the same weights for the text model; for the vision
tower (whose attentions the model does not return) the eager tower run again here with
``output_attentions`` on the very tiles and patch mask the model handed it (read by a hook); the
image positions from ``input_ids == config.image_token_id``, the merged grid from the config
(``image_size / patch_size / scale_factor``), maps read off eager's weights here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image
from test_images import SMALL, TOL, _pair

import probe
from probe.errors import ProbeError

tf.logging.set_verbosity_error()
IMAGE, FAKE, GLOBAL = 120, 121, 122
VISION, TEXT = "model.vision_model.encoder.layers", "model.text_model.layers"
FAMILIES = {
    "idefics3": (tf.Idefics3Config, tf.Idefics3ForConditionalGeneration),
    "smolvlm": (tf.SmolVLMConfig, tf.SmolVLMForConditionalGeneration),
}


def _model(family: str):
    config_cls, model_cls = FAMILIES[family]
    cfg = config_cls(
        vision_config=dict(**SMALL, image_size=32, patch_size=4),  # 8 x 8 patches a tile
        text_config=dict(**SMALL, vocab_size=128, num_key_value_heads=2, max_position_embeddings=256),
        scale_factor=2,  # 8 x 8 patches -> 4 x 4 image tokens a tile
        image_token_id=IMAGE,
    )
    return _pair(model_cls, cfg)


def _merged_side(cfg) -> int:
    v = cfg.vision_config
    return v.image_size // v.patch_size // cfg.scale_factor


def _inputs():
    # text 0 holds two tiles (16 image tokens each), text 1 one tile and three pads; text 1's
    # second slot is padding (all zeros, dropped by the model); tile (0, 1) has its right 8
    # pixel columns padded (2 patch columns masked in the tower)
    t0 = [1, 2, FAKE] + [IMAGE] * 16 + [FAKE, 5, FAKE] + [IMAGE] * 16 + [FAKE, 7]
    t1 = [1, FAKE] + [IMAGE] * 16 + [FAKE, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    t1 += [0] * (len(t0) - len(t1))
    ids = torch.tensor([t0, t1])
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    pixels = torch.randn(2, 2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    pixels[1, 1] = 0
    pmask = torch.ones(2, 2, 32, 32, dtype=torch.long)
    pmask[0, 1, :, 24:] = 0
    pmask[1, 1] = 0
    pixels[0, 1, :, :, 24:] = 0
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "pixel_attention_mask": pmask}


def _oracle(eager, inputs):
    """Eager's text attentions, and its vision tower's run again with output_attentions on the
    inputs the model gave it (the tiles left after dropping padding, the patch mask)."""
    seen = {}

    def grab(module, args, kwargs):
        seen.update(kwargs)

    tower = eager.model.vision_model
    handle = tower.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            out = eager(**inputs, output_attentions=True)
    finally:
        handle.remove()
    with torch.no_grad():
        vis = tower(
            pixel_values=seen["pixel_values"],
            patch_attention_mask=seen["patch_attention_mask"],
            output_attentions=True,
        ).attentions
    return out.attentions, vis, seen


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def run(request):
    model, eager = _model(request.param)
    inputs = _inputs()
    text, vis, seen = _oracle(eager, inputs)
    return model, inputs, probe.capture(model, inputs), text, vis, seen


def test_text_and_vision_patterns_against_eager(run):
    model, _inputs_, cache, text, vis, seen = run
    assert seen["pixel_values"].shape[0] == 3  # the padding slot was dropped: three tiles
    assert not bool(seen["patch_attention_mask"][1, :, 6:].any())  # the padded columns masked
    for layer in range(2):
        torch.testing.assert_close(cache.pattern(TEXT, layer), text[layer], atol=TOL, rtol=0)
        torch.testing.assert_close(cache.pattern(VISION, layer), vis[layer], atol=TOL, rtol=0)


def test_image_tokens_and_their_merged_grids(run):
    model, inputs, cache, *_ = run
    ids = inputs["input_ids"]
    assert cache.metadata["tiles"] == [[0, 0], [0, 1], [1, 0]]  # the slots the tower ran, in order
    side = _merged_side(model.config)
    assert side == 4
    rows = cache.metadata["stacks"][TEXT]["positions"]["rows"]
    tile = 0
    for b, row in enumerate(rows):
        is_image = (ids[b] == model.config.image_token_id).tolist()
        assert row["kinds"] == ["image" if x else "text" for x in is_image]
        starts = [i for i, x in enumerate(is_image) if x and (i == 0 or not is_image[i - 1])]
        assert [g["offset"] for g in row["grids"]] == starts
        for g in row["grids"]:
            assert (g["rows"], g["cols"], g["tile"]) == (side, side, tile)
            assert g["patch"] == [4 * 2, 4 * 2] and g["image"] == [32, 32]
            tile += 1
    assert tile == 3
    assert cache.tokens[0][3] == "tile 0 (0, 0)" and cache.tokens[0][37] == "tile 1 (3, 3)"
    assert cache.tokens[1][2] == "tile 0 (0, 0)" and cache.tokens[0][2] == str(FAKE)
    # the vision tower: each tile an 8 x 8 grid of 4-pixel patches, no learned tokens before them
    tower = cache.metadata["stacks"][VISION]["positions"]
    n = model.config.vision_config.image_size // model.config.vision_config.patch_size
    assert tower["grid"] == {"rows": n, "cols": n, "patch": [4, 4], "image": [32, 32], "offset": 0}
    assert tower["kinds"] == ["patch"] * n * n


def test_a_words_map_over_a_tiles_merged_grid(run):
    _model_, _inputs_, cache, text, *_ = run
    q = 39  # text 0's last position, after both tiles
    for image, at in ((0, 3), (1, 22)):
        got = probe.attention_map(cache, 1, query=q, stack=TEXT, image=image)
        want = text[1][0, :, q, at : at + 16].mean(0).reshape(4, 4)
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    got = probe.attention_map(cache, 0, head=3, query=20, stack=TEXT, batch=1)
    torch.testing.assert_close(got, text[0][1, 3, 20, 2:18].reshape(4, 4), atol=TOL, rtol=0)
    with pytest.raises(ProbeError, match="text 1 holds 1 images"):
        probe.attention_map(cache, 0, query=20, stack=TEXT, batch=1, image=1)


def test_a_patchs_map_in_the_vision_tower(run):
    _model_, _inputs_, cache, _text, vis, _ = run
    got = probe.attention_map(cache, 1, query=(2, 5), stack=VISION, batch=1)  # tile 1: columns 6, 7 masked
    want = vis[1][1, :, 2 * 8 + 5].mean(0).reshape(8, 8)
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    assert float(got[:, 6:].abs().sum()) == 0.0


def test_head_stats_read_the_tiles_as_pictures(run):
    # the tower's three sequences are tiles (not the two texts the attention mask describes):
    # distance_px over each tile's patches; on_image over the words that follow an image token
    model, inputs, cache, text, vis, _ = run
    stats = {(r["stack"], r["layer"], r["head"]): r for r in probe.head_stats(cache, progress=False).table}
    r, c = torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij")
    centre = torch.stack([r.flatten() * 4 + 2, c.flatten() * 4 + 2], -1).double()
    dist = torch.cdist(centre, centre)
    w = vis[1][:, 2].double()  # [tile, query, key]
    want = float((w * dist).sum(-1).mean())
    assert abs(stats[(VISION, 1, 2)]["distance_px"] - want) < 1e-5
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    image = ids == IMAGE
    per_text = []  # each text's mean, then the mean over the texts
    for b in range(2):
        first = int(image[b].nonzero()[0])
        qs = [q for q in range(first, ids.shape[1]) if mask[b, q] and not image[b, q]]
        per_text.append(sum(float(text[0][b, 1, q].double()[image[b]].sum()) for q in qs) / len(qs))
    assert abs(stats[(TEXT, 0, 1)]["on_image"] - sum(per_text) / 2) < 1e-5


def test_image_tokens_that_split_a_tile_are_refused_in_one_line(run):
    model = run[0]
    inputs = _inputs()
    ids = inputs["input_ids"].clone()
    ids[0, 11], ids[0, 19] = 5, IMAGE  # a word in tile 0's run, which goes on one token longer
    inputs["input_ids"] = ids
    assert int((ids == IMAGE).sum()) == 48
    cache = probe.capture(model, inputs)
    assert "not a whole number of tiles" in cache.metadata["positions_note"]
    with pytest.raises(ProbeError, match="no image patch grid") as e:
        probe.attention_map(cache, 0, query=39, stack=TEXT)
    assert "\n" not in str(e.value)
    assert "grid" in cache.metadata["stacks"][VISION]["positions"]  # the tower's grid stands


# -- through Idefics3's own processor: a picture split into 2 x 2 tiles and a global view ---------------
def _processor():
    from test_vlm_text import word_tokenizer

    specials = {"<image>": IMAGE, "<fake_token_around_image>": FAKE, "<global-img>": GLOBAL}
    specials.update({f"<row_{i + 1}_col_{j + 1}>": 80 + 6 * i + j for i in range(6) for j in range(6)})
    images = tf.Idefics3ImageProcessor(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True
    )
    return tf.Idefics3Processor(image_processor=images, tokenizer=word_tokenizer(specials), image_seq_len=16)


def test_processor_tiles_are_laid_after_their_row_and_column_tokens():
    model, eager = _model("idefics3")
    proc = _processor()
    picture = np.random.default_rng(4).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    text = "what is <image> the cat"
    cache = probe.capture(model, picture, processor=proc, text=text)
    inputs = proc(images=[Image.fromarray(picture)], text=[text], return_tensors="pt")
    assert tuple(inputs["pixel_values"].shape) == (1, 5, 3, 32, 32)
    want, vis, _ = _oracle(eager, dict(inputs))
    for layer in range(2):
        torch.testing.assert_close(cache.pattern(TEXT, layer), want[layer], atol=TOL, rtol=0)
        torch.testing.assert_close(cache.pattern(VISION, layer), vis[layer], atol=TOL, rtol=0)
    ids = inputs["input_ids"][0].tolist()
    tok = proc.tokenizer
    row = cache.metadata["stacks"][TEXT]["positions"]["rows"][0]
    # each tile right after its <row_i_col_j> (the global view after <global-img>), in that order
    before = [tok.convert_ids_to_tokens(ids[g["offset"] - 1]) for g in row["grids"]]
    assert before == ["<row_1_col_1>", "<row_1_col_2>", "<row_2_col_1>", "<row_2_col_2>", "<global-img>"]
    assert [g["tile"] for g in row["grids"]] == [0, 1, 2, 3, 4]
    assert len(cache.metadata["image_png"]) == 5  # each tile as the tower saw it
    q = len(ids) - 1
    at = row["grids"][4]["offset"]
    got = probe.attention_map(cache, 1, query=q, stack=TEXT, image=4)
    torch.testing.assert_close(got, want[1][0, :, q, at : at + 16].mean(0).reshape(4, 4), atol=TOL, rtol=0)


def test_a_connector_that_does_not_merge_row_major_blocks_gets_no_grid(run):
    # the connector's merged tokens in column-major order: the model runs, the map is not exact
    model = run[0]
    connector = model.model.connector
    plain = connector.pixel_shuffle

    def transposed(x, scale_factor=2):
        out = plain(x, scale_factor)
        b, n, d = out.shape
        g = int(n**0.5)
        return out.view(b, g, g, d).transpose(1, 2).reshape(b, n, d)

    connector.pixel_shuffle = transposed
    try:
        cache = probe.capture(model, _inputs())
    finally:
        del connector.pixel_shuffle
    assert "does not merge the 8x8 patch grid into whole 2x2 blocks" in cache.metadata["positions_note"]
    with pytest.raises(ProbeError, match="does not merge"):
        probe.attention_map(cache, 0, query=39, stack=TEXT)


def test_a_tiled_cache_saves_loads_and_streams(run, tmp_path):
    # the tower's three tile sequences beside two texts pass the cache's own checks
    model, inputs, cache, text, vis, _ = run
    streamed = probe.capture(model, inputs, out=tmp_path / "streamed.safetensors")
    cache.save(tmp_path / "saved.safetensors")
    loaded = probe.load(tmp_path / "saved.safetensors")
    for c in (streamed, loaded):
        torch.testing.assert_close(c.pattern(TEXT, 1), text[1], atol=TOL, rtol=0)
        torch.testing.assert_close(c.pattern(VISION, 1), vis[1], atol=TOL, rtol=0)
        assert c.metadata["tiles"] == [[0, 0], [0, 1], [1, 0]]
        assert c.metadata["stacks"][TEXT]["positions"] == cache.metadata["stacks"][TEXT]["positions"]


@pytest.mark.slow
def test_a_tiled_caches_report_draws_its_tiles(tmp_path):
    model, _ = _model("idefics3")
    cache = probe.capture(model, _inputs())
    page = probe.report(cache, tmp_path / "r", progress=False).read_text(encoding="utf-8")
    assert "Attention on the picture" in page and "tile 1 (3, 3)" in page
