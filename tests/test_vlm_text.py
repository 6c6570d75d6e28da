"""Vision-language models from a text and pictures (issue 30): ``probe.capture(model, pictures,
processor=proc, text=...)``, the processor placing the image tokens in the text.

Every processor is built offline from small pieces: an image processor from keyword arguments
and a word-level tokenizer made here with the ``tokenizers`` library (the model's image token at
the model's id). Oracles: the processor's own output run through HF eager ``output_attentions``
of the same weights, the grids and labels computed here from the processor's ``input_ids`` (and
``image_grid_thw``), maps read off eager's weights here; never probe's own output.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image
from test_images import SMALL, TOL, _llava, _pair

import probe
from probe.errors import ProbeError

tf.logging.set_verbosity_error()
WORDS = "USER: ASSISTANT: what is the cat a dog on mat red".split()
LM = "model.language_model.layers"


def word_tokenizer(specials: dict[str, int], extra: dict[str, int] | None = None):
    """A whitespace word-level tokenizer: ``<pad>`` 0, ``<unk>`` 1, WORDS from 2, the special
    tokens (the image token among them) at the ids given, ``extra`` words at theirs."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<unk>": 1, **{w: 2 + i for i, w in enumerate(WORDS)}, **(extra or {})}
    vocab.update(specials)
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=t, unk_token="<unk>", pad_token="<pad>", additional_special_tokens=list(specials)
    )


def llava_processor(tokenizer=None, crop: int = 32, patch: int = 8):
    """LLaVA's processor for the test model of test_images (a CLIP tower of 32-pixel pictures,
    8-pixel patches, its [CLS] dropped: 16 image tokens a picture; ``<image>`` is id 95)."""
    images = tf.CLIPImageProcessorPil(size={"shortest_edge": crop}, crop_size={"height": crop, "width": crop})
    return tf.LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer if tokenizer is not None else word_tokenizer({"<image>": 95}),
        patch_size=patch,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )


def _pictures(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)
    b = rng.integers(0, 256, (36, 36, 3), dtype=np.uint8)
    Image.fromarray(a).save(tmp_path / "cat.png")
    return [tmp_path / "cat.png", b], [Image.fromarray(a), Image.fromarray(b)]


def _eager(eager, inputs):
    with torch.no_grad():
        return eager(**inputs, output_attentions=True).attentions


def _labels(ids: list[int], image: int, tok, grids: list[tuple[int, int, int]]) -> list[str]:
    """The labels a text's positions should read: the tokenizer's token, or ``patch (r, c)`` /
    ``img k (r, c)`` on the grids ``(offset, rows, cols)`` given here."""
    out = tok.convert_ids_to_tokens(ids)
    for k, (at, _rows, cols) in enumerate(grids):
        name = "patch" if len(grids) == 1 else f"img {k}"
        n = _rows * cols
        assert all(t == image for t in ids[at : at + n])
        for j in range(n):
            out[at + j] = f"{name} ({j // cols}, {j % cols})"
    return out


@pytest.fixture(scope="module")
def llava():
    return _llava()  # (sdpa model, eager twin)


def test_llava_from_text_and_pictures_against_eager(llava, tmp_path):
    model, eager = llava
    proc = llava_processor()
    given, pil = _pictures(tmp_path)
    texts = ["USER: <image> what is the cat ASSISTANT:", "<image> a red dog"]  # padded: 2 lengths
    cache = probe.capture(model, given, processor=proc, text=texts)
    inputs = proc(images=pil, text=texts, return_tensors="pt", padding=True)  # the oracle's inputs
    want = _eager(eager, inputs)
    for layer in range(2):
        torch.testing.assert_close(cache.pattern(LM, layer), want[layer], atol=TOL, rtol=0)
    ids = inputs["input_ids"].tolist()
    assert cache.metadata["ids"] == ids
    assert cache.metadata["attention_mask"] == inputs["attention_mask"].tolist()
    assert cache.metadata["prompts"] == texts and cache.metadata["images"] == ["cat.png", "image 1"]
    rows = cache.metadata["stacks"][LM]["positions"]["rows"]
    for b in range(2):
        at = ids[b].index(95)
        assert rows[b]["grids"] == [{"rows": 4, "cols": 4, "patch": [8, 8], "image": [32, 32], "offset": at}]
        assert cache.tokens[b] == _labels(ids[b], 95, proc.tokenizer, [(at, 4, 4)])
    assert cache.tokens[0][:3] == ["USER:", "patch (0, 0)", "patch (0, 1)"] and cache.tokens[1][-1] == "<pad>"
    # what "cat" (text 0) reads of its picture, from eager's weights
    q = cache.tokens[0].index("cat")
    got = probe.attention_map(cache, 1, query=q, stack=LM)
    torch.testing.assert_close(got, want[1][0, :, q, 1:17].mean(0).reshape(4, 4), atol=TOL, rtol=0)
    # the picture kept as the model saw it: the processor's normalisation (on its image processor) undone
    import base64
    import io

    seen = np.asarray(Image.open(io.BytesIO(base64.b64decode(cache.metadata["image_png"][1])))).astype(float)
    x = inputs["pixel_values"][1].permute(1, 2, 0).numpy()
    mean, std = proc.image_processor.image_mean, proc.image_processor.image_std
    assert np.abs(seen - np.clip(x * std + mean, 0, 1) * 255).max() <= 1.0


def test_keep_stats_and_the_saved_cache_of_a_text_with_pictures(llava, tmp_path):
    model, eager = llava
    proc = llava_processor()
    given, pil = _pictures(tmp_path)
    text = "USER: <image> what is the cat"
    out = tmp_path / "llava.safetensors"
    cache = probe.capture(model, given[:1], processor=proc, text=text, out=out)
    inputs = proc(images=pil[:1], text=text, return_tensors="pt")
    want = _eager(eager, inputs)
    torch.testing.assert_close(cache.pattern(LM, 0), want[0], atol=TOL, rtol=0)
    assert probe.load(out).tokens[0][-1] == "cat"
    # statistics while the model runs: a head's entropy against a loop over eager's weights
    stats = probe.capture(model, given[:1], processor=proc, text=text, keep="stats")
    table = {(r["stack"], r["layer"], r["head"]): r for r in probe.head_stats(stats, progress=False).table}
    w = want[1][0, 2].double()[1:]  # counted queries: the first (one visible key) left out
    entropy = float(-(w * w.clamp_min(1e-30).log()).sum(-1).mean())
    assert abs(table[(LM, 1, 2)]["entropy"] - entropy) < 1e-5


def _qwen_processor():
    """transformers' own Qwen2VLProcessor for the Qwen2-VL test model of test_image_families
    (4-pixel patches merged 2 x 2; ``<|image_pad|>`` 120). Its video processor needs torchvision,
    which is not installed: the class check of that argument is skipped while it is built."""
    from test_image_families import END, IMAGE, START

    specials = {"<|image_pad|>": IMAGE, "<|video_pad|>": 121, "<|vision_start|>": START}
    specials["<|vision_end|>"] = END
    images = tf.Qwen2VLImageProcessorPil(
        min_pixels=64, max_pixels=4096, patch_size=4, merge_size=2, temporal_patch_size=2
    )
    with mock.patch.object(tf.ProcessorMixin, "check_argument_for_proper_class", lambda *a: None):
        return tf.Qwen2VLProcessor(image_processor=images, tokenizer=word_tokenizer(specials))


def test_qwen2_vl_pictures_of_two_sizes_in_one_text():
    from test_image_families import IMAGE, _qwen2_vl

    model, eager = _qwen2_vl()
    proc = _qwen_processor()
    rng = np.random.default_rng(1)
    pictures = [rng.integers(0, 256, s, dtype=np.uint8) for s in ((16, 24, 3), (8, 16, 3))]
    pad = "<|vision_start|> <|image_pad|> <|vision_end|>"
    text = f"USER: {pad} what is {pad} the cat"
    cache = probe.capture(model, pictures, processor=proc, text=text)
    inputs = proc(images=[Image.fromarray(p) for p in pictures], text=text, return_tensors="pt")
    want = _eager(eager, inputs)
    for layer in range(2):
        torch.testing.assert_close(cache.pattern(LM, layer), want[layer], atol=TOL, rtol=0)
    # each picture on its own merged grid: 4 x 6 patches -> 2 x 3 tokens, 2 x 4 -> 1 x 2
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 4]]
    ids = inputs["input_ids"][0].tolist()
    first = ids.index(IMAGE)
    second = ids.index(IMAGE, first + 6)
    grids = cache.metadata["stacks"][LM]["positions"]["rows"][0]["grids"]
    assert [(g["offset"], g["rows"], g["cols"], g["patch"]) for g in grids] == [
        (first, 2, 3, [8, 8]),
        (second, 1, 2, [8, 8]),
    ]
    assert cache.tokens[0] == _labels(ids, IMAGE, proc.tokenizer, [(first, 2, 3), (second, 1, 2)])
    got = probe.attention_map(cache, 0, head=3, query=len(ids) - 1, stack=LM, image=1)
    torch.testing.assert_close(got, want[0][0, 3, -1, second : second + 2].reshape(1, 2), atol=TOL, rtol=0)


def _paligemma():
    cfg = tf.PaliGemmaConfig(
        vision_config=dict(
            model_type="siglip_vision_model", **SMALL, image_size=32, patch_size=8, vision_use_head=False
        ),
        text_config=dict(model_type="gemma", **SMALL, num_key_value_heads=2, head_dim=8, vocab_size=64),
        image_token_index=2,
        projection_dim=32,
    )
    return _pair(tf.PaliGemmaForConditionalGeneration, cfg)


def test_paligemma_places_the_image_tokens_itself():
    # PaliGemma's processor puts image_seq_length image tokens and <bos> before the text
    model, eager = _paligemma()
    tok = word_tokenizer({"<image>": 2, "<bos>": 40, "<eos>": 41}, {w: 3 + i for i, w in enumerate(WORDS)})
    tok.bos_token, tok.eos_token = "<bos>", "<eos>"
    images = tf.SiglipImageProcessorPil(size={"height": 32, "width": 32})
    images.image_seq_length = 16
    proc = tf.PaliGemmaProcessor(image_processor=images, tokenizer=tok)
    picture = np.random.default_rng(2).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    cache = probe.capture(model, picture, processor=proc, text="what is the cat")
    inputs = proc(images=[Image.fromarray(picture)], text="what is the cat", return_tensors="pt")
    want = _eager(eager, inputs)
    for layer in range(2):
        torch.testing.assert_close(cache.pattern(LM, layer), want[layer], atol=TOL, rtol=0)
    ids = inputs["input_ids"][0].tolist()
    assert ids[:16] == [2] * 16
    assert cache.tokens[0] == _labels(ids, 2, tok, [(0, 4, 4)]) and cache.tokens[0][16] == "<bos>"
    got = probe.attention_map(cache, 1, query=len(ids) - 1, stack=LM)
    torch.testing.assert_close(got, want[1][0, :, -1, :16].mean(0).reshape(4, 4), atol=TOL, rtol=0)


# -- the processor's output through trace, head_stats and the interventions ---------------------------
def test_trace_head_stats_and_ablation_on_the_processors_output(llava, tmp_path):
    model, eager = llava
    proc = llava_processor()
    _, pil = _pictures(tmp_path)
    inputs = proc(images=pil[:1], text="USER: <image> what is the cat", return_tensors="pt")
    want = _eager(eager, inputs)
    with probe.trace(model) as t, torch.no_grad():
        model(**inputs)
    at = inputs["input_ids"][0].tolist().index(95)
    assert t.cache.metadata["stacks"][LM]["positions"]["rows"][0]["grids"][0]["offset"] == at
    torch.testing.assert_close(t.cache.pattern(LM, 1), want[1], atol=TOL, rtol=0)
    # head statistics while the model runs on the same inputs: an entropy by a loop here
    stats = probe.head_stats(model, inputs, progress=False)
    row = next(r for r in stats.table if (r["stack"], r["layer"], r["head"]) == (LM, 0, 1))
    w = want[0][0, 1].double()[1:]  # counted queries: the first (one visible key) left out
    assert abs(row["entropy"] - float(-(w * w.clamp_min(1e-30).log()).sum(-1).mean())) < 1e-5
    # the same from the pictures and the text, the processor called by probe
    text = "USER: <image> what is the cat"
    direct = probe.head_stats(model, pil[:1], processor=proc, text=text, progress=False)
    row = next(r for r in direct.table if (r["stack"], r["layer"], r["head"]) == (LM, 0, 1))
    assert abs(row["entropy"] - float(-(w * w.clamp_min(1e-30).log()).sum(-1).mean())) < 1e-5
    with pytest.raises(probe.ProbeError, match="not a cache"):
        probe.head_stats(t.cache, processor=proc)
    # ablating the language model's layer 1 head 2: a pre-hook zeroing its slice of o_proj's input
    result = probe.ablate(model, inputs, [(LM, 1, 2)])
    o_proj = model.model.language_model.layers[1].self_attn.o_proj

    def zero(module, args):
        h = args[0].clone()
        h[..., 16:24] = 0
        return (h,)

    with torch.no_grad():
        clean = model(**inputs).logits
        handle = o_proj.register_forward_pre_hook(zero)
        try:
            ablated = model(**inputs).logits
        finally:
            handle.remove()
    assert abs(result.summary["max_abs_change"] - float((ablated - clean).abs().max())) < 1e-6
    assert result.summary["max_abs_change"] > 0


# -- bad input: one line each, no file left behind ------------------------------------------------------
def test_bad_texts_pictures_and_processors_are_one_line_each(llava, tmp_path):
    model, _ = llava
    given, _ = _pictures(tmp_path)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not a picture")
    out = tmp_path / "x.safetensors"
    lp = llava_processor
    vocab, token = word_tokenizer({"<image>": 95}, {"zebra": 200}), word_tokenizer({"<image>": 90})
    cases = [
        # fewer image tokens than pictures (none, then one for two), more
        (given[:1], lp(), "USER: what is", r"^the text holds no '<image>' token for 1 picture; put one"),
        (given, lp(), "USER: <image> what", r"^the text holds 1 '<image>' token for 2 pictures"),
        (given[:1], lp(), ["<image> a", "<image> b"], r"^the texts hold 2 '<image>' tokens for 1 picture"),
        # a processor that is not the model's: another vocabulary, another image token id
        (
            given[:1],
            lp(vocab),
            "<image> zebra",
            r"^the processor's tokenizer gives id 200, past .* of 96 ids",
        ),
        (
            given[:1],
            lp(token),
            "<image> a",
            r"^the processor marks pictures with '<image>' \(id 90\) but .* 95",
        ),
        # pictures of another size, patches of another size: the model's own check, one line
        (given[:1], lp(crop=64, patch=16), "<image> a", r"refused these inputs \(Input image size"),
        (given[:1], lp(patch=4), "<image> a", r"refused these inputs \(Image features and image tokens"),
        # a corrupt file; a text without a vision-language processor; not a text
        ([broken], lp(), "<image> a", r"^image 0: cannot read '.*broken\.png' as a picture"),
        (given[:1], tf.CLIPImageProcessorPil(), "<image> a", r"^text= needs a vision-language processor"),
        (given[:1], None, "<image> a", r"^text= is read beside pictures: give the pictures and processor="),
        (given[:1], lp(), 42, r"^text= takes a text or a list of texts"),
    ]
    for pictures, proc, text, message in cases:
        with pytest.raises(ProbeError, match=message) as e:
            probe.capture(model, pictures, processor=proc, text=text, out=out)
        assert "\n" not in str(e.value)
        assert not out.exists() and not list(tmp_path.glob("*.tmp*"))


# -- the command line and corpus runs ------------------------------------------------------------------
def _saved(model, tmp_path):
    folder = tmp_path / "my-llava"
    model.save_pretrained(folder)
    llava_processor().save_pretrained(folder)  # processor_config.json, the tokenizer
    return folder


@pytest.mark.slow
def test_cli_report_of_a_text_with_pictures(llava, tmp_path, capsys):
    from probe.cli import main

    folder = _saved(llava[0], tmp_path)
    given, _ = _pictures(tmp_path)
    text = "USER: <image> what is the cat"
    rep = tmp_path / "rep"
    assert main(["report", "--hf", str(folder), "--image", str(given[0]), text, "-o", str(rep)]) == 0
    page = (rep / "index.html").read_text(encoding="utf-8")
    assert "<h2>Attention on the picture</h2>" in page and "could not be built" not in page
    import re

    # the hover view of the words beside the picture: the text's own words, read by the tokenizer
    assert re.findall(r"<h3>([^<]*)</h3>", page).count("What the words read: cat.png") == 1


def test_cli_capture_and_corpus_of_a_text_with_pictures(llava, tmp_path, capsys):
    import json

    from probe.cli import main

    model, eager = llava
    proc = llava_processor()
    folder = _saved(model, tmp_path)
    given, pil = _pictures(tmp_path)
    text = "USER: <image> what is the cat"
    out = tmp_path / "llava.safetensors"
    argv = ["capture", "--hf", str(folder), "--image", str(given[0]), text, "-o", str(out)]
    assert main(argv) == 0
    cache = probe.load(out)
    inputs = proc(images=pil[:1], text=text, return_tensors="pt")
    want = _eager(eager, inputs)
    lm = "language_model.layers"  # the CLI loads the folder as AutoModel: LlavaModel, the same weights
    torch.testing.assert_close(cache.pattern(lm, 1), want[1], atol=TOL, rtol=0)
    assert cache.tokens[0][:2] == ["USER:", "patch (0, 0)"] and cache.metadata["prompts"] == [text]
    # a folder without the processor: one line, exit 2, nothing written
    bare = tmp_path / "bare"
    model.save_pretrained(bare)
    capsys.readouterr()
    again = tmp_path / "again.safetensors"
    assert main(["capture", "--hf", str(bare), "--image", str(given[0]), text, "-o", str(again)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--image with a TEXT needs the vision-language model's processor" in err and "\n" not in err
    assert not again.exists()
    # a corpus: a folder of pictures, one text read beside each
    pics = tmp_path / "pics"
    pics.mkdir()
    rng = np.random.default_rng(5)
    arrays = [rng.integers(0, 256, (40 + 4 * i, 44, 3), dtype=np.uint8) for i in range(3)]
    for i, a in enumerate(arrays):
        Image.fromarray(a).save(pics / f"p{i}.png")
    (pics / "bad.png").write_bytes(b"not a picture")
    run = tmp_path / "run"
    argv = ["corpus", "--hf", str(folder), "--images", str(pics), "--text", text, "-o", str(run)]
    assert main([*argv, "--keep", "all", "--batch-size", "2", "-q"]) == 0
    corpus = probe.open_corpus(run)
    assert [e["image"] for e in corpus.texts] == ["bad.png", "p0.png", "p1.png", "p2.png"]
    assert list(corpus.errors) == [0] and all(e["text"] == text for e in corpus.texts)
    for i, a in enumerate(arrays, start=1):
        c, row = corpus.cache_of(i)
        want = _eager(eager, proc(images=[Image.fromarray(a)], text=text, return_tensors="pt"))
        torch.testing.assert_close(c.pattern(lm, 0)[row], want[0][0], atol=TOL, rtol=0)
        assert c.tokens[row][-1] == "cat"
    assert json.loads((run / "config.json").read_text())["texts_sha256"]
    with pytest.raises(ProbeError, match="2 texts for 4 pictures"):
        probe.run_corpus(model, pics, tmp_path / "run2", processor=proc, text=["<image> a", "<image> b"])
    with pytest.raises(ProbeError, match="text= is read beside pictures"):
        probe.run_corpus(model, ["a text"], tmp_path / "run3", tokenizer=proc.tokenizer, text="<image> a")
