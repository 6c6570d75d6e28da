"""Corpus runs of pictures (issue 30, item 1): a folder or a list of pictures through the model's
image processor, batched by processed size, resumable, a corrupt file recorded and skipped.

Oracles: HF eager ``output_attentions`` of the same weights on each picture alone (its pixels made
by the processor here), reduced by loops written here; a ``probe.capture`` of one picture alone as a
consistency check only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image
from test_images import SMALL, _eager, _pair, _processor, _vit

import probe
from probe.errors import ProbeError

tf.logging.set_verbosity_error()
TOL = 1e-5


@pytest.fixture(scope="module")
def vit():
    return _vit()  # 32 x 48 pixels, 8-pixel patches: [CLS] + 4 x 6 patches


def _write(folder: Path, n: int, seed: int = 0) -> list[Path]:
    """``n`` random PNG pictures of different sizes (the processor resizes them) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        p = folder / f"p{i}.png"
        Image.fromarray(rng.integers(0, 256, (30 + 3 * i, 50 - 2 * i, 3), dtype=np.uint8)).save(p)
        paths.append(p)
    return paths


def _want(eager, path: Path) -> tuple:
    """The oracle: eager attentions of one picture, its pixels made by the processor here."""
    pixels = _processor()(images=[Image.open(path).convert("RGB")], return_tensors="pt")["pixel_values"]
    return _eager(eager, pixel_values=pixels)


def test_a_folder_kept_whole_matches_eager_per_picture(vit, tmp_path):
    model, eager = vit
    paths = _write(tmp_path / "pics", 5)
    (tmp_path / "pics" / "bad.png").write_bytes(b"not a picture")  # first by name: index 0
    (tmp_path / "pics" / "notes.txt").write_text("not an image file: left out")
    (tmp_path / "pics" / "sub").mkdir()  # subfolders are not read
    _write(tmp_path / "pics" / "sub", 1)
    c = probe.run_corpus(
        model, tmp_path / "pics", tmp_path / "run", processor=_processor(), keep="all", batch_size=2,
        shard_size=3, progress=False,
    )  # fmt: skip
    assert [e["image"] for e in c.texts] == ["bad.png"] + [p.name for p in paths]
    assert list(c.errors) == [0]
    err = c.errors[0]
    assert "bad.png" in err and "cannot read" in err and "\n" not in err
    assert c.manifest["n_ok"] == 5 and c.config["inputs"] == "images"
    # shards [bad, p0, p1], [p2, p3, p4]: batches of two in input order, the failed picture skipped
    assert [(e.get("file"), e.get("row")) for e in c.texts[1:]] == [
        ("shards/00000/b000.safetensors", 0),
        ("shards/00000/b000.safetensors", 1),
        ("shards/00001/b000.safetensors", 0),
        ("shards/00001/b000.safetensors", 1),
        ("shards/00001/b001.safetensors", 0),
    ]
    for i, path in enumerate(paths, start=1):
        cache, row = c.cache_of(i)
        want = _want(eager, path)
        for layer in range(2):
            torch.testing.assert_close(cache.pattern("encoder", layer)[row], want[layer][0], atol=TOL, rtol=0)
        assert cache.metadata["images"][row] == path.name
        assert cache.metadata["stacks"]["encoder"]["positions"]["grid"] == {
            "rows": 4, "cols": 6, "patch": [8, 8], "image": [32, 48], "offset": 1,
        }  # fmt: skip
        assert cache.tokens[row][:2] == ["[CLS]", "patch (0, 0)"]
        assert len(cache.metadata["image_png"]) == cache.pattern("encoder", 0).shape[0]
        # consistency with a capture of the picture alone (the same processor)
        alone = probe.capture(model, [path], processor=_processor())
        torch.testing.assert_close(
            cache.pattern("encoder", 1)[row], alone.pattern("encoder", 1)[0], atol=TOL, rtol=0
        )
        assert cache.metadata["image_png"][row] == alone.metadata["image_png"][0]
    assert "pictures:  6 (5 captured, 1 failed)" in c.summary()
    assert "failed:    image 0: cannot read" in c.summary()


class ToTensor:
    """A processor that keeps each picture's size (no resize): pixels in [0, 1], channels first."""

    def __call__(self, images=None, return_tensors=None):
        x = [torch.from_numpy(np.asarray(im, dtype=np.float32) / 255).permute(2, 0, 1) for im in images]
        return {"pixel_values": torch.stack(x)}  # pictures of several sizes cannot be stacked


def test_pictures_of_several_sizes_batch_by_size_and_their_statistics_match_loops(tmp_path):
    # DINOv2 with two registers interpolates its positions: it takes any size (14-pixel patches)
    cfg = tf.Dinov2WithRegistersConfig(**SMALL, image_size=28, patch_size=14, num_register_tokens=2)
    model, eager = _pair(tf.Dinov2WithRegistersModel, cfg)
    rng = np.random.default_rng(5)
    sizes = [(28, 42), (42, 28), (28, 42), (28, 42), (42, 28)]
    pics = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    pics[1] = Image.fromarray(pics[1])  # PIL images and arrays alike
    run = dict(processor=ToTensor(), batch_size=2, progress=False)
    c = probe.run_corpus(model, pics, tmp_path / "all", keep="all", **run)
    assert [e["image"] for e in c.texts] == [0, 1, 2, 3, 4]  # in memory: the index
    # one shard; batches of one size each, in input order: [0, 2], [1, 4], [3]
    assert [(e["file"], e["row"]) for e in c.texts] == [
        ("shards/00000/b000.safetensors", 0),
        ("shards/00000/b001.safetensors", 0),
        ("shards/00000/b000.safetensors", 1),
        ("shards/00000/b002.safetensors", 0),
        ("shards/00000/b001.safetensors", 1),
    ]
    want = []
    for i, pic in enumerate(pics):
        x = ToTensor()(images=[pic])["pixel_values"]
        want.append(_eager(eager, pixel_values=x))
        cache, row = c.cache_of(i)
        for layer in range(2):
            torch.testing.assert_close(
                cache.pattern("encoder", layer)[row], want[i][layer][0], atol=TOL, rtol=0
            )
        assert cache.metadata["images"][row] == f"image {i}"
    # the statistics, from loops over the eager weights: mean over the five pictures
    stats = c.head_stats()
    assert stats.n_texts == 5 and not {"distance_px", "on_class", "on_register"} & set(stats.not_computed)
    rows = {(r["layer"], r["head"]): r for r in stats.table}
    for layer in range(2):
        for head in range(4):
            dist, on_cls, on_reg = [], [], []
            for (h, w), att in zip(sizes, want, strict=True):
                a = att[layer][0, head].double()  # [CLS], 2 registers, then the patches row by row
                cols, n = w // 14, (h // 14) * (w // 14)
                total = 0.0
                for i in range(n):
                    for j in range(n):
                        d = math.hypot((i // cols - j // cols) * 14, (i % cols - j % cols) * 14)
                        total += float(a[3 + i, 3 + j]) * d
                dist.append(total / n)
                on_cls.append(float(a[:, 0].mean()))  # every query counts
                on_reg.append(float(a[:, 1:3].sum(-1).mean()))
            r = rows[(layer, head)]
            assert abs(r["distance_px"] - sum(dist) / 5) < 1e-4
            assert abs(r["on_class"] - sum(on_cls) / 5) < 1e-5
            assert abs(r["on_register"] - sum(on_reg) / 5) < 1e-5
    # keep="stats" computes the same statistics from the same whole patterns, and stores none
    s = probe.run_corpus(model, pics, tmp_path / "stats", **run)
    assert (
        s.files == []
        and (tmp_path / "stats" / "stats.json").read_bytes() == (tmp_path / "all" / "stats.json").read_bytes()
    )


class Interrupting:
    """The test processor, interrupted (Ctrl-C) at its ``stop_at``-th call when set."""

    stop_at: int | None = None
    calls = 0

    def __init__(self) -> None:
        self.inner = _processor()
        self.image_mean, self.image_std = self.inner.image_mean, self.inner.image_std

    def __call__(self, images=None, return_tensors=None):
        Interrupting.calls += 1
        if Interrupting.stop_at is not None and Interrupting.calls == Interrupting.stop_at:
            raise KeyboardInterrupt
        return self.inner(images=images, return_tensors=return_tensors)


def test_an_interrupted_run_resumes_to_the_same_result(vit, tmp_path, monkeypatch):
    model, _ = vit
    _write(tmp_path / "pics", 7)
    run = dict(processor=Interrupting(), keep="all", batch_size=2, shard_size=3, progress=False)
    ref = probe.run_corpus(model, tmp_path / "pics", tmp_path / "ref", **run)
    out = tmp_path / "out"
    # shard 1 is p3, p4 (a batch, saved), p5: stopped while processing p5, its first batch written
    Interrupting.calls, Interrupting.stop_at = 0, 6
    with pytest.raises(KeyboardInterrupt):
        probe.run_corpus(model, tmp_path / "pics", out, **run)
    Interrupting.stop_at = None
    assert (out / "shards" / "00000.json").is_file() and not (out / "shards" / "00001.json").exists()
    assert (out / "shards" / "00001" / "b000.safetensors").is_file()
    with pytest.raises(ProbeError, match="unfinished"):
        probe.open_corpus(out)
    monkeypatch.chdir(tmp_path)
    again = probe.run_corpus(model, "pics", out, **run)  # the same folder, named relative to here
    assert (out / "manifest.json").read_text() == (tmp_path / "ref" / "manifest.json").read_text()
    assert (out / "stats.json").read_text() == (tmp_path / "ref" / "stats.json").read_text()
    for a, b in zip(again, ref, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a.keys())
    # other pictures in the folder are another run: refused, not mixed in
    _write(tmp_path / "more", 1, seed=9)[0].rename(tmp_path / "pics" / "p9.png")
    with pytest.raises(ProbeError, match="different corpus run.*n_texts"):
        probe.run_corpus(model, tmp_path / "pics", out, **run)


def test_bad_pictures_are_one_line_each(vit, tmp_path):
    model, _ = vit
    (tmp_path / "empty").mkdir()
    with pytest.raises(ProbeError, match="holds no image file"):
        probe.run_corpus(model, tmp_path / "empty", tmp_path / "r0", processor=_processor(), progress=False)
    pic = np.zeros((32, 48, 3), dtype=np.uint8)
    with pytest.raises(ProbeError, match="pictures need processor="):
        probe.run_corpus(model, [pic], tmp_path / "r1", progress=False)
    with pytest.raises(ProbeError, match=r"picture 1: 'notes.txt' is not an image file name"):
        probe.run_corpus(model, [pic, "notes.txt"], tmp_path / "r2", processor=_processor(), progress=False)
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()
    # a missing file and a corrupt one are recorded; pictures the model cannot take fail the run
    (tmp_path / "bad.jpg").write_bytes(b"\xff\xd8 truncated")
    c = probe.run_corpus(
        model, [pic, tmp_path / "gone.png", tmp_path / "bad.jpg"], tmp_path / "r3", processor=_processor(),
        progress=False,
    )  # fmt: skip
    assert c.manifest["n_ok"] == 1 and list(c.errors) == [1, 2]
    assert "no such file" in c.errors[1] and "gone.png" in c.errors[1]
    assert "bad.jpg" in c.errors[2] and "cannot read" in c.errors[2]
    assert c.texts[0]["image"] == 0 and c.texts[2]["image"] == str(tmp_path / "bad.jpg")
    wrong = tf.ViTImageProcessor(size={"height": 64, "width": 64})  # not this 32 x 48 model's
    with pytest.raises(
        probe.corpus.CorpusFailed, match=r"no picture captured: all 2 pictures failed \(image 0"
    ):
        probe.run_corpus(model, [pic, pic], tmp_path / "r4", processor=wrong, progress=False)
    manifest = json.loads((tmp_path / "r4" / "manifest.json").read_text())
    assert all("refused these inputs" in e["error"] for e in manifest["texts"])


def test_cli_corpus_of_images(vit, tmp_path, capsys):
    from probe.cli import main

    model, eager = vit
    folder = tmp_path / "my-vit"
    model.save_pretrained(folder)
    _processor().save_pretrained(folder)
    paths = _write(tmp_path / "pics", 3)
    out = tmp_path / "run"
    argv = ["corpus", "--hf", str(folder), "--images", str(tmp_path / "pics"), "-o", str(out), "-q"]
    assert main([*argv, "--keep", "all"]) == 0
    printed = capsys.readouterr().out
    assert "pictures:  3 (3 captured, 0 failed)" in printed and "batches of 8" in printed
    c = probe.open_corpus(out)
    cache, row = c.cache_of(2)
    torch.testing.assert_close(
        cache.pattern("encoder", 1)[row], _want(eager, paths[2])[1][0], atol=TOL, rtol=0
    )
    # image files, the processor named apart (a bare model folder has none)
    bare = tmp_path / "bare"
    model.save_pretrained(bare)
    files = ["--images", str(paths[0]), str(paths[1])]
    argv = [
        "corpus",
        "--hf",
        str(bare),
        *files,
        "--processor",
        str(folder),
        "-o",
        str(tmp_path / "two"),
        "-q",
    ]
    assert main(argv) == 0
    assert [e["image"] for e in probe.open_corpus(tmp_path / "two").texts] == [str(paths[0]), str(paths[1])]
    capsys.readouterr()
    assert main(["corpus", "--hf", str(bare), *files, "-o", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("probe: error: --images needs the model's image processor") and "\n" not in err
    texts = tmp_path / "t.txt"
    texts.write_text("a text\n")
    assert (
        main(["corpus", "--hf", str(folder), *files, "--texts", str(texts), "-o", str(tmp_path / "y")]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert "one of them" in err and "\n" not in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_statistics_computed_while_the_model_ran_say_what_they_leave_out_after_the_merge(tmp_path):
    # a text run's keep="stats" statistics leave out the rollout (and, for a model with an image
    # grid, the image metrics): the merged statistics of the run say so, as one capture's do
    from models import load

    model = load("minigpt")
    texts = ["the cat sat", "a rat", "fish are here"]
    c = probe.run_corpus(model, texts, tmp_path / "run", shard_size=2, progress=False)
    alone = probe.head_stats(probe.capture(model, texts[:1], keep="stats"), progress=False)
    assert "rollout" in alone.not_computed
    assert c.head_stats().not_computed == alone.not_computed


@pytest.mark.slow
def test_torchrun_two_ranks_share_the_pictures_like_one_process(vit, tmp_path):
    import os
    import subprocess
    import sys

    model, _ = vit
    folder = tmp_path / "my-vit"
    model.save_pretrained(folder)
    _processor().save_pretrained(folder)
    _write(tmp_path / "pics", 5)
    (tmp_path / "pics" / "bad.png").write_bytes(b"not a picture")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["OMP_NUM_THREADS"] = "1"
    args = ["-m", "probe", "corpus", "--hf", str(folder), "--images", str(tmp_path / "pics"), "-q"]
    args += ["--shard-size", "2", "--batch-size", "2"]
    one = subprocess.run([sys.executable, *args, "-o", str(tmp_path / "one")], env=env, capture_output=True)
    assert one.returncode == 0, one.stderr[-2000:]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    two = subprocess.run([*launch, *args[1:], "-o", str(tmp_path / "two")], env=env, capture_output=True)
    assert two.returncode == 0, two.stderr[-2000:]
    assert (tmp_path / "two" / "manifest.json").read_text() == (
        tmp_path / "one" / "manifest.json"
    ).read_text()
    a, b = (probe.open_corpus(tmp_path / d).head_stats().table for d in ("one", "two"))
    for ra, rb in zip(a, b, strict=True):
        for k, v in ra.items():
            if isinstance(v, float) and not math.isnan(v):
                assert abs(v - rb[k]) < 1e-6, k
            else:
                assert v == rb[k] or (isinstance(v, float) and math.isnan(rb[k])), k


def test_the_explorer_shows_a_picture_run_s_pictures_and_heads(vit, tmp_path):
    """``probe serve``'s pages on a corpus of pictures (in process): a picture's page shows the
    picture as the model saw it (the store's copy), a head page ranks the pictures."""
    pytest.importorskip("duckdb")
    pytest.importorskip("starlette")
    import base64
    import io

    from starlette.testclient import TestClient

    from probe.explore.app import create_app
    from probe.explore.data import Explorer

    model, _ = vit
    _write(tmp_path / "pics", 4)
    probe.run_corpus(model, tmp_path / "pics", tmp_path / "run", processor=_processor(), progress=False)
    ex = Explorer(tmp_path / "run")
    client = TestClient(create_app(ex))
    row = ex.text(2)
    assert row["source"] == "p2.png" and row["picture"]
    with Image.open(io.BytesIO(base64.b64decode(row["picture"]))) as pic:
        assert max(pic.size) <= 96  # the store's small copy of the picture the model saw (32 x 48)
    page = client.get("/text/2?stat=first")
    assert page.status_code == 200 and f"base64,{row['picture']}" in page.text
    stack, kind, layer, head = sorted(ex.heads)[0]
    page = client.get(f"/head/{stack}/{kind}/{layer}/{head}?stat=first")
    assert page.status_code == 200
    ranked = ex.ranked(stack, kind, layer, head, "first", 4, True)
    assert sorted(r["source"] for r in ranked) == ["p0.png", "p1.png", "p2.png", "p3.png"]
    assert all(r["source"] in page.text for r in ranked)
    ex.close()
