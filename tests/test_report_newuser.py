"""Reports a new user tripped over (issue 53): a section that read audio frames as words, figures
sized by the number of positions, a summary that said the causal checks needed a model it had,
report folders named after the picture alone, and two spellings of a zoo name.

Oracles: the metadata the tests write (what a stack's positions are, per docs/cache-format.md),
the PNG headers of the figures the page embeds, the checks the audit lists as run, and the folders
the command line writes.
"""

from __future__ import annotations

import base64
import struct

import pytest
import torch

import models
import probe
from probe.cli import main
from probe.report.context import ReportContext
from probe.report.sections import alignment, causal

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _png_size(uri: str) -> tuple[int, int]:
    raw = base64.b64decode(uri.split(",", 1)[1])
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", raw[16:24])


def _long_pair(n_source: int, n_target: int) -> probe.Cache:
    """A tiny ``nn.Transformer`` traced over ``n_source`` source and ``n_target`` target words."""
    torch.manual_seed(0)
    mt = torch.nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True).eval()
    source = [f"w{i}" for i in range(n_source)]
    target = [f"v{j}" for j in range(n_target)]
    meta = {"tokens": [source], "target_tokens": [target], "texts": [" ".join(source)]}
    meta["target_texts"] = [" ".join(target)]
    with probe.trace(mt, metadata=meta) as t:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n_target)
        mt(torch.randn(1, n_source, 16), torch.randn(1, n_target, 16), tgt_mask=mask, tgt_is_causal=True)
    return t.cache


def test_the_alignment_section_knows_what_its_source_positions_are():
    frames = {"hop": 0.02, "offset": 0.0, "count": 3, "stride": 2}
    speech = {"encoder": {"positions": {"kinds": ["frame"] * 3, "frames": frames}}, "decoder": {}}
    grid = {"rows": 2, "cols": 2, "patch": [16, 16], "image": [32, 32], "offset": 1}
    picture = {"encoder": {"positions": {"kinds": ["class"] + ["patch"] * 4, "grid": grid}}, "decoder": {}}
    words = {"encoder": {"layers": 2}, "decoder": {"layers": 2}}
    generated = {"decoder": {"positions": {"kinds": ["prompt", "generated"]}}}
    assert alignment.not_words({"stacks": speech}) == "audio frames"
    assert alignment.not_words({"stacks": picture}) == "picture patches"
    assert alignment.not_words({"stacks": words}) is None
    assert alignment.not_words({"stacks": generated}) is None
    assert alignment.not_words({}) is None


def test_long_sentences_keep_the_alignment_figures_inside_the_page():
    # 300 source words: the figures once grew by half an inch a word (21,022 px); now at most
    # 14 inches at 100 dpi, plus what the tight bounding box adds for labels and the colour bar
    cache = _long_pair(300, 40)
    s = alignment.build(ReportContext(caches=[cache]))
    for key in ("heatmap", "links", "map"):
        width, height = _png_size(s[key])
        assert width <= 1700 and height <= 1700, (key, width, height)
    short = alignment.build(ReportContext(caches=[_long_pair(4, 5)]))
    assert _png_size(short["links"])[0] < 800  # a short pair is drawn at its own size, not stretched


@pytest.fixture(scope="module")
def aligner():
    model = models.load("aligner")
    return model, probe.capture(model, "der junge sah den hund")


def test_with_the_model_an_encoder_decoders_causal_checks_run_on_its_own_capture(aligner):
    model, cache = aligner
    assert cache.metadata["target_ids"]  # decoded greedily: the capture holds source and target ids
    ctx = ReportContext(caches=[cache], model=model, tokenizer=model.tokenizer)
    verdict = causal.verdict(ctx)["verdict"]
    report = ctx.results["causal"]
    checks = {c["check"]: c for c in report.checks}
    assert "a cache alone" not in verdict and report.functional_skipped is None
    assert checks["capture"]["forwards"] == 0  # the report's cache, not a second capture
    assert checks["suffix"]["status"] == "pass" and checks["gradient"]["status"] == "pass"
    # without the model the summary says so
    alone = ReportContext(caches=[cache])
    assert "a cache alone" in causal.verdict(alone)["verdict"]


def test_check_causal_refuses_a_cache_of_inputs_that_are_not_ids(tmp_path):
    vit = models.load("vit_zoo")
    from models import shapes

    cache = probe.capture(vit, [shapes.to_pil(shapes.generate(1, seed=3).images[0])], processor=vit.processor)
    with pytest.raises(probe.ProbeError, match="this model read pixel_values; pass check_causal"):
        probe.check_causal(vit, cache)
    ctx = ReportContext(caches=[cache], model=vit)
    assert causal.verdict(ctx)["verdict"].endswith("not run: no stack is expected causal")


def test_a_picture_reported_by_two_models_gets_two_folders(tmp_path, monkeypatch, capsys):
    import transformers

    from models import shapes

    monkeypatch.chdir(tmp_path)
    shapes.to_pil(shapes.generate(1, seed=3).images[0]).save("cat.png")
    assert main(["report", "--model", "vit-zoo", "--image", "cat.png"]) == 0
    assert "wrote reports/vit_zoo-cat/index.html" in capsys.readouterr().out
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
    )
    transformers.ViTModel(config).eval().save_pretrained("my-vit")
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained("my-vit")
    assert main(["report", "--hf", "my-vit", "--image", "cat.png"]) == 0
    assert "wrote reports/my-vit-cat/index.html" in capsys.readouterr().out
    first = (tmp_path / "reports" / "vit_zoo-cat" / "index.html").read_text(encoding="utf-8")
    second = (tmp_path / "reports" / "my-vit-cat" / "index.html").read_text(encoding="utf-8")
    assert "probe report: vit_zoo" in first and "probe report: my-vit" in second


@pytest.mark.parametrize("spelling", ["fused-decoder", "fused_decoder"])
def test_a_zoo_name_is_taken_with_either_spelling_and_listed_with_one(spelling, tmp_path, capsys):
    out = tmp_path / "run.safetensors"
    assert main(["capture", "--model", spelling, "3141592653", "-o", str(out)]) == 0
    assert probe.load(out).metadata["model"]["name"] == "fused_decoder"
    capsys.readouterr()
    assert main(["capture", "--model", "vit-zo", "x", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'vit-zo'" in err and "vit_zoo" in err and "vit-zoo" not in err


def test_the_greedy_transcript_is_whisper_generates_own_greedy_output():
    # probe asks Whisper's generate for the length as max_length (no note that max_new_tokens and
    # a default max_length were both set); the transcript is the library's greedy one, as asked
    # with max_new_tokens: 31 new tokens at most (32 decoder positions, the start token first)
    from test_audio import RATE, _mel_extractor, _wave, _whisper

    model, fe = _whisper(), _mel_extractor()
    cache = probe.capture(model, _wave(0.5), sampling_rate=RATE, processor=fe)
    feats = fe(_wave(0.5), sampling_rate=RATE, return_tensors="pt")["input_features"]
    start, eos = model.config.decoder_start_token_id, model.generation_config.eos_token_id
    with torch.no_grad():
        out = model.generate(input_features=feats, do_sample=False, num_beams=1, max_new_tokens=31)
    seq = out[0].tolist()
    seq = seq if seq[0] == start else [start, *seq]  # Whisper's generate leaves its start token out
    seq = seq[: next((k for k in range(1, len(seq)) if seq[k] == eos), len(seq))]
    assert cache.metadata["target_ids"][0] == seq and len(seq) <= 32


def test_the_heads_summary_keeps_a_space_before_the_shared_key_value_heads():
    # "1 broad/uniform.Key/value heads shared" in SmolLM2's report: the template glued two sentences
    from hf_fixtures import llama

    from probe.report.html import render

    cache = probe.capture(llama(64), torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0)))
    html = render(ReportContext(caches=[cache]))
    assert ". Key/value heads shared: KV 0 ← heads" in html
