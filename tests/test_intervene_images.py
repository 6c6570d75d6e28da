"""The interventions on pictures and sound (issue 30): ``probe.ablate``, ``probe.knockout``,
``probe.patch``, ``probe.head_importance`` and ``probe.intervene`` take pictures with
``processor=`` (and ``text=`` beside them for a vision-language model) and sound with
``processor=``/``sampling_rate=``, prepared by ``probe.capture``'s own entry.

Oracles, all written here: the processor's own output run through the model with forward hooks
that zero or replace a head's slice of the output projection's input (or the residual entering a
layer), a mask written here given to the eager twin, the metrics computed from the logits here;
and the same intervention given the processor's ``BatchFeature``. Random-weight tiny models.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image
from test_images import SMALL, _llava, _processor
from test_vlm_text import llava_processor

import probe
from probe.errors import ProbeError

tf.logging.set_verbosity_error()
LM = "model.language_model.layers"
TEXT = "USER: <image> what is the cat"
D_HEAD = 8  # hidden 32 over 4 heads


@contextmanager
def hooked(module, hook, kwargs: bool = False):
    """A forward pre-hook on ``module`` for the block."""
    handle = module.register_forward_pre_hook(hook, with_kwargs=kwargs)
    try:
        yield
    finally:
        handle.remove()


def zero_head(head: int):
    """A pre-hook zeroing ``head``'s slice of the output projection's input."""

    def hook(module, args):
        x = args[0].clone()
        x[..., head * D_HEAD : (head + 1) * D_HEAD] = 0
        return (x,) + tuple(args[1:])

    return hook


def _arrays(n: int, seed: int, shape=(40, 60, 3)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(n)]


@pytest.fixture(scope="module")
def vit():
    """A ViT classifier of 32 x 48 pictures (4 x 6 patches + [CLS], 3 labels) and its processor."""
    cfg = tf.ViTConfig(**SMALL, image_size=(32, 48), patch_size=8, num_labels=3)
    torch.manual_seed(0)
    return tf.ViTForImageClassification(cfg).eval(), _processor()


@pytest.fixture(scope="module")
def llava():
    model, eager = _llava()
    return model, eager, llava_processor()


def _logits(model, batch, *hooks):
    """``model(**batch).logits`` with ``(module, pre-hook)`` pairs installed."""
    handles = [m.register_forward_pre_hook(h) for m, h in hooks]
    try:
        with torch.no_grad():
            return model(**batch).logits
    finally:
        for h in handles:
            h.remove()


# -- ablation ------------------------------------------------------------------------------------------
def test_ablate_a_head_from_pictures_files_and_arrays(vit, tmp_path):
    model, proc = vit
    a, b = _arrays(2, 0)
    Image.fromarray(a).save(tmp_path / "cat.png")
    batch = proc(images=[Image.fromarray(a), Image.fromarray(b)], return_tensors="pt")  # the oracle's inputs
    want = _logits(model, batch, (model.vit.layers[1].attention.o_proj, zero_head(2)))
    clean = _logits(model, batch)
    got = probe.ablate(model, [tmp_path / "cat.png", b], [(1, 2)], processor=proc)
    torch.testing.assert_close(got.outputs.logits, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.clean.logits, clean, atol=0, rtol=0)
    assert got.summary["max_abs_change"] == pytest.approx(float((want - clean).abs().max()), abs=1e-6)
    assert got.summary["max_abs_change"] > 1e-4
    # the same ablation given the processor's BatchFeature
    same = probe.ablate(model, batch, [(1, 2)])
    torch.testing.assert_close(same.outputs.logits, got.outputs.logits, atol=0, rtol=0)


def test_mean_ablation_over_reference_pictures(vit):
    # how="mean": head 1 of layer 0 replaced by its mean over the reference pictures' positions
    model, proc = vit
    pics, ref = _arrays(2, 1), _arrays(3, 2, shape=(50, 50, 3))
    batch = proc(images=pics, return_tensors="pt")
    o_proj = model.vit.layers[0].attention.o_proj
    seen = []
    with hooked(o_proj, lambda m, args: seen.append(args[0][..., 8:16].clone())), torch.no_grad():
        model(**proc(images=ref, return_tensors="pt"))
    mean = seen[0].reshape(-1, D_HEAD).mean(0)  # over 3 pictures x 25 positions

    def put_mean(module, args):
        x = args[0].clone()
        x[..., 8:16] = mean
        return (x,)

    want = _logits(model, batch, (o_proj, put_mean))
    got = probe.ablate(model, pics, [(0, 1)], how="mean", reference=ref, processor=proc)
    torch.testing.assert_close(got.outputs.logits, want, atol=1e-6, rtol=0)
    assert float((want - got.clean.logits).abs().max()) > 1e-5


def test_vlm_ablation_and_intervene_block_from_text_and_pictures(llava):
    model, _, proc = llava
    pics = [Image.fromarray(x) for x in _arrays(2, 3)]
    texts = ["USER: <image> what is the cat", "<image> a red dog"]  # two lengths: padded
    batch = proc(images=pics, text=texts, return_tensors="pt", padding=True)
    o_proj = model.model.language_model.layers[1].self_attn.o_proj
    clean = _logits(model, batch)
    want = _logits(model, batch, (o_proj, zero_head(2)))
    got = probe.ablate(model, pics, [(LM, 1, 2)], processor=proc, text=texts)
    torch.testing.assert_close(got.outputs.logits, want, atol=1e-5, rtol=0)
    # the same edit as a block: every forward inside it runs ablated, the model restored after
    with probe.intervene(model, pics, ablate=[(LM, 1, 2)], processor=proc, text=texts) as iv:
        torch.testing.assert_close(iv.outputs.logits, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(_logits(model, batch), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(_logits(model, batch), clean, atol=0, rtol=0)
    torch.testing.assert_close(iv.clean.logits, clean, atol=0, rtol=0)
    assert float((want - clean).abs().max()) > 1e-4


# -- knockout --------------------------------------------------------------------------------------------
def test_knockout_of_the_image_tokens_for_a_word(llava):
    # "cat" (the last position) may not read any of the picture's 16 image tokens, in every layer
    # and head of the language model; oracle: the eager twin given an additive mask written here
    model, eager, proc = llava
    pics = [Image.fromarray(_arrays(1, 4)[0])]
    batch = proc(images=pics, text=TEXT, return_tensors="pt")
    ids = batch["input_ids"][0].tolist()
    T, at = len(ids), ids.index(95)
    q = T - 1
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    allowed[q, at : at + 16] = False
    mask = torch.zeros(T, T).masked_fill(~allowed, float("-inf"))[None, None]
    with torch.no_grad():
        want = eager(**(dict(batch) | {"attention_mask": mask})).logits
    got = probe.knockout(model, pics, [(q, range(at, at + 16))], processor=proc, text=TEXT, stack=LM)
    torch.testing.assert_close(got.outputs.logits, want, atol=1e-5, rtol=0)
    change = (got.outputs.logits - got.clean.logits)[0].abs().amax(-1)
    assert float(change[q]) > 1e-3 and float(change[:q].max()) < 1e-5  # only the word's own row moves
    assert len(got.table) == 2 * 4 and all(r["ops"] == 1 for r in got.table)
    # the same knockout given the processor's output
    same = probe.knockout(model, batch, [(q, range(at, at + 16))], stack=LM)
    torch.testing.assert_close(same.outputs.logits, got.outputs.logits, atol=0, rtol=0)


# -- patching --------------------------------------------------------------------------------------------
def _resid_patched(model, layer: int, pos: int, clean_batch, corrupt_batch):
    """The corrupted run's logits with the residual entering ``layer`` at ``pos`` taken from the
    clean run (pre-hooks on the layer module, written here)."""
    block = model.vit.layers[layer]
    saved = []

    def keep(module, args, kwargs):
        saved.append((args[0] if args else kwargs["hidden_states"]).clone())

    with hooked(block, keep, kwargs=True), torch.no_grad():
        model(**clean_batch)

    def put(module, args, kwargs):
        x = (args[0] if args else kwargs["hidden_states"]).clone()
        x[:, pos] = saved[0][:, pos]
        return ((x,) + tuple(args[1:]), kwargs) if args else (args, kwargs | {"hidden_states": x})

    with hooked(block, put, kwargs=True), torch.no_grad():
        return model(**corrupt_batch).logits


def test_patch_clean_and_corrupted_pictures(vit):
    model, proc = vit
    clean, corrupt = _arrays(2, 5), _arrays(2, 6)
    cb, xb = proc(images=clean, return_tensors="pt"), proc(images=corrupt, return_tensors="pt")

    def diff(logits):  # label 0 minus label 1, mean over the pictures
        return float((logits[:, 0] - logits[:, 1]).mean())

    kw = dict(what="resid", positions=[0, 7], metric="logit_diff")
    got = probe.patch(model, clean, corrupt, processor=proc, answer="LABEL_0", wrong="LABEL_1", **kw)
    with torch.no_grad():
        m_clean, m_corr = diff(model(**cb).logits), diff(model(**xb).logits)
    assert got.clean == pytest.approx(m_clean, abs=1e-6) and got.corrupted == pytest.approx(m_corr, abs=1e-6)
    rows = {(r["layer"], r["pos"]): r for r in got.table}
    assert len(rows) == 2 * 2
    for (layer, pos), r in rows.items():
        m = diff(_resid_patched(model, layer, pos, cb, xb))
        assert r["metric"] == pytest.approx(m, abs=1e-5)
        assert r["normalised"] == pytest.approx((m - m_corr) / (m_clean - m_corr), abs=1e-4)
    assert rows[(0, 0)]["token"] == "[CLS]" and rows[(0, 7)]["token"] == "patch (1, 0)"
    # the same from the processor's BatchFeatures
    same = probe.patch(model, cb, xb, answer=0, wrong=1, **kw)  # label ids: the same labels
    assert [r["metric"] for r in same.table] == [r["metric"] for r in got.table]


def test_patch_heads_between_pictures_read_beside_one_text(llava):
    # a vision-language model: the same text beside a clean and a corrupted picture; head 3 of
    # layer 0 patched from the clean run into the corrupted one, by hand here
    model, _, proc = llava
    clean, corrupt = [Image.fromarray(_arrays(1, 7)[0])], [Image.fromarray(_arrays(1, 8)[0])]
    cb = proc(images=clean, text=TEXT, return_tensors="pt")
    xb = proc(images=corrupt, text=TEXT, return_tensors="pt")
    got = probe.patch(
        model, clean, corrupt, processor=proc, text=TEXT, what="heads", metric="prob", answer=7, stack=LM
    )
    o_proj = model.model.language_model.layers[0].self_attn.o_proj
    saved = []
    with hooked(o_proj, lambda m, args: saved.append(args[0].clone())), torch.no_grad():
        model(**cb)

    def put(module, args):
        x = args[0].clone()
        x[..., 24:32] = saved[0][..., 24:32]
        return (x,)

    want = float(_logits(model, xb, (o_proj, put))[0, -1].softmax(-1)[7])
    row = next(r for r in got.table if (r["layer"], r["head"]) == (0, 3))
    assert row["metric"] == pytest.approx(want, abs=1e-6)
    assert got.clean == pytest.approx(float(_logits(model, cb)[0, -1].softmax(-1)[7]), abs=1e-6)
    assert got.clean != pytest.approx(got.corrupted, abs=1e-6)


# -- head importance ------------------------------------------------------------------------------------
def test_head_importance_of_pictures_against_ablations_here(vit):
    model, proc = vit
    pics = _arrays(2, 9)
    batch = proc(images=pics, return_tensors="pt")

    def prob(logits):  # p(label 1), mean over the pictures
        return float(logits.softmax(-1)[:, 1].mean())

    got = probe.head_importance(model, pics, processor=proc, metric="prob", answer=1)
    base = prob(_logits(model, batch))
    assert not got.notes  # batched: the pictures repeated once per head
    for r in got.table:
        o_proj = model.vit.layers[r["layer"]].attention.o_proj
        m = prob(_logits(model, batch, (o_proj, zero_head(r["head"]))))
        assert r["metric"] == pytest.approx(base, abs=1e-6)
        assert r["ablated"] == pytest.approx(m, abs=1e-6)
    assert len(got.table) == 2 * 4 and max(abs(r["change"]) for r in got.table) > 1e-5


def test_head_importance_of_a_text_beside_a_picture(llava):
    # the default metric: next-token loss over the processor's ids (image tokens included),
    # computed here from the logits
    model, _, proc = llava
    pics = [Image.fromarray(_arrays(1, 10)[0])]
    batch = proc(images=pics, text=TEXT, return_tensors="pt")
    ids = batch["input_ids"]

    def loss(logits):
        return float(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]))

    got = probe.head_importance(model, pics, processor=proc, text=TEXT, stack=LM)
    one = probe.head_importance(model, pics, processor=proc, text=TEXT, stack=LM, batched=False)
    assert not got.notes and one.notes == []
    for r, r1 in zip(got.table, one.table, strict=True):
        o_proj = model.model.language_model.layers[r["layer"]].self_attn.o_proj
        m = loss(_logits(model, batch, (o_proj, zero_head(r["head"]))))
        assert r["ablated"] == pytest.approx(m, abs=1e-5) and r1["ablated"] == pytest.approx(m, abs=1e-5)
        assert r["metric"] == pytest.approx(loss(_logits(model, batch)), abs=1e-5)


# -- sound -----------------------------------------------------------------------------------------------
def test_ablate_a_head_from_waveforms():
    pytest.importorskip("scipy")
    from test_audio import RATE, _raw_extractor, _w2v, _wave

    model, fe = _w2v("wav2vec2", attn="sdpa"), _raw_extractor()
    waves = [_wave(0.1, seed=1), _wave(0.0725, freq=220, seed=2)]
    batch = fe(waves, sampling_rate=RATE, return_tensors="pt", padding="longest")
    out_proj = model.encoder.layers[1].attention.out_proj
    with hooked(out_proj, zero_head(0)), torch.no_grad():
        want = model(**batch).last_hidden_state
    got = probe.ablate(model, waves, [(1, 0)], processor=fe, sampling_rate=RATE)
    torch.testing.assert_close(got.outputs.last_hidden_state, want, atol=1e-5, rtol=0)
    assert float((want - got.clean.last_hidden_state).abs().max()) > 1e-4


# -- bad input: one line each ----------------------------------------------------------------------------
def test_bad_inputs_are_one_line_each(vit, llava):
    model, proc = vit
    lm, _, lproc = llava
    pics = _arrays(1, 11)
    cases = [
        (lambda: probe.ablate(model, "a text", [(1, 2)], processor=proc), r"^processor= takes pictures"),
        (lambda: probe.ablate(model, pics, [(1, 2)], text="a cat"), r"^text= is read beside pictures"),
        (lambda: probe.ablate(model, "a cat", [(1, 2)], text="a cat"), r"^text= is read beside pictures"),
        (lambda: probe.ablate(model, pics, [(1, 2)]), r"^pictures need processor="),
        (
            lambda: probe.ablate(
                model, {"pixel_values": torch.zeros(1, 3, 32, 48)}, [(1, 2)], processor=proc
            ),
            r"^processor= takes pictures.*got a dict of keyword tensors: pass it without processor=",
        ),
        (
            lambda: probe.ablate(model, pics, [(1, 2)], processor=proc, text="a cat"),
            r"^text= needs a vision-language",
        ),
        (lambda: probe.knockout(model, pics, [(0, 1)], processor=proc, target="x"), r"^target= is for texts"),
        (lambda: probe.patch(model, pics, "a text", processor=proc), r"^processor= takes pictures"),
        (
            lambda: probe.ablate(model, pics, [(0, 0)], how="mean", reference="a text", processor=proc),
            r"^processor= takes pictures",
        ),
        (
            lambda: probe.head_importance(model, pics, processor=proc),
            r"^metric='loss' needs token ids .* for a classifier use metric='prob'",
        ),
        (
            lambda: probe.knockout(lm, pics, [(-1, 0)], processor=lproc, text="USER: what", stack=LM),
            r"^the text holds no '<image>' token for 1 picture",
        ),
    ]
    for call, pattern in cases:
        with pytest.raises(ProbeError, match=pattern) as err:
            call()
        assert "\n" not in str(err.value), str(err.value)


def test_cli_ablate_and_patch_pictures_of_the_zoo_vit(tmp_path, capsys):
    """``probe ablate --image`` and ``probe patch --images``: the numbers the Python calls give
    (themselves held to hooks above), from picture files, for the zoo ViT and its own processor."""
    import models
    from models import shapes
    from probe.cli import main

    vit = models.load("vit_zoo")
    data = shapes.generate(3, seed=4)
    files = []
    for i, img in enumerate(data.images):
        files.append(tmp_path / f"p{i}.png")
        shapes.to_pil(img).save(files[-1])
    capsys.readouterr()
    assert main(["ablate", "--model", "vit-zoo", "--image", str(files[0]), "--heads", "0.1"]) == 0
    want = probe.ablate(vit, [files[0]], [(0, 1)], processor=vit.processor)
    line = "effect on the outputs: " + ", ".join(f"{k} {v:.4g}" for k, v in want.summary.items())
    assert line in capsys.readouterr().out
    a, w = int(data.labels[0]), int(data.labels[2])
    argv = ["patch", "--model", "vit-zoo", "--images", "--clean", str(files[0]), "--corrupted", str(files[2])]
    argv += [
        "--positions",
        "0,3",
        "--answer",
        f"id:{a}",
        "--wrong",
        f"id:{w}",
        "--save",
        str(tmp_path / "p.json"),
    ]
    capsys.readouterr()
    assert main(argv) == 0
    printed = capsys.readouterr().out
    swap = probe.patch(
        vit,
        files[0],
        files[2],
        processor=vit.processor,
        positions=[0, 3],
        metric="logit_diff",
        answer=a,
        wrong=w,
    )
    assert str(swap) in printed and "[CLS]" in printed
    assert main(["ablate", "--model", "minigpt", "--image", str(files[0]), "--heads", "0.1"]) == 2
    assert "image model" in capsys.readouterr().err
    assert main(["patch", "--model", "minigpt", "--clean", "a", "--corrupted", "b", "extra text"]) == 2
    assert "--images" in capsys.readouterr().err
