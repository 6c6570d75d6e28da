"""Swin's windowed attention mapped back onto each stage's patch grid (issue 30, item 3).

Oracle: each block's eager window weights (a hook on the block's attention module, the tensor
``output_attentions`` returns, checked against it for the blocks it returns), laid on the grid
here by a loop that repeats the model's own steps on a grid of position ids (pad to a multiple of
the window, ``torch.roll`` by ``-shift``, cut windows), with the grid each block was handed
(``input_dimensions``, read by a hook). Never probe's own output.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import probe
from probe.errors import ProbeError

tf.logging.set_verbosity_error()
TOL = 1e-6
# 48 x 80 pixels, 4-pixel patches: stage 0 is 12 x 20 patches, 3 x 5 windows of 4 x 4 (non-square,
# so rows and columns cannot be swapped unnoticed); stage 1 is 6 x 10, padded to 8 x 12 (2 x 3
# windows). Blocks 0 of each stage are unshifted, blocks 1 shifted by 2.
SIZE = dict(image_size=(48, 80), patch_size=4, embed_dim=8, depths=[2, 2], num_heads=[2, 2], window_size=4)
FAMILIES = {
    "swin": (tf.SwinModel, tf.SwinConfig),
    "swinv2": (tf.Swinv2Model, tf.Swinv2Config),
    "donut-swin": (tf.DonutSwinModel, tf.DonutSwinConfig),
    "maskformer-swin": (tf.MaskFormerSwinModel, tf.MaskFormerSwinConfig),
}


def _block_modules(model):
    names = ("SwinLayer", "Swinv2Layer", "DonutSwinLayer", "MaskFormerSwinLayer")
    return [m for m in model.modules() if type(m).__name__ in names]


def _eager_windows(model, x):
    """Per block, in order: (window weights, (H, W) handed to the block, window size, shift)."""
    seen, hooks = [], []
    for block in _block_modules(model):

        def pre(mod, args, kwargs):
            dims = args[1] if len(args) > 1 else kwargs["input_dimensions"]
            seen.append([None, tuple(int(v) for v in dims), None, None])

        def post(mod, args, out, block=block):
            seen[-1][0] = out[1].detach()
            seen[-1][2:] = [int(block.window_size), int(block.shift_size)]

        hooks.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(block.attention.register_forward_hook(post))
    # MaskFormerSwin's encoder reads its attentions out of the hidden states it collects (it fails
    # without output_hidden_states, and returns hidden states as "attentions"): only the hook's
    # weights are its oracle
    maskformer = isinstance(model, tf.MaskFormerSwinModel)
    try:
        with torch.no_grad():
            out = model(pixel_values=x, output_attentions=True, output_hidden_states=maskformer)
    finally:
        for h in hooks:
            h.remove()
    return seen, None if maskformer else out.attentions


def _slots(H, W, ws, shift):
    """The position id (r * W + c, -1 for padding) of each window slot, by the model's own steps."""
    Hp, Wp = -(-H // ws) * ws, -(-W // ws) * ws
    ids = torch.full((Hp, Wp), -1)
    ids[:H, :W] = torch.arange(H * W).view(H, W)
    ids = torch.roll(ids, shifts=(-shift, -shift), dims=(0, 1))
    return [
        ids[i : i + ws, j : j + ws].flatten().tolist() for i in range(0, Hp, ws) for j in range(0, Wp, ws)
    ]


def _on_grid(w, batch, H, W, ws, shift):
    """Window weights ``w`` [batch * windows, heads, ws², ws²] laid on the [batch, heads, HW, HW] grid."""
    slots = _slots(H, W, ws, shift)
    out = torch.zeros(batch, w.shape[1], H * W, H * W)
    for b in range(batch):
        for n, ids in enumerate(slots):
            win = w[b * len(slots) + n]
            cols = [c for c, k in enumerate(ids) if k >= 0]
            keys = [ids[c] for c in cols]
            for a, q in enumerate(ids):
                if q >= 0:
                    out[b, :, q, keys] = win[:, a, cols]
    return out


def _regions(H, W, ws, shift):
    """The shifted-window mask's region of each position (Swin's three bands per axis, labelled
    on the rolled grid, read back at each position's own place)."""
    Hp, Wp = -(-H // ws) * ws, -(-W // ws) * ws
    ids = torch.full((Hp, Wp), -1)
    ids[:H, :W] = torch.arange(H * W).view(H, W)
    ids = torch.roll(ids, shifts=(-shift, -shift), dims=(0, 1))
    band = lambda n, i: 0 if i < n - ws else (1 if i < n - shift else 2)  # noqa: E731
    region = torch.zeros(H * W, dtype=torch.long)
    for i in range(Hp):
        for j in range(Wp):
            if ids[i, j] >= 0:
                region[ids[i, j]] = band(Hp, i) * 3 + band(Wp, j)
    return region


def _build(family, impl="eager", **over):
    cls, cfg_cls = FAMILIES[family]
    cfg = cfg_cls(**{**SIZE, **over})
    torch.manual_seed(0)
    return cls._from_config(cfg, attn_implementation=impl).eval()


def _pixels(batch=2, size=(48, 80)):
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(1))


def _check(model, eager, x, grids=((12, 20), (6, 10))):
    cache = probe.capture(model, {"pixel_values": x})
    blocks, returned = _eager_windows(eager, x)
    assert [b[1] for b in blocks] == [grids[0], grids[0], grids[1], grids[1]]
    assert [b[3] for b in blocks] == [0, 2, 0, 2] and {b[2] for b in blocks} == {4}
    # the hook's weights are what output_attentions returns, for the blocks it returns
    if returned is not None:
        last = [blocks[1][0], blocks[3][0]] if len(returned) == 2 else [b[0] for b in blocks]
        for got, want in zip(last, returned, strict=True):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
    for i, (w, (H, W), ws, shift) in enumerate(blocks):
        want = _on_grid(w, x.shape[0], H, W, ws, shift)
        got = cache[f"encoder.blocks.{i // 2}.self_attn.{i % 2}.pattern"]
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    return cache, blocks


@pytest.mark.parametrize("family", list(FAMILIES))
def test_windows_are_mapped_onto_each_stage_grid_exactly(family):
    model = _build(family)
    cache, blocks = _check(model, model, _pixels())
    pos = cache.metadata["stacks"]["encoder"]["positions"]
    grid = {"rows": 12, "cols": 20, "patch": [4, 4], "image": [48, 80], "offset": 0}
    assert pos["grid"] == grid and pos["kinds"] == ["patch"] * 240
    assert pos["layer_grids"] == {"0": grid, "1": {**grid, "rows": 6, "cols": 10, "patch": [8, 8]}}
    assert cache.tokens[0][:2] == ["patch (0, 0)", "patch (0, 1)"] and cache.tokens[1][20] == "patch (1, 0)"
    assert cache.metadata["layers"][1]["self_attn.1"]["kind"].startswith("windowed attention (Swin)")


def test_swin_default_sdpa_is_recomputed_onto_the_grid(tmp_path):
    model, eager = _build("swin", impl="sdpa"), _build("swin")
    eager.load_state_dict(model.state_dict())
    assert model.config._attn_implementation == "sdpa"
    x = _pixels()
    cache, _ = _check(model, eager, x)
    assert cache.metadata["attention_implementations"] == ["sdpa"]
    # streamed to a file (its shapes checked against the metadata when opened): the same patterns
    stored = probe.capture(model, {"pixel_values": x}, out=tmp_path / "swin.safetensors")
    for k in cache.keys():
        assert torch.equal(stored[k], cache[k]), k


def test_a_picture_the_model_pads_is_mapped_on_its_padded_grid():
    # 50 x 83 pixels: padded by the model to 52 x 84 (13 x 21 patches, 4 x 6 windows after the
    # grid is padded to 16 x 24); the patch merging pads 13 x 21 to 14 x 22: stage 1 is 7 x 11
    model = _build("swin")
    cache, _ = _check(model, model, _pixels(1, (50, 83)), grids=((13, 21), (7, 11)))
    grids = cache.metadata["stacks"]["encoder"]["positions"]["layer_grids"]
    assert [(g["rows"], g["cols"], g["patch"]) for g in grids.values()] == [(13, 21, [4, 4]), (7, 11, [8, 8])]


@pytest.mark.parametrize("family", ["swinv2", "maskformer-swin"])
def test_a_last_stage_smaller_than_a_window_is_mapped(family):
    # a third stage of 3 x 5 patches: Swinv2 clamps its window to 3 (no shift), MaskFormerSwin
    # keeps 4 x 4 windows, shifted, over the grid padded to 4 x 8 (Swin and DonutSwin fail there)
    model = _build(family, depths=[2, 2, 2], num_heads=[2, 2, 2])
    x = _pixels(1)
    cache = probe.capture(model, {"pixel_values": x})
    blocks, _ = _eager_windows(model, x)
    assert [b[1] for b in blocks[4:]] == [(3, 5), (3, 5)]
    assert [b[2:] for b in blocks[4:]] == ([[3, 0]] * 2 if family == "swinv2" else [[4, 0], [4, 2]])
    for i, (w, (H, W), ws, shift) in enumerate(blocks):
        got = cache[f"encoder.blocks.{i // 2}.self_attn.{i % 2}.pattern"]
        torch.testing.assert_close(got, _on_grid(w, 1, H, W, ws, shift), atol=TOL, rtol=0)


def test_shifted_windows_keep_the_mask_and_padding_is_dropped():
    model = _build("swin")
    x = _pixels()
    cache = probe.capture(model, {"pixel_values": x})
    blocks, _ = _eager_windows(model, x)
    # the shifted block of stage 0: pairs that share a window only across the wrap-around are
    # masked by the model (-100 before the softmax): their weights sit at their own places, ~0
    w, (H, W), ws, shift = blocks[1]
    got = cache["encoder.blocks.0.self_attn.1.pattern"]
    region = _regions(H, W, ws, shift)
    together = _on_grid(torch.ones_like(w), 1, H, W, ws, shift)[0, 0] > 0  # same window
    masked = together & (region[:, None] != region[None, :])
    assert int(masked.sum()) > 0
    assert float(got[:, :, masked].max()) < 1e-30
    assert float(got[:, :, ~together].abs().max()) == 0.0  # nothing outside a query's window
    # stage 1, unshifted: the 6 x 10 grid padded to 8 x 12; the bottom and right windows reach the
    # padding, whose weights are not stored: those rows sum to less than one, the others to one
    rows = cache["encoder.blocks.1.self_attn.0.pattern"].sum(-1)
    reach = torch.tensor([r >= 4 or c >= 8 for r in range(6) for c in range(10)])
    assert float(rows[:, :, reach].max()) < 1 - 1e-3
    torch.testing.assert_close(rows[:, :, ~reach], torch.ones_like(rows[:, :, ~reach]), atol=1e-5, rtol=0)


def test_a_grid_probe_cannot_read_is_refused_naming_the_layer():
    model = _build("swin")
    model.embeddings.patch_embeddings.patch_size = (8, 8)  # the model runs (48 and 80 divide by 8)
    with pytest.raises(ProbeError, match=r"layers encoder\.layers\.0 .*Swin's windows"):
        probe.capture(model, {"pixel_values": _pixels()})
