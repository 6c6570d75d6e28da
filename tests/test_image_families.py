"""Image families beyond a vision transformer's prefix and patches (issue 30): DETR's
convolutional feature map and its decoder's cross-attention onto it; Qwen2-VL's pictures at their
own sizes, packed in its vision tower and merged for its language model; and ``probe.trace``
around a forward the user runs on pixels.

Oracles: HF eager ``output_attentions`` of the same weights (and, for Qwen2-VL's vision tower,
which returns none, the weights its eager attention function computed, recorded in the test), the
grids computed here from the convolution arithmetic and ``image_grid_thw``, maps read off eager's
weights here.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from test_images import _pair

import probe
from probe.errors import ProbeError

tf.logging.set_verbosity_error()
TOL = 1e-6


@pytest.fixture(scope="module")
def detr_run():
    backbone = tf.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 8, 16, 16], depths=[1, 1, 1, 1], out_features=["stage4"]
    )
    cfg = tf.DetrConfig(
        use_timm_backbone=False,
        backbone_config=backbone,
        use_pretrained_backbone=False,
        d_model=32,
        encoder_layers=1,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_queries=5,
    )
    model, eager = _pair(tf.DetrModel, cfg)
    # 100 x 150 pixels: the backbone's stride-2 steps round up, ceil(100/32) x ceil(150/32) = 4 x 5
    x = torch.randn(1, 3, 100, 150, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = eager(pixel_values=x, output_attentions=True)
    return probe.capture(model, {"pixel_values": x}), out


def test_detr_roles_and_patterns_against_eager(detr_run):
    cache, out = detr_run
    # the object queries' position embeddings are handed to the self-attention beside the stream:
    # not a second sequence, so the decoder's self-attention is self, its encoder attention cross
    assert cache.attentions("decoder", 0) == [("self", None), ("cross", None)]
    torch.testing.assert_close(cache.pattern("encoder", 0), out.encoder_attentions[0], atol=TOL, rtol=0)
    for layer in range(2):
        torch.testing.assert_close(
            cache.pattern("decoder", layer), out.decoder_attentions[layer], atol=TOL, rtol=0
        )
        torch.testing.assert_close(
            cache.pattern("decoder", layer, "cross"), out.cross_attentions[layer], atol=TOL, rtol=0
        )


def test_detr_feature_map_is_the_encoders_grid(detr_run):
    cache, out = detr_run
    rows, cols = -(-100 // 32), -(-150 // 32)
    assert out.encoder_attentions[0].shape[-1] == rows * cols == 20
    grid = cache.metadata["stacks"]["encoder"]["positions"]["grid"]
    assert (grid["rows"], grid["cols"], grid["patch"], grid["image"]) == (4, 5, [32, 32], [100, 150])
    assert cache.tokens[0][:2] == ["cell (0, 0)", "cell (0, 1)"] and cache.tokens[0][-1] == "cell (3, 4)"
    # an encoder position's own map over the feature map
    got = probe.attention_map(cache, 0, query=(1, 2), stack="encoder")
    torch.testing.assert_close(
        got, out.encoder_attentions[0][0, :, 7].mean(0).reshape(4, 5), atol=TOL, rtol=0
    )


def test_detr_object_query_reads_the_feature_map(detr_run):
    cache, out = detr_run
    for layer in range(2):
        for head in (None, 3):
            got = probe.attention_map(cache, layer, head=head, query=2, stack="decoder")
            w = out.cross_attentions[layer][0, :, 2]
            want = (w.mean(0) if head is None else w[head]).reshape(4, 5)
            torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    with pytest.raises(ProbeError, match="give query= the index of one of its query positions"):
        probe.attention_map(cache, 0, query="cls", stack="decoder")
    with pytest.raises(ProbeError, match="not one of the 5 query positions"):
        probe.attention_map(cache, 0, query=5, stack="decoder")


# -- Qwen2-VL: pictures at their own sizes, packed in the vision tower, merged for the text ---------
IMAGE, START, END = 120, 122, 123


def _qwen2_vl():
    vision = dict(
        depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=4,
        spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
    )  # fmt: skip
    text = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=128, max_position_embeddings=256,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
    )  # fmt: skip
    cfg = tf.Qwen2VLConfig(
        vision_config=vision, text_config=text, image_token_id=IMAGE, video_token_id=121,
        vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    return _pair(tf.Qwen2VLForConditionalGeneration, cfg)


def _qwen_inputs(ids):
    # two pictures: 4 x 6 patches of 4 pixels (merged 2 x 3) and 2 x 4 (merged 1 x 2)
    thw = torch.tensor([[1, 4, 6], [1, 2, 4]])
    pixels = torch.randn(32, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(5))
    ids = torch.tensor([ids])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": pixels,
        "image_grid_thw": thw,
        "mm_token_type_ids": (ids == IMAGE).long(),
    }


@pytest.fixture(scope="module")
def qwen_run():
    import transformers.models.qwen2_vl.modeling_qwen2_vl as qm

    model, eager = _qwen2_vl()
    inputs = _qwen_inputs([1, 2, START] + [IMAGE] * 6 + [END, 5, START] + [IMAGE] * 2 + [END, 7, 8])
    tower: list[torch.Tensor] = []  # the eager vision tower's weights, segment by segment
    plain = qm.eager_attention_forward

    def recording(module, *args, **kwargs):
        out, weights = plain(module, *args, **kwargs)
        if isinstance(module, qm.VisionAttention):
            tower.append(weights.detach().clone())
        return out, weights

    qm.eager_attention_forward = recording
    try:
        with torch.no_grad():
            out = eager(**inputs, output_attentions=True)
    finally:
        qm.eager_attention_forward = plain
    return model, inputs, probe.capture(model, inputs), out, tower


def test_qwen2_vl_language_model_and_packed_vision_tower_against_eager(qwen_run):
    _, _, cache, out, tower = qwen_run
    lm, vis = "model.language_model.layers", "model.visual.blocks"
    for layer in range(2):
        torch.testing.assert_close(cache.pattern(lm, layer), out.attentions[layer], atol=TOL, rtol=0)
    # the tower packs both pictures' 24 + 8 patches; each attends to its own picture only
    assert len(tower) == 2 * 2  # two blocks, one eager call per picture
    for layer in range(2):
        want = torch.zeros(1, 4, 32, 32)
        want[:, :, :24, :24] = tower[2 * layer]
        want[:, :, 24:, 24:] = tower[2 * layer + 1]
        torch.testing.assert_close(cache.pattern(vis, layer), want, atol=TOL, rtol=0)
    assert "packed" in cache.metadata["layers"][0]["self_attn"]["kind"]


def test_qwen2_vl_image_tokens_on_their_own_merged_grids(qwen_run):
    _, _, cache, out, _ = qwen_run
    lm = "model.language_model.layers"
    row = cache.metadata["stacks"][lm]["positions"]["rows"][0]
    # merged grids: 4 x 6 patches -> 2 x 3 tokens of 8 pixels; 2 x 4 -> 1 x 2
    assert row["grids"] == [
        {"rows": 2, "cols": 3, "patch": [8, 8], "image": [16, 24], "offset": 3},
        {"rows": 1, "cols": 2, "patch": [8, 8], "image": [8, 16], "offset": 12},
    ]
    assert cache.tokens[0][3] == "img 0 (0, 0)" and cache.tokens[0][8] == "img 0 (1, 2)"
    assert cache.tokens[0][13] == "img 1 (0, 1)" and cache.tokens[0][9] == str(END)
    # what the last word reads of each picture, from eager's weights
    for image, (at, shape) in enumerate(((3, (2, 3)), (12, (1, 2)))):
        got = probe.attention_map(cache, 1, query=16, stack=lm, image=image)
        n = shape[0] * shape[1]
        want = out.attentions[1][0, :, 16, at : at + n].mean(0).reshape(shape)
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    # the share of the words' attention on the pictures (text after the first image token)
    stats = {(r["stack"], r["layer"], r["head"]): r for r in probe.head_stats(cache, progress=False).table}
    image = [*range(3, 9), 12, 13]
    text = [i for i in range(3, 17) if i not in image]
    w = out.attentions[0][0, 1].double()
    want = sum(float(w[i, image].sum()) for i in text) / len(text)
    assert abs(stats[(lm, 0, 1)]["on_image"] - want) < 1e-5


def test_qwen2_vl_image_tokens_that_do_not_fit_the_pictures(qwen_run):
    model = qwen_run[0]
    # one picture's tokens too few: the model's own check, as one line
    short = _qwen_inputs([1, START] + [IMAGE] * 5 + [END, START] + [IMAGE] * 2 + [END, 7])
    with pytest.raises(ProbeError, match="refused these inputs") as e:
        probe.capture(model, short)
    assert "\n" not in str(e.value)


# -- probe.trace around a forward the user runs on pixels ---------------------------------------------
def test_trace_of_a_pixel_forward_names_the_positions():
    from test_images import _vit

    model, eager = _vit()  # 4 x 6 patches of a 32 x 48 picture
    x = torch.randn(1, 3, 32, 48, generator=torch.Generator().manual_seed(6))
    with probe.trace(model) as t:
        model(pixel_values=x)
    cache = t.cache
    with torch.no_grad():
        want = eager(pixel_values=x, output_attentions=True).attentions
    grid = cache.metadata["stacks"]["encoder"]["positions"]["grid"]
    assert (grid["rows"], grid["cols"], grid["offset"]) == (4, 6, 1)
    assert cache.tokens[0][:2] == ["[CLS]", "patch (0, 0)"] and cache.metadata["image_png"]
    got = probe.attention_map(cache, 1)
    torch.testing.assert_close(got, want[1][0, :, 0, 1:].mean(0).reshape(4, 6), atol=TOL, rtol=0)


# -- Swin: a map on each stage's own grid, one block of the stage at a time ---------------------------
def test_swin_maps_each_stage_on_its_own_grid():
    from test_swin import _build, _eager_windows, _on_grid, _pixels

    model = _build("swin")  # 48 x 80 pixels: 12 x 20 patches, then 6 x 10 after the merging
    x = _pixels(batch=1)
    cache = probe.capture(model, {"pixel_values": x})
    blocks, _ = _eager_windows(model, x)
    for layer, index, (rows, cols) in ((0, 1, (12, 20)), (1, 1, (6, 10)), (1, 0, (6, 10))):
        w, (H, W), ws, shift = blocks[2 * layer + index]
        grid = _on_grid(w, 1, H, W, ws, shift)[0]  # the eager windows laid on the grid, here
        q = 2 * cols + 3  # patch (2, 3) of the stage's grid
        got = probe.attention_map(cache, layer, query=(2, 3), index=index)
        torch.testing.assert_close(got, grid[:, q].mean(0).reshape(rows, cols), atol=TOL, rtol=0)
        got = probe.attention_map(cache, layer, head=1, query=(2, 3), index=index)
        torch.testing.assert_close(got, grid[1, q].reshape(rows, cols), atol=TOL, rtol=0)
    with pytest.raises(ProbeError, match="outside the 6x10 grid"):
        probe.attention_map(cache, 1, query=(7, 0), index=0)
    with pytest.raises(ProbeError, match="grids of their own"):
        probe.attention_map(cache, 1, query="rollout")
    # head statistics read one attention per layer: said, not skipped silently
    with pytest.raises(ProbeError, match="hold several"):
        probe.head_stats(cache, progress=False)


# -- a vision-language cache end to end: saved, loaded, read by the other analyses -----------------------
def test_a_llava_cache_saves_loads_and_reads_like_any_other(tmp_path):
    from test_images import _llava

    model, eager = _llava()
    ids = torch.tensor([[1, 5] + [95] * 16 + [7, 8]])
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(7))[:1]
    inputs = {"input_ids": ids, "pixel_values": pixels, "attention_mask": torch.ones_like(ids)}
    cache = probe.capture(model, inputs)
    streamed = probe.capture(model, inputs, out=tmp_path / "llava.safetensors")  # written layer by layer
    cache.save(tmp_path / "saved.safetensors")
    loaded = probe.load(tmp_path / "saved.safetensors")
    lm, tower = "model.language_model.layers", "model.vision_tower.encoder.layers"
    with torch.no_grad():
        out = eager(**inputs, output_attentions=True, output_hidden_states=True)
    for c in (streamed, loaded):
        torch.testing.assert_close(c.pattern(lm, 1), out.attentions[1], atol=TOL, rtol=0)
        assert c.metadata["stacks"][tower]["tokens"] is None  # its positions are the picture's
    # the residual stream of both stacks, each over its own positions: the tower's picture (17), the
    # text (20); its norm leaving the language model's last layer is eager's last hidden state's
    stats = probe.residual(loaded)
    rows = [
        r for r in stats.tokens if r["stack"] == tower and r["layer"] == 0 and r["sublayer"] == "self_attn"
    ]
    assert len(rows) == 17
    post = [r for r in stats.layers if r["stack"] == lm and r["layer"] == 1 and r["sublayer"] == "self_attn"]
    assert post[0]["tokens"] == 20
    want = float(out.hidden_states[1][0].norm(dim=-1).mean())  # the stream entering layer 1
    assert abs(post[0]["mean_norm_E"] - want) < 1e-4 * want
    assert loaded.head_ids(lm, 1) == [0, 1, 2, 3] and len(loaded.axes(lm)[0].tokens) == 20


def test_swin_stage_maps_and_the_reports_picture_section(tmp_path):
    from test_swin import _build, _eager_windows, _on_grid, _pixels

    model = _build("swin")
    x = _pixels(batch=1)
    cache = probe.capture(model, {"pixel_values": x})
    blocks, _ = _eager_windows(model, x)
    fig = probe.plot.stage_maps(cache)
    centres = [(6, 10), (6, 10), (3, 5), (3, 5)]  # each stage's centre patch: 12 x 20, then 6 x 10
    for ax, (w, (H, W), ws, shift), (r, c) in zip(fig.axes[:4], blocks, centres, strict=True):
        want = _on_grid(w, 1, H, W, ws, shift)[0][:, r * W + c].mean(0).reshape(H, W)
        got = torch.as_tensor(ax.images[-1].get_array().data)
        torch.testing.assert_close(got.float(), want, atol=TOL, rtol=0)
    page = probe.report(cache, tmp_path / "r", progress=False).read_text(encoding="utf-8")
    assert "what the centre patch of each stage reads" in page and "Attention on the picture" in page


def test_attentions_of_other_modules_are_not_joined_as_heads():
    # MobileViT runs a small transformer inside one stage of its encoder: its inner layers' softmaxes
    # share a shape, and they used to be stored side by side as heads of one layer; now each is an
    # attention of its own, and a layer holding two of them in one sublayer is refused, named
    cfg = tf.MobileViTConfig(
        image_size=64, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 48]
    )
    torch.manual_seed(0)
    model = tf.MobileViTModel(cfg).eval()
    with pytest.raises(ProbeError, match="computes 2 self-attention patterns, not each in a sublayer"):
        probe.capture(model, {"pixel_values": torch.randn(1, 3, 64, 64)})


# -- ViTDet-style attention: the batch and the heads in one axis of the softmax -----------------------
def _spatial_oracle(model, x):
    """Each attention module's weights by hand, one (batch, head) at a time: its input map
    ``[b, H, W, C]`` recorded by a pre-hook, ``qkv`` cut per head, the scores (plus the family's
    own decomposed relative-position bias of that one query slice) and their softmax; unambiguous
    in the batch and heads, whatever order the module flattens them in."""
    import transformers.models.vitdet.modeling_vitdet as vd

    maps, handles = [], []
    for m in model.modules():
        if isinstance(getattr(m, "qkv", None), torch.nn.Linear) and hasattr(m, "rel_pos_h"):
            hook = lambda mod, args, kw: maps.append((mod, args[0] if args else next(iter(kw.values()))))  # noqa: E731
            handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(pixel_values=x)
    finally:
        for h in handles:
            h.remove()
    out = []
    for m, hidden in maps:
        b, H, W, C = hidden.shape
        heads = getattr(m, "num_heads", None) or m.num_attention_heads
        qkv = m.qkv(hidden).reshape(b, H * W, 3, heads, C // heads)
        want = torch.zeros(b, heads, H * W, H * W)
        for i in range(b):
            for j in range(heads):
                q, k = qkv[i, :, 0, j], qkv[i, :, 1, j]
                s = (q * m.scale) @ k.T
                rel = (m.rel_pos_h, m.rel_pos_w, (H, W), (H, W))
                if isinstance(m, vd.VitDetAttention) and m.use_relative_position_embeddings:
                    s = vd.add_decomposed_relative_positions(s[None], q[None], *rel)[0]
                elif getattr(m, "use_rel_pos", False):
                    s = s + m.get_decomposed_rel_pos(q[None], *rel).reshape(s.shape)
                want[i, j] = s.softmax(-1)
        out.append(want)
    return out


def test_vitdet_slanext_pp_formulanet_windows_and_global_blocks_against_hand_weights():
    # two pictures (the batch and the heads share the softmax's first axis: swapped, they would
    # differ); block 0 windowed (an 8 x 8 grid in 3 x 3 windows, padded to 9 x 9), block 1 global
    torch.manual_seed(0)
    cfg = tf.VitDetConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, image_size=64,
        patch_size=8, pretrain_image_size=64, window_size=3, window_block_indices=[0],
        use_relative_position_embeddings=True,
    )  # fmt: skip
    vitdet = tf.VitDetModel(cfg).eval()
    vis = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_dim=64, image_size=64,
        patch_size=8, window_size=3, global_attn_indexes=[1],
    )  # fmt: skip
    slanext = tf.SLANeXtForTableRecognition(tf.SLANeXtConfig(vision_config=vis)).eval()
    formula = tf.PPFormulaNetVisionModel(tf.PPFormulaNetVisionConfig(**vis)).eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(8))
    for model in (vitdet, slanext, formula):
        cache = probe.capture(model, {"pixel_values": x})
        want = _spatial_oracle(model, x)
        assert [tuple(w.shape) for w in want] == [(18, 4, 9, 9), (2, 4, 64, 64)]
        for layer in range(2):
            torch.testing.assert_close(cache.pattern("encoder", layer), want[layer], atol=TOL, rtol=0)
        assert "batch · heads" in cache.metadata["layers"][1]["self_attn"]["kind"]


def test_batch_and_heads_in_an_order_probe_cannot_read_are_refused():
    # the same attention with its first axis flattened heads first: probe does not read that code
    # as batch first, so the layer is refused, named, rather than stored with the batch and heads mixed
    import transformers.models.vitdet.modeling_vitdet as vd

    class HeadsFirst(vd.VitDetAttention):
        def forward(self, hidden_state, output_attentions=False):
            b, h, w, _ = hidden_state.shape
            qkv = self.qkv(hidden_state).reshape(b, h * w, 3, self.num_heads, -1).permute(2, 3, 0, 1, 4)
            q, k, v = qkv.reshape(3, self.num_heads * b, h * w, -1).unbind(0)
            probs = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
            out = (probs @ v).view(self.num_heads, b, h, w, -1).permute(1, 2, 3, 0, 4).reshape(b, h, w, -1)
            return (self.proj(out),)

    torch.manual_seed(0)
    cfg = tf.VitDetConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, image_size=32,
        patch_size=8, pretrain_image_size=32,
    )  # fmt: skip
    model = tf.VitDetModel(cfg).eval()
    layer = model.encoder.layer[1]
    swapped = HeadsFirst(cfg, input_size=(4, 4))
    swapped.load_state_dict(layer.attention.state_dict())
    layer.attention = swapped
    with pytest.raises(ProbeError, match=r"encoder\.layer\.1.*cannot tell the batch from the heads") as e:
        probe.capture(model, {"pixel_values": torch.randn(2, 3, 32, 32)})
    assert "\n" not in str(e.value)
