"""The causal-mask audit: every bug in the gallery is caught and placed, every control passes clean.

Oracles: the gallery's bugs are written by hand at a known layer/head (tests/causal_gallery.py),
so the expected kind and location come from the test, not from probe. The static checks are also
tested on hand-written patterns, and the functional checks on hand-computed outputs.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import dataclass
from html import escape

import causal_gallery as G
import pytest
import torch

import probe
from probe.analysis.causal import TOLERANCES, check_causal
from probe.analysis.causal.static import check_pattern

TOL = TOLERANCES["float32"]


@functools.cache
def audit(mode: str):
    """The audit of the gallery model with ``mode`` in layer BAD_LAYER (computed once per session)."""
    return check_causal(G.broken(mode), G.IDS)


def located(report, kind, layer=G.BAD_LAYER, head=None):
    """Findings of ``kind`` at ``layer`` (and ``head``)."""
    return [
        f
        for f in report.findings
        if f.kind == kind and f.layer == layer and (head is None or f.head == head) and f.stack == "decoder"
    ]


# -- the gallery: each bug caught, with the right kind and place --------------------------------------
@pytest.mark.parametrize(
    "mode, kind, per_head",
    [
        ("after_softmax", "mask_after_softmax", False),
        ("triu0", "masked_diagonal", False),
        ("swapped", "swapped_mask", False),
        ("one_head", "unmasked_head", True),
        ("window_wide", "window_too_wide", False),
        ("ignore_pad", "pad_attention", False),
        ("pad_over_queries", "mask_over_queries", False),
        ("kv_is_causal", "kv_alignment", False),
        ("sdpa_nomask", "future_attention", False),  # SDPA weights: never "mask after softmax"
    ],
)
def test_gallery_bug_is_caught_and_located(mode, kind, per_head):
    r = audit(mode)
    assert not r.ok
    assert r.kinds() == {kind}, str(r)
    heads = {f.head for f in r.findings}
    assert heads == ({G.BAD_HEAD} if per_head else set(range(G.H)))
    assert {f.layer for f in r.findings} == {G.BAD_LAYER}  # layer 0 is correct and not blamed
    assert located(r, kind)
    for f in r.findings:
        if kind in ("pad_attention", "mask_over_queries"):
            # the padding check pads a copy of the text on the left with T // 3 pads (text 1 of its
            # batch): a real query there reads a pad key
            k = G.IDS.shape[1] // 3
            assert f.text == 1 and f.key < k <= f.query, (mode, f)
        else:
            assert (f.query, f.key) == expected_cell(mode, f.head), (mode, f)
    # the gallery model takes a padding mask and a KV cache: those checks ran (a leak that cannot
    # be localised is still a failed check, never a skipped one)
    st = {c["check"]: c["status"] for c in r.checks}
    assert st["padding"] != "skipped" and st["kv_cache"] != "skipped", r.checks


def layer1_scores(m) -> torch.Tensor:
    """[H, 16, 16] unmasked attention scores of the gallery model's layer 1 on IDS, by hand."""
    with torch.no_grad():
        x = m.emb(G.IDS) + m.pos(torch.arange(16))[None]
        x, _ = m.blocks[0](x)
        a = m.blocks[1].attn
        q, k, _v = a.qkv(m.blocks[1].ln1(x)).view(1, 16, 3, G.H, G.D // G.H).permute(2, 0, 3, 1, 4)
        return q[0] @ k[0].transpose(-2, -1) / (G.D // G.H) ** 0.5


def expected_cell(mode: str, head: int) -> tuple[int, int]:
    """Where the finding must point, from the bug as written in the gallery (not from probe)."""
    T = G.IDS.shape[1]
    if mode in ("after_softmax", "sdpa_nomask", "one_head", "swapped"):
        s = layer1_scores(G.broken(mode))[head]
        if mode == "swapped":  # tril(-1) hides the past: row q sees keys q..T-1
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).tril(-1), float("-inf"))
        future = torch.softmax(s, -1).triu(1)  # the worst future cell
        return divmod(int(future.argmax()), T)
    if mode == "triu0":
        return (0, 0)  # query 0 has no visible key: its row is NaN
    if mode == "window_wide":
        return (G.WINDOW, 0)  # the first query that reaches WINDOW + 1 keys back
    if mode == "kv_is_causal":
        return (T // 2, 1)  # the first query after T // 2 cached keys; top-left hides keys 1..
    raise AssertionError(mode)


def test_positions_of_a_future_leak_are_real_future_cells():
    (f,) = audit("one_head").findings
    assert f.key > f.query  # the worst cell lies above the diagonal
    # oracle: recompute the head's weights by hand from the model's own projections
    w = torch.softmax(layer1_scores(G.broken("one_head"))[G.BAD_HEAD], -1)
    future = w.triu(1)
    assert f.magnitude == pytest.approx(float(future.sum(-1).max()), rel=1e-5)
    assert (f.query, f.key) == divmod(int(future.argmax()), 16)


def test_token_shift_into_the_mlp_is_a_leak_outside_attention():
    r = audit("shift_mlp")
    assert r.kinds() == {"leak_outside_attention"}
    (f,) = r.findings
    assert (f.stack, f.layer, f.head) == ("decoder", G.BAD_LAYER, None)
    assert f.key == f.query + 1  # roll(-1): position q reads position q + 1
    assert "MLP" in f.evidence
    st = {c["check"]: c["status"] for c in r.checks}
    assert st["suffix"] == "fail" and st["gradient"] == "fail"
    assert max(max(row) for row in r.grids["decoder"]["future"]) == 0.0  # no head sees ahead


def test_fp16_overflowing_fill_gives_nan_rows_and_is_clean_in_fp32():
    bad = check_causal(G.broken("fill_1e9").half(), G.IDS)
    assert bad.dtype == "float16"
    assert bad.kinds() == {"non_finite"}
    assert {(f.layer, f.query) for f in bad.findings} == {(G.BAD_LAYER, 0)}
    assert {f.head for f in bad.findings} == set(range(G.H))  # the fill is every head's
    # oracle: -1e9 is -inf in fp16, so the additive mask is 0 * -inf = NaN on every visible key
    assert torch.isinf(torch.tensor(-1e9, dtype=torch.float16)) and all(
        f.magnitude == 16 for f in bad.findings
    )
    assert check_causal(G.broken("fill_1e9"), G.IDS).ok


def test_half_precision_keeps_the_kind_and_blames_only_what_is_there():
    # bf16's loose output tolerance must not turn a weak unmasked head into "mask after softmax"
    # (zeroing future weights that a head uses moves the outputs, in any dtype)
    r = check_causal(G.broken("one_head").to(torch.bfloat16), G.IDS)
    assert {(f.kind, f.layer, f.head) for f in r.findings} == {("unmasked_head", G.BAD_LAYER, G.BAD_HEAD)}
    # bf16 cannot tell a non-renormalising mask-after-softmax from a renormalising one: it says so
    r = check_causal(G.everywhere("after_softmax_renorm").to(torch.bfloat16), G.IDS)
    assert r.ok and any("audit a float32 copy" in n for n in r.notes)
    # fp16: the renormalised control divides by clamp_min(1e-30), which is 0 in half; left-padded
    # pad rows become NaN and reach real tokens. That padding failure is real, and it does not make
    # the (unused) future weights a mask_after_softmax finding.
    m = G.everywhere("after_softmax_renorm").half()
    k = G.IDS.shape[1] // 3
    ids = torch.cat([torch.zeros(1, k, dtype=torch.long), G.IDS[:, :-k]], 1)
    mask = torch.ones_like(ids)
    mask[0, :k] = 0
    with torch.no_grad():
        assert not torch.isfinite(m(ids, attention_mask=mask).logits[0, k:]).all()  # the oracle
    r = check_causal(m, G.IDS)
    assert r.kinds() == {"padding_mismatch"} and "NaN/inf on real tokens" in r.findings[0].evidence


# -- negative controls: zero false positives -----------------------------------------------------------
@pytest.mark.parametrize("mode", ["ok", "after_softmax_renorm", "fill_1e9", "window", "alibi"])
def test_gallery_controls_pass_clean(mode):
    r = check_causal(G.everywhere(mode), G.IDS)
    assert r.ok, str(r)
    assert {c["status"] for c in r.checks} == {"pass"} | ({"skipped"} & {c["status"] for c in r.checks})
    ran = {c["check"] for c in r.checks if c["status"] == "pass"}
    assert {"suffix", "gradient", "padding", "kv_cache"} <= ran
    if mode == "after_softmax_renorm":
        assert any("after the softmax" in n for n in r.notes)
    if mode == "window":
        assert r.expected == {"decoder": f"causal, window {G.WINDOW}"}
        assert max(max(row) for row in r.grids["decoder"]["window"]) == G.WINDOW


@pytest.mark.parametrize("name", ["minigpt", "fused_decoder"])
def test_zoo_decoders_pass_clean(name):
    import models

    r = check_causal(models.load(name))
    assert r.ok, str(r)
    assert r.expected == {"decoder": "causal"}


def test_translator_decoder_is_causal_encoder_and_cross_are_not_expected_to_be():
    # the translator's architecture with seeded random weights: masks do not depend on training,
    # and this spares the test session the translator's training run
    import models

    torch.manual_seed(0)
    model = models.build("translator").eval()
    assert_encoder_decoder_clean(check_causal(model, "ich mochte ein bier"))


def test_aligner_decoder_is_causal():
    # the aligner's tokenizer has a larger source vocabulary (94) than target (64): suffix
    # replacements must be drawn from the decoder's own embedding, not the tokenizer's size
    import models

    model = models.load("aligner")
    assert model.tokenizer.vocab_size > model.decoder.tgt_emb.num_embeddings
    assert_encoder_decoder_clean(check_causal(model, "gestern sah der junge das hundehaus"))


def assert_encoder_decoder_clean(r):
    """The decoder audited and clean; encoder and cross-attention noted as not expected causal."""
    assert r.ok, str(r)
    assert r.expected == {"encoder": "bidirectional", "decoder": "causal"}
    assert set(r.grids) == {"encoder", "decoder", "decoder cross"}
    assert any("encoder self-attention is bidirectional" in n for n in r.notes)
    assert any("decoder cross-attention reads another sequence" in n for n in r.notes)
    st = {c["check"]: c["status"] for c in r.checks}
    assert st["suffix"] == "pass" and st["gradient"] == "pass"


def test_single_head_passes_clean_on_float_inputs():
    import models
    from models.single_head import example_input

    r = check_causal(models.load("single_head"), example_input())
    assert r.ok, str(r)
    assert {c["check"] for c in r.checks if c["status"] == "pass"} >= {"suffix", "gradient"}


# -- static checks on hand-written patterns --------------------------------------------------------------
def _one(p, expect="causal", mask=None):
    B, H, Q, K = p.shape
    m = torch.ones(B, K, dtype=torch.bool) if mask is None else mask
    return check_pattern(p, m[:, K - Q :], m, expect, TOL, {"stack": "decoder", "layer": 0})


def test_static_exact_zero_vs_tiny_future_mass():
    T = 5
    causal = torch.tril(torch.ones(T, T))
    p = (causal / causal.sum(-1, keepdim=True))[None, None]
    assert _one(p)[0] == []
    tiny = p.clone()
    tiny[0, 0, 0, 4] = 1e-7  # a finite fill's residue, under the fp32 tolerance
    assert _one(tiny)[0] == [] and _one(tiny)[1]["future"][0] == pytest.approx(1e-7)
    big = p.clone()
    big[0, 0, 1] = torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0])
    (f,) = _one(big)[0]
    assert (f.kind, f.query, f.key, f.magnitude) == ("future_attention", 1, 2, pytest.approx(0.5))


def test_exact_zero_and_tiny_future_weight_are_told_apart_in_the_notes():
    from probe.cache import Cache

    T = 5
    c = torch.tril(torch.ones(T, T))
    p = (c / c.sum(-1, keepdim=True))[None, None].repeat(1, 3, 1, 1)
    p[0, 1, 0, 4] = 1e-7  # head 1: a finite fill's residue, under the fp32 tolerance 1e-6
    cache = Cache({"decoder.blocks.0.self_attn.pattern": p}, {"tokens": [list("abcde")]})
    r = check_causal(cache, expect="causal")
    assert r.ok
    (note,) = [n for n in r.notes if "later keys" in n]
    assert "exactly 0 in 2 of 3 heads" in note and "tiny but non-zero in 1 (L0 H1; at most 1e-07" in note
    clean = check_causal(Cache({"decoder.blocks.0.self_attn.pattern": p[:, [0, 2]]}, cache.metadata))
    assert "decoder: weight on later keys is exactly 0 in 2 of 2 heads" in clean.notes


def test_static_rows_padding_and_cached_alignment():
    T = 4
    p = (torch.tril(torch.ones(T, T)) * 0.9)[None, None]  # rows sum to 0.9, 1.8, 2.7, 3.6
    (f,) = _one(p)[0]
    assert (f.kind, f.query, f.magnitude) == ("rows_not_normalised", 3, pytest.approx(2.6))
    # a pad key at position 0 (left padding) that real queries attend to
    q = torch.tril(torch.ones(T, T))
    q = (q / q.sum(-1, keepdim=True))[None, None]
    mask = torch.tensor([[False, True, True, True]])
    (f,) = [f for f in _one(q, mask=mask)[0] if f.kind == "pad_attention"]
    assert (f.query, f.key, f.magnitude) == (1, 0, pytest.approx(0.5))
    # KV cache: 2 new queries over 5 keys; bottom-right is right, top-left is flagged
    br = torch.tril(torch.ones(2, 5), diagonal=3)
    assert _one((br / br.sum(-1, keepdim=True))[None, None])[0] == []
    tl = torch.tril(torch.ones(2, 5))
    (f,) = _one((tl / tl.sum(-1, keepdim=True))[None, None])[0]
    assert (f.kind, f.query) == ("kv_alignment", 3)
    # a bidirectional stack is never judged on the future
    full = torch.full((1, 1, T, T), 1 / T)
    assert _one(full, expect="bidirectional")[0] == []


def test_cache_only_audit_and_bidirectional_note():
    cache = probe.capture(G.broken("one_head"), G.IDS)
    # without the model nothing says this lone, non-causal stack is a decoder: it is held to
    # bidirectional and the report says how to audit it as a decoder
    r = check_causal(cache)
    assert r.ok and r.expected == {"encoder": "bidirectional"}
    assert any("expect='causal'" in n for n in r.notes)
    r2 = check_causal(cache, expect="causal")
    assert {(f.kind, f.layer, f.head) for f in r2.findings} == {("unmasked_head", G.BAD_LAYER, G.BAD_HEAD)}
    assert any("cache only" in n for n in r2.notes)
    r3 = check_causal(cache, expect={"decoder": "causal"})  # the name the user knows it by
    assert r3.to_dict()["findings"] == r2.to_dict()["findings"]
    assert r2.checks == []


def test_expect_a_window_size_on_a_cache_alone():
    cache = probe.capture(G.broken("window_wide"), G.IDS)  # layer 1 reaches WINDOW + 1 keys back
    r = check_causal(cache, expect=G.WINDOW)
    assert r.kinds() == {"window_too_wide"} and r.expected == {"decoder": f"causal, window {G.WINDOW}"}
    assert {(f.layer, f.query - f.key) for f in r.findings} == {(G.BAD_LAYER, G.WINDOW)}
    assert check_causal(cache, expect=G.WINDOW + 1).ok


def test_cache_of_some_layers_and_heads_names_the_models_layer_and_head():
    # the gallery's bug sits at (BAD_LAYER, BAD_HEAD); a cache that kept some layers and heads must
    # name that place by the model's indices, not by the position in what the cache holds
    m = G.broken("one_head")
    assert G.BAD_LAYER != 0 and G.BAD_HEAD != 1
    for layers, heads in (([G.BAD_LAYER], None), ([G.BAD_LAYER], [G.BAD_HEAD]), (None, [0, G.BAD_HEAD])):
        cache = probe.capture(m, G.IDS, layers=layers, heads=heads)
        r = check_causal(cache, expect="causal")
        assert {(f.layer, f.head) for f in r.findings} == {(G.BAD_LAYER, G.BAD_HEAD)}, (layers, heads)
        grid = r.grids["decoder"]
        assert grid["layers"] == (layers or [0, 1]) and grid["heads"] == (heads or list(range(G.H)))
    # the evidence names the exactly causal heads by the model's indices too
    r = check_causal(probe.capture(m, G.IDS, heads=[0, G.BAD_HEAD, 3]), expect="causal")
    assert "heads [0, 3] of this layer are exactly causal" in r.findings[0].evidence


def test_report_of_a_cache_of_some_heads_outlines_the_models_head(tmp_path):
    m = G.broken("one_head")
    cache = probe.capture(m, G.IDS, heads=[0, G.BAD_HEAD])
    # the audit re-captures the model (all heads); the figure reads the head from this cache
    html = probe.report(cache, tmp_path / "r", model=m).read_text()
    i = html.index('id="sec-causal"')
    sec = html[i : html.index("</section>", i)]
    assert f"decoder layer {G.BAD_LAYER} head {G.BAD_HEAD}" in sec  # the leaking head's figure
    assert sec.count('<img src="data:image/png;base64,') == 2  # heatmaps + the outlined pattern


def test_cost_line_counts_passes_in_the_right_number():
    from probe.analysis.causal import CausalReport

    def line(checks):
        return next(
            x for x in str(CausalReport(checks=checks, model="m")).splitlines() if x.startswith("checks:")
        )

    one = [{"check": "capture", "status": "pass", "forwards": 1, "backwards": 0}]
    assert line(one).endswith("(cost: 1 forward, 0 backwards)")
    two = one + [{"check": "gradient", "status": "pass", "forwards": 1, "backwards": 1}]
    assert line(two).endswith("(cost: 2 forwards, 1 backward)")


def test_report_exports():
    r = audit("one_head")
    d = json.loads(r.to_json())
    assert d["ok"] is False and d["findings"][0]["kind"] == "unmasked_head"
    assert d["tolerances"] == TOLERANCES["float32"]
    assert "unmasked_head" in str(r) and "LEAK" in str(r)
    assert "<table" in r._repr_html_()
    assert r.table.column("head") == [G.BAD_HEAD]
    fw, bw = r.cost()
    assert bw == 1 and fw >= 7


def test_bad_input_is_a_probe_error():
    with pytest.raises(probe.ProbeError, match="expect"):
        check_causal(G.everywhere("ok"), G.IDS, expect="sideways")
    with pytest.raises(probe.ProbeError, match="torch model or a probe.Cache"):
        check_causal("gpt2")


# -- Hugging Face: GPT-2, Llama, Mistral (sliding window) pass clean, every check run ------------------
@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    import hf_fixtures as H

    return H.bpe_tokenizer(tmp_path_factory.mktemp("bpe"))


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mistral"])
def test_hf_decoders_pass_clean(arch, bpe, monkeypatch):
    import hf_fixtures as H

    model = getattr(H, arch)(len(bpe))
    texts = ["the model is reading the tokens one by one.", "attention lets tokens read."]
    # the stated cost, counted independently: forwards of the model's top module (and of its
    # backend twin, a copy of the same class), backward passes (torch.autograd.grad calls)
    calls = {"forward": 0, "backward": 0}
    mine = type(model)
    grad = torch.autograd.grad

    def counted_grad(*a, **kw):
        calls["backward"] += 1
        return grad(*a, **kw)

    def count_forward(m, a, o):
        calls["forward"] += type(m) is mine

    monkeypatch.setattr(torch.autograd, "grad", counted_grad)
    hook = torch.nn.modules.module.register_module_forward_hook(count_forward)
    try:
        r = check_causal(model, texts, tokenizer=bpe)
    finally:
        hook.remove()
    assert r.ok, str(r)
    assert r.complete and r.verdict().startswith("OK: no leak found (decoder: causal")
    assert r.cost() == (calls["forward"], calls["backward"]) == (8, 1)
    assert {c["check"]: c["status"] for c in r.checks} == {
        "capture": "pass",
        "suffix": "pass",
        "gradient": "pass",
        "padding": "pass",
        "kv_cache": "pass",
        "backend": "pass",
    }
    if arch == "mistral":
        assert r.expected == {"decoder": "causal, window 4"}
        # the window is exercised: the first text is longer than 4 tokens, and every head uses it
        assert len(bpe(texts[0])["input_ids"]) > 4
        assert r.grids["decoder"]["window"] == [[4.0] * model.config.num_attention_heads] * 2


def test_hf_encoder_decoder_decoder_is_audited_encoder_and_cross_are_not(bpe):
    import hf_fixtures as H

    assert_encoder_decoder_clean(check_causal(H.bart(len(bpe)), "attention lets tokens read.", tokenizer=bpe))


def test_hf_backend_mismatch_is_found(bpe):
    import hf_fixtures as H

    model = H.gpt2(len(bpe))
    # a leak on the eager path only: the eager twin forgets the causal mask in layer 1
    import transformers.models.gpt2.modeling_gpt2 as g2

    orig = g2.eager_attention_forward

    def leaky(module, query, key, value, attention_mask, **kw):
        if module.layer_idx == 1:
            attention_mask = None
            module.is_causal = False
        return orig(module, query, key, value, attention_mask, **kw)

    g2.eager_attention_forward = leaky
    try:
        r = check_causal(model, "the model is reading the tokens one by one.", tokenizer=bpe)
    finally:
        g2.eager_attention_forward = orig
    st = {c["check"]: c["status"] for c in r.checks}
    assert st["backend"] == "fail" and st["suffix"] == "pass"
    (f,) = r.findings
    assert (f.kind, f.layer) == ("backend_mismatch", 1)


# -- report section -------------------------------------------------------------------------------------
def test_report_section_renders_verdict_heatmaps_and_leaking_head(tmp_path):
    m = G.broken("one_head")
    cache = probe.capture(m, G.IDS)
    html = probe.report(cache, tmp_path / "r", model=m).read_text()
    i = html.index('id="sec-causal"')
    sec = html[i : html.index("</section>", i)]
    assert "LEAK: 1 finding(s): unmasked_head" in sec
    # the verdict also sits in the summary, linking to the section
    j = html.index('id="sec-summary"')
    summary = html[j : html.index("</section>", j)]
    assert '<a href="#sec-causal"' in summary and "LEAK: 1 finding(s): unmasked_head" in summary
    assert "decoder layer 1 head 2" in sec  # the leaking head's figure
    assert sec.count('<img src="data:image/png;base64,') == 2  # heatmaps + the outlined pattern
    assert sec.count('class="probe-download"') == 2  # each downloads as PNG
    assert "http://" not in sec and "https://" not in sec
    # from a cache alone (no model): static checks only, the section still renders
    clean = probe.report(probe.capture(G.everywhere("ok"), G.IDS), tmp_path / "c").read_text()
    # the functional checks did not run, and the verdict says so (section and summary alike)
    verdict = (
        "OK on 1 of 6 checks: no leak found (decoder: causal); suffix, gradient, padding, kv_cache, "
        "backend not run: a cache alone (pass the model to run them)"
    )
    assert clean.count(verdict) == 2
    assert clean.index(verdict) < clean.index('id="sec-attention"')  # in the summary


def test_section_build_with_a_stand_in_context():
    from types import SimpleNamespace

    from probe.report.context import figure_uri
    from probe.report.sections import causal as section

    cache = probe.capture(G.everywhere("ok"), G.IDS)
    ctx = SimpleNamespace(
        caches=[cache], cache=cache, model=None, tokenizer=None, results={},
        figure=lambda fig, alt="": figure_uri(fig), json=json.dumps, progress=lambda text: None,
    )  # fmt: skip
    s = section.build(ctx)
    assert s["ok"] and s["head"] is None and len(s["heatmaps"]) == 1
    assert ctx.results["causal"].ok  # shared with other sections


# -- CLI ------------------------------------------------------------------------------------------------
def test_cli_check_zoo_model_exit_0():
    out = subprocess.run(
        [sys.executable, "-m", "probe", "check", "--model", "minigpt", "attention lets tokens read."],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    # minigpt's forward is (idx, targets): no padding mask, no KV cache, no eager/SDPA switch
    first = out.stdout.splitlines()[0]
    assert first.startswith("causal-mask audit of minigpt: OK on 3 of 6 checks: no leak found")
    for check in ("padding", "kv_cache", "backend"):
        assert f"; {check} not run: " in first


def test_cli_check_cache_leak_exit_1_and_bad_input_exit_2(tmp_path, capsys):
    from probe.cli import main

    probe.capture(G.broken("swapped"), G.IDS, out=tmp_path / "run.safetensors")
    assert main(["check", str(tmp_path / "run.safetensors"), "--expect", "causal"]) == 1
    out = capsys.readouterr().out
    assert "swapped_mask" in out and "LEAK" in out
    assert main(["check", str(tmp_path / "run.safetensors"), "--json"]) == 0  # held to bidirectional
    assert json.loads(capsys.readouterr().out)["expected"] == {"encoder": "bidirectional"}
    assert main(["check", str(tmp_path / "missing.safetensors")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_cli_check_hf_folder(tmp_path, bpe, capsys):
    import hf_fixtures as H

    from probe.cli import main

    folder = tmp_path / "gpt2"
    H.gpt2(len(bpe)).save_pretrained(folder)
    bpe.save_pretrained(folder)
    assert main(["check", "--hf", str(folder), "the model is reading the tokens."]) == 0
    assert "backend pass" in capsys.readouterr().out


# -- KV cache: found under either name a forward takes it ----------------------------------------------
@dataclass
class _NewOut:
    logits: torch.Tensor
    cache: tuple | None = None


class _CacheNamed(G.TinyLM):
    """The gallery decoder with transformers >= 5.24's spelling: ``cache=`` in, ``.cache`` out."""

    def forward(self, ids, attention_mask=None, position_ids=None, cache=None, use_cache=False):
        out = super().forward(ids, attention_mask, position_ids, past_key_values=cache, use_cache=use_cache)
        return _NewOut(out.logits, out.past_key_values)


class _NoUseCache(G.TinyLM):
    def forward(self, ids, attention_mask=None, position_ids=None, past_key_values=None):
        return super().forward(ids, attention_mask, position_ids, past_key_values=past_key_values)


def test_kv_cache_is_found_under_the_name_the_forward_takes():
    from probe import forward

    assert forward.kv_cache_arg(G.everywhere("ok")) == "past_key_values"
    assert forward.kv_cache_arg(_CacheNamed(["ok", "ok"])) == "cache"
    assert forward.kv_cache_arg(_NoUseCache(["ok", "ok"])) is None  # a cache it cannot be asked for
    # oracle: the incremental run written here by hand equals the model's full forward
    m = _CacheNamed(["ok", "ok"])
    with torch.no_grad():
        o1 = m(G.IDS[:, :8], use_cache=True)
        o2 = forward.call(m, G.IDS[:, 8:], past_key_values=forward.kv_cache_of(o1), use_cache=True)
        assert torch.allclose(torch.cat([o1.logits, o2.logits], 1), m(G.IDS).logits, atol=1e-5)
    r = check_causal(m, G.IDS)
    assert r.ok and {c["check"]: c["status"] for c in r.checks}["kv_cache"] == "pass", str(r)
    # the same bug as the gallery's kv_is_causal, spelled the new way, still fails the check
    bad = _CacheNamed(["ok", "kv_is_causal"])
    st = {c["check"]: c["status"] for c in check_causal(bad, G.IDS).checks}
    assert st["kv_cache"] == "fail"


# -- the verdict: a check that did not run is never a clean pass ----------------------------------------
class _KVBroken(G.TinyLM):
    """Takes a KV cache by signature but cannot decode with one (raises on a cached call)."""

    def forward(self, ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False):
        if past_key_values is not None:
            raise RuntimeError("cached decoding is not implemented")
        return super().forward(ids, attention_mask, position_ids, use_cache=use_cache)


def test_verdict_names_every_check_that_did_not_run():
    import inspect

    import models

    m = models.load("minigpt")
    taken = set(inspect.signature(m.forward).parameters)  # the oracle: what its forward takes
    assert not taken & {"attention_mask", "past_key_values", "cache", "use_cache"}
    r = check_causal(m, "attention lets tokens read.")
    assert r.ok and not r.complete
    assert set(r.not_run) == {"padding", "kv_cache", "backend"}
    assert r.verdict() == (
        "OK on 3 of 6 checks: no leak found (decoder: causal); "
        "padding not run: the model takes no attention_mask; "
        "kv_cache not run: the model takes no KV cache (cache or past_key_values, with use_cache); "
        "backend not run: the model has no eager/SDPA switch"
    )
    # every face of the report carries the same verdict
    d = json.loads(r.to_json())
    assert d["verdict"] == r.verdict() and d["complete"] is False and d["not_run"] == r.not_run
    assert str(r).splitlines()[0] == f"causal-mask audit of minigpt: {r.verdict()}"
    assert "kv_cache not run;" in str(r)  # the checks line
    assert escape(r.verdict()) in r._repr_html_()
    # the gallery decoder takes all but the backend switch: a leak keeps the not-run part
    leak = audit("one_head")
    assert leak.verdict() == (
        "LEAK: 1 finding(s): unmasked_head; backend not run: the model has no eager/SDPA switch"
    )


def test_verdict_when_the_functional_checks_do_not_run_at_all():
    m = G.everywhere("ok")
    off = check_causal(m, G.IDS, functional=False)
    assert off.verdict() == (
        "OK on 1 of 6 checks: no leak found (decoder: causal); "
        "suffix, gradient, padding, kv_cache, backend not run: functional=False"
    )
    short = check_causal(m, G.IDS[:, :2])
    assert short.not_run == dict.fromkeys(
        ["suffix", "gradient", "padding", "kv_cache", "backend"],
        "fewer than 3 positions (give a longer text)",
    )
    # a check the model takes by signature but cannot run is not run, with the model's error
    r = check_causal(_KVBroken(["ok", "ok"]), G.IDS)
    assert r.ok and r.not_run["kv_cache"] == (
        "the model could not run it (RuntimeError: cached decoding is not implemented)"
    )
    assert "; kv_cache not run: the model could not run it (RuntimeError: cached decoding" in r.verdict()
