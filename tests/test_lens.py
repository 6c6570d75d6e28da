"""probe.logit_lens and direct logit attribution.

Oracles: the models' own logits (called directly here), hooks on minigpt's blocks read through
its ln_f and lm_head by hand, and the frozen-scale LayerNorm written out in the test.

The attribution's error bound: with the final norm's scale frozen at its value for the full
stream, the read-out is affine and the parts (embedding + every sublayer delta) sum exactly to the
final stream, so parts + constant = logit in exact arithmetic; in float32 the sum may differ by
rounding only: |Σ - logit| ≤ 1e-4 · (1 + Σ|part|). Heads plus the projection's bias reproduce their
sublayer's part to the same bound.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import hf_fixtures as H
import pytest
import torch

import models
import probe

TEXT = "attention lets tokens read"


def _stream_rows(lens):
    return lens.sources[: lens.n_stream_rows]


def _check_final_layer(lens, logits, mask=None):
    """The last layer's lens equals the model's own logits: same top-k, same probabilities."""
    last = lens.n_stream_rows - 1
    prob = logits.float().softmax(-1)
    k = lens.top_ids.shape[-1]
    tp, ti = prob.topk(k, dim=-1)
    m = torch.ones(logits.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
    assert torch.allclose(lens.top_p[last][m], tp[m], atol=1e-5, rtol=0)
    assert torch.equal(lens.top_ids[last][m][:, 0], ti[m][:, 0])
    assert torch.equal(lens.predicted[m], logits.argmax(-1)[m])
    assert lens.final_error <= 1e-5


def _check_attribution_sum(att, logits, mask=None):
    m = torch.ones(logits.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
    logit = logits.float().gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)
    parts = {}
    for r in att.table:
        if r["head"] == "":
            parts.setdefault((r["batch"], r["pos"]), []).append(r["contribution"])
    for (b, t), vals in parts.items():
        assert m[b, t]
        bound = 1e-4 * (1 + sum(abs(v) for v in vals))
        assert abs(sum(vals) + att.constant[b, t].item() - logit[b, t].item()) <= bound


def test_minigpt_every_layer_against_its_own_readout():
    model = models.load("minigpt")
    outs = {}
    hs = [
        b.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o.detach()))
        for i, b in enumerate(model.blocks)
    ]
    ids = torch.tensor([model.tokenizer.encode(TEXT)])
    with torch.no_grad():
        logits = model(ids)[0]
        for h in hs:
            h.remove()
        lens = probe.logit_lens(model, TEXT, k=3)
        assert _stream_rows(lens) == ["embed", "L0", "L1"]
        _check_final_layer(lens, logits)
        pred = logits.argmax(-1)
        # layer 0 read by hand through the model's own ln_f and lm_head
        p0 = model.lm_head(model.ln_f(outs[0])).softmax(-1).gather(-1, pred.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(lens.p_pred[1], p0, atol=1e-6)
    assert lens.readout == "ln_f -> lm_head"
    # the deltas are read too: one row per sublayer per layer
    assert lens.sources[lens.n_stream_rows :] == [
        "L0.self_attn.delta",
        "L0.mlp.delta",
        "L1.self_attn.delta",
        "L1.mlp.delta",
    ]


def test_minigpt_attribution_by_hand():
    model = models.load("minigpt")
    seen = {}
    hooks = [
        model.blocks[1].ffwd.register_forward_hook(lambda m, a, o: seen.__setitem__("mlp1", o.detach())),
        model.blocks[1].register_forward_hook(lambda m, a, o: seen.__setitem__("final", o.detach())),
    ]
    for h, head in enumerate(model.blocks[1].attn.heads):
        hooks.append(
            head.register_forward_hook(lambda m, a, o, h=h: seen.__setitem__(f"h{h}", o[0].detach()))
        )
    ids = torch.tensor([model.tokenizer.encode(TEXT)])
    with torch.no_grad():
        logits = model(ids)[0]
    for h in hooks:
        h.remove()
    lens = probe.logit_lens(model, TEXT)
    att = lens.attribution
    _check_attribution_sum(att, logits)
    assert att.max_error <= 1e-4
    # L1.mlp's part at the last position, written out: W_U[t] · γ (Δ - mean Δ) / sqrt(var(x) + eps)
    t, T = logits[0, -1].argmax().item(), ids.shape[1] - 1
    x = seen["final"][0, T]
    sigma = torch.sqrt(x.var(unbiased=False) + model.ln_f.eps)
    w_u, gamma = model.lm_head.weight[t], model.ln_f.weight

    def part(v):
        return (w_u * gamma * (v - v.mean()) / sigma).sum().item()

    rows = {r["component"]: r["contribution"] for r in att.table if r["pos"] == T}
    assert rows["L1.mlp"] == pytest.approx(part(seen["mlp1"][0, T]), abs=1e-5)
    # each head's share: its output through its own slice of the output projection
    W_O = model.blocks[1].attn.proj.weight
    for h in range(4):
        v = seen[f"h{h}"][0, T] @ W_O[:, 16 * h : 16 * (h + 1)].T
        assert rows[f"L1.self_attn.h{h}"] == pytest.approx(part(v), abs=1e-5)
    heads = sum(rows[f"L1.self_attn.h{h}"] for h in range(4)) + rows["L1.self_attn.bias"]
    assert heads == pytest.approx(rows["L1.self_attn"], abs=1e-4)
    assert rows["L1.self_attn.bias"] == pytest.approx(part(model.blocks[1].attn.proj.bias), abs=1e-5)


def test_norm_and_unembedding_given_by_hand():
    model = models.load("minigpt")
    with torch.no_grad():
        logits = model(torch.tensor([model.tokenizer.encode(TEXT)]))[0]
    lens = probe.logit_lens(model, TEXT, norm=model.ln_f, unembed=model.lm_head)
    _check_final_layer(lens, logits)
    assert lens.readout == "ln_f -> lm_head"
    # a read-out that does not give the model's logits is refused, never shown
    with pytest.raises(probe.ProbeError, match="does not reproduce the model's logits"):
        probe.logit_lens(model, TEXT, norm=None, unembed=model.lm_head)


def test_a_cache_gives_the_same_lens():
    model = models.load("minigpt")
    cache = probe.capture(model, TEXT)
    a, b = probe.logit_lens(model, cache), probe.logit_lens(model, TEXT)
    assert torch.equal(a.p_pred, b.p_pred) and torch.equal(a.top_ids, b.top_ids)


def test_fused_decoder_no_final_norm():
    model = models.load("fused_decoder")
    text = "31415926"
    with torch.no_grad():
        logits = model(torch.tensor([model.tokenizer.encode(text)]))[0]
    lens = probe.logit_lens(model, text)
    _check_final_layer(lens, logits)
    assert lens.readout.endswith(", with no final norm")  # read as "read-out: lm_head, with no final norm"
    _check_attribution_sum(lens.attribution, logits)
    # its attention output is not a residual add: no exact head split, and it says so
    assert any("not split by head" in n for n in lens.attribution.notes)


@pytest.mark.parametrize(
    "name, source, target",
    [
        ("translator", "ich mochte ein bier", "S i want a beer"),
        ("aligner", "gestern sah der junge das hundehaus", "S yesterday the boy saw the dog house"),
    ],
)
def test_encoder_decoder_zoo_decoders(name, source, target):
    model = models.load(name)
    tok = model.tokenizer
    src = torch.tensor([tok.encode(source)])
    tgt = torch.tensor([tok.target.encode(target)])
    with torch.no_grad():
        logits = model(src, tgt)[0]
    lens = probe.logit_lens(model, source, target=target)
    _check_final_layer(lens, logits)
    _check_attribution_sum(lens.attribution, logits)
    assert lens.n_stream_rows == 1 + model.config.n_layers


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return H.bpe_tokenizer(tmp_path_factory.mktemp("bpe") / "bpe")


@pytest.mark.parametrize("build", [H.gpt2, H.llama], ids=["gpt2", "llama"])
def test_hugging_face_decoders(build, bpe):
    model = build(len(bpe))
    texts = ["attention lets tokens read context.", "the model"]
    if bpe.pad_token is None:
        bpe.pad_token = bpe.eos_token
    enc = bpe(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
    lens = probe.logit_lens(model, texts, tokenizer=bpe)
    _check_final_layer(lens, logits, enc["attention_mask"])
    _check_attribution_sum(lens.attribution, logits, enc["attention_mask"])
    heads = {r["component"] for r in lens.attribution.table if r["head"] not in ("", "bias")}
    assert len(heads) == model.config.num_hidden_layers * model.config.num_attention_heads
    assert not lens.attribution.notes


def test_exports_and_errors():
    model = models.load("minigpt")
    lens = probe.logit_lens(model, TEXT, k=2)
    t = lens.table()
    assert len(t) == len(lens.sources) * len(TEXT) and len(t[0]["top"]) == 2
    assert set(lens.to_dict()) == {"lens", "final_error", "readout", "attribution"}
    assert "<table>" in lens._repr_html_()
    with pytest.raises(probe.ProbeError, match="k must be"):
        probe.logit_lens(model, TEXT, k=0)
    with pytest.raises(probe.ProbeError, match="did not run"):
        probe.logit_lens(model, TEXT, unembed=torch.nn.Linear(64, 22))


def test_cli_lens():
    r = subprocess.run(
        [sys.executable, "-m", "probe", "lens", "--model", "minigpt", TEXT, "--position", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "ln_f -> lm_head" in r.stdout
    # the last layer read out against the model's logits: the same ops, yet their float32 sums
    # may round differently on another CPU or thread count; within the 1e-5 held above
    diff = re.search(r"max \|diff\| (\S+)", r.stdout)
    assert diff and float(diff.group(1)) <= 1e-5, r.stdout
    assert "at position 3" in r.stdout and "L1.self_attn.h0" in r.stdout


def test_cli_lens_on_a_gpt2_folder(tmp_path):
    """A saved GPT2LMHeadModel (architectures: GPT2LMHeadModel) loads with its LM head for --hf."""
    tok = H.bpe_tokenizer(tmp_path / "g")
    H.gpt2(len(tok)).save_pretrained(tmp_path / "g")
    r = subprocess.run(
        [sys.executable, "-m", "probe", "lens", "--hf", str(tmp_path / "g"), "attention lets tokens read"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr
    assert "-> lm_head" in r.stdout and "max |diff|" in r.stdout


def test_text_grid_wraps_to_a_width():
    text = "attention lets tokens read"
    lens = probe.logit_lens(models.load("minigpt"), text)
    wide = lens.to_text()
    assert len(wide.splitlines()) == 5  # tokens, embed, L0, L1, final: one line each
    narrow = lens.to_text(width=60)
    lines = narrow.splitlines()
    assert max(len(line) for line in lines) <= 60
    # every position appears once, in order, across the blocks; each block has the row labels again
    heads = [line for line in lines if line.strip().startswith("pos ")]
    positions = [int(x) for line in heads for x in line.split()[1::2]]
    assert positions == list(range(len(text)))
    assert sum(line.startswith("embed ") for line in lines) == len(heads) > 1
