"""probe.ablate / probe.patch: every intervention against an edit of the model written here (a
hook on a module the test names itself: the head's slice of the output projection's input, a
sublayer's output), on the zoo, HF GPT-2, Llama (GQA), BERT (all-MiniLM-L6-v2) and BART
(cross-attention), float32, on the models' default (SDPA) attention."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

import hf_fixtures as hf  # noqa: E402

import models  # noqa: E402
import probe  # noqa: E402
from probe.errors import ProbeError  # noqa: E402
from probe.forward import outputs_of  # noqa: E402

TEXT = "attention lets tokens read"
TOL = dict(rtol=0, atol=1e-6)


def _slice_hook(module, head, d_head, value=None):
    """The oracle: a pre-hook on ``module`` replacing head ``head``'s slice of its input."""

    def hook(mod, args):
        x = args[0].clone()
        sl = slice(head * d_head, (head + 1) * d_head)
        x[..., sl] = 0 if value is None else value(x[..., sl])
        return (x,) + args[1:]

    return module.register_forward_pre_hook(hook)


def _run_with(model, run, hooks):
    handles = [h() for h in hooks]
    try:
        with torch.no_grad():
            return run()
    finally:
        for h in handles:
            h.remove()


def _logits(out):
    return outputs_of(out).float()


@pytest.fixture(scope="module")
def minigpt():
    return models.load("minigpt")


def _ids(model):
    return torch.tensor([model.tokenizer.encode(TEXT)])


def test_no_intervention_is_bit_identical(minigpt):
    ids = _ids(minigpt)
    r = probe.ablate(minigpt, ids)
    with torch.no_grad():
        plain = minigpt(ids)
    assert torch.equal(r.outputs[0], plain[0]) and torch.equal(r.clean[0], plain[0])
    assert len(r.table) == 0


def test_minigpt_zero_head(minigpt):
    ids = _ids(minigpt)
    r = probe.ablate(minigpt, ids, heads=[(0, 1), (1, 3)])
    proj0, proj1 = minigpt.blocks[0].attn.proj, minigpt.blocks[1].attn.proj
    want = _run_with(
        minigpt, lambda: minigpt(ids), [lambda: _slice_hook(proj0, 1, 16), lambda: _slice_hook(proj1, 3, 16)]
    )
    torch.testing.assert_close(_logits(r.outputs), _logits(want), **TOL)
    assert r.table.column("component") == ["decoder.L0.H1", "decoder.L1.H3"]
    assert r.summary["max_abs_change"] > 0.01  # the edit changed something
    assert r.table.column("module") == ["blocks.0.attn.proj", "blocks.1.attn.proj"]


def _recorded_input(module, run):
    got = {}
    h = module.register_forward_pre_hook(lambda m, a: got.setdefault("x", a[0].detach().clone()))
    try:
        with torch.no_grad():
            run()
    finally:
        h.remove()
    return got["x"]


def test_minigpt_mean_and_resample(minigpt):
    tok = minigpt.tokenizer
    ids = _ids(minigpt)
    n = ids.shape[1]
    ref = torch.tensor(
        [
            tok.encode("graph neural networks pass messages")[:n],
            tok.encode("transformers use self attention")[:n],
        ]
    )
    assert ref.shape[1] == ids.shape[1]
    proj = minigpt.blocks[1].attn.proj
    x_ref = _recorded_input(proj, lambda: minigpt(ref))[..., 32:48]
    mean = x_ref.reshape(-1, 16).mean(0)
    r = probe.ablate(minigpt, ids, heads=[(1, 2)], how="mean", reference=ref)
    want = _run_with(
        minigpt, lambda: minigpt(ids), [lambda: _slice_hook(proj, 2, 16, lambda s: mean.expand_as(s))]
    )
    torch.testing.assert_close(_logits(r.outputs), _logits(want), **TOL)
    # resample: text 0 takes reference text 0
    r = probe.ablate(minigpt, ids, heads=[(1, 2)], how="resample", reference=ref)
    want = _run_with(minigpt, lambda: minigpt(ids), [lambda: _slice_hook(proj, 2, 16, lambda s: x_ref[:1])])
    torch.testing.assert_close(_logits(r.outputs), _logits(want), **TOL)
    # mean over the inputs themselves when no reference is given
    x_own = _recorded_input(proj, lambda: minigpt(ids))[..., 32:48].reshape(-1, 16).mean(0)
    r = probe.ablate(minigpt, ids, heads=[(1, 2)], how="mean")
    want = _run_with(
        minigpt, lambda: minigpt(ids), [lambda: _slice_hook(proj, 2, 16, lambda s: x_own.expand_as(s))]
    )
    torch.testing.assert_close(_logits(r.outputs), _logits(want), **TOL)


def _zero_output(module):
    def hook(mod, args, out):
        if isinstance(out, tuple):
            return (torch.zeros_like(out[0]),) + out[1:]
        return torch.zeros_like(out)

    return module.register_forward_hook(hook)


def test_minigpt_sublayers(minigpt):
    ids = _ids(minigpt)
    r = probe.ablate(minigpt, ids, sublayers=[(0, "attn"), (1, "mlp")])
    # the oracle zeroes what each sublayer module returns (its write to the residual stream)
    want = _run_with(
        minigpt,
        lambda: minigpt(ids),
        [lambda: _zero_output(minigpt.blocks[0].attn), lambda: _zero_output(minigpt.blocks[1].ffwd)],
    )
    torch.testing.assert_close(_logits(r.outputs), _logits(want), **TOL)
    assert r.table.column("component") == ["decoder.L0.attn", "decoder.L1.mlp"]


def test_gpt2_sdpa_heads():
    model = hf.gpt2(100)
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    r = probe.ablate(model, ids, heads=[(0, 2), (2, 0)])
    h = model.transformer.h
    want = _run_with(
        model,
        lambda: model(ids),
        [lambda: _slice_hook(h[0].attn.c_proj, 2, 16), lambda: _slice_hook(h[2].attn.c_proj, 0, 16)],
    )
    torch.testing.assert_close(_logits(r.outputs), _logits(want), **TOL)
    assert model.config._attn_implementation == "sdpa"
    # the eager twin gives the same ablated logits: the edit does not depend on the kernel
    twin = hf.eager_twin(model)
    r2 = probe.ablate(twin, ids, heads=[(0, 2), (2, 0)])
    torch.testing.assert_close(_logits(r2.outputs), _logits(want), rtol=0, atol=1e-5)


def test_gpt2_mlp_and_attention_sublayers():
    model = hf.gpt2(100)
    ids = torch.randint(1, 100, (1, 8), generator=torch.Generator().manual_seed(1))
    r = probe.ablate(model, ids, sublayers=[(1, "mlp"), (2, "attn")])
    h = model.transformer.h
    want = _run_with(
        model, lambda: model(ids), [lambda: _zero_output(h[1].mlp), lambda: _zero_output(h[2].attn)]
    )
    torch.testing.assert_close(_logits(r.outputs), _logits(want), **TOL)


def test_llama_gqa_heads():
    model = hf.llama(100)
    ids = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(2))
    r = probe.ablate(model, ids, heads=[(1, 5), (1, 6), (0, 0)])
    L = model.model.layers
    want = _run_with(
        model,
        lambda: model(ids),
        [
            lambda: _slice_hook(L[1].self_attn.o_proj, 5, 8),
            lambda: _slice_hook(L[1].self_attn.o_proj, 6, 8),
            lambda: _slice_hook(L[0].self_attn.o_proj, 0, 8),
        ],
    )
    torch.testing.assert_close(_logits(r.outputs), _logits(want), **TOL)


def test_bert_minilm_heads_with_padding():
    model, tok, _ = hf.minilm()
    texts = ["attention lets tokens read context.", "graph networks"]
    r = probe.ablate(model, texts, heads=[(3, 7)], tokenizer=tok, how="mean")
    enc = tok(texts, return_tensors="pt", padding=True)
    dense = model.encoder.layer[3].attention.output.dense
    x = _recorded_input(dense, lambda: model(**enc))[..., 7 * 32 : 8 * 32]
    mean = x[enc["attention_mask"].bool()].mean(0)  # over real tokens only
    want = _run_with(
        model, lambda: model(**enc), [lambda: _slice_hook(dense, 7, 32, lambda s: mean.expand_as(s))]
    )
    torch.testing.assert_close(r.outputs.last_hidden_state, want.last_hidden_state, **TOL)
    assert set(r.summary) == {"max_abs_change"}  # hidden states, not logits: no KL over them


def test_bart_cross_and_encoder_heads():
    model = hf.bart(100)
    src = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(3))
    tgt = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(4))

    def run():
        return model(input_ids=src, decoder_input_ids=tgt, use_cache=False)

    heads = [("decoder", 1, "cross", 2), ("encoder", 0, 3), ("decoder", 2, "self", 1)]
    r = probe.ablate(model, {"input_ids": src, "decoder_input_ids": tgt, "use_cache": False}, heads)
    m = model.model
    want = _run_with(
        model,
        run,
        [
            lambda: _slice_hook(m.decoder.layers[1].encoder_attn.out_proj, 2, 16),
            lambda: _slice_hook(m.encoder.layers[0].self_attn.out_proj, 3, 16),
            lambda: _slice_hook(m.decoder.layers[2].self_attn.out_proj, 1, 16),
        ],
    )
    torch.testing.assert_close(_logits(r.outputs), _logits(want), **TOL)
    assert r.table.column("component") == ["decoder.L1.cross.H2", "encoder.L0.H3", "decoder.L2.H1"]
    with pytest.raises(ProbeError, match="stacks"):
        probe.ablate(model, {"input_ids": src, "decoder_input_ids": tgt}, [(0, 1)])


class _FusedLM(nn.Module):
    """torch's fused nn.TransformerEncoderLayer: its out_proj runs inside one kernel call."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.enc = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
            2,
            enable_nested_tensor=False,
        )
        self.out = nn.Linear(16, 20)

    def forward(self, x):
        return self.out(self.enc(self.emb(x)))


def test_fused_attention_is_refused_naming_the_layer():
    torch.manual_seed(0)
    model = _FusedLM().eval()
    ids = torch.randint(0, 20, (1, 6))
    with pytest.raises(ProbeError, match=r"layer 1.*(fused|projection)"):
        probe.ablate(model, ids, heads=[(1, 0)])


def test_bad_requests(minigpt):
    ids = _ids(minigpt)
    with pytest.raises(ProbeError, match="4 heads"):
        probe.ablate(minigpt, ids, heads=[(0, 4)])
    with pytest.raises(ProbeError, match="how="):
        probe.ablate(minigpt, ids, heads=[(0, 1)], how="half")
    with pytest.raises(ProbeError, match="no self attention|attention layers"):
        probe.ablate(minigpt, ids, heads=[(5, 1)])
    with pytest.raises(ProbeError, match="a head is"):
        probe.ablate(minigpt, ids, heads=[3])
    with pytest.raises(ProbeError, match="kind"):
        probe.ablate(minigpt, ids, sublayers=[(0, "ffn")])


def test_exports(minigpt, tmp_path):
    r = probe.ablate(minigpt, _ids(minigpt), heads=[(0, 1)])
    d = r.to_dict()
    assert d["table"]["rows"][0]["head"] == 1 and "mean_kl" in d["summary"]
    assert "decoder.L0.H1" in r.to_csv() and "<table>" in r._repr_html_()
    assert r.to_pandas().shape == (1, 7)


# -- activation patching ---------------------------------------------------------------------


def _swap_hook(module, clean_x, pos=None, cols=None, output=False):
    """The oracle for patching: replace (part of) ``module``'s input/output by the clean value."""

    def put(x):
        x = x.clone()
        p = slice(None) if pos is None else pos
        c = slice(None) if cols is None else cols
        x[:, p, c] = clean_x[:, p, c]
        return x

    if output:
        return module.register_forward_hook(lambda m, a, o: put(o))
    return module.register_forward_pre_hook(lambda m, a: (put(a[0]),) + a[1:])


def test_patch_resid_minigpt(minigpt):
    tok = minigpt.tokenizer
    clean, corrupt = "attention lets tokens read", "attention lets tokens send"
    a, b = tok.encode(" ")[0], tok.encode("t")[0]
    ci, xi = torch.tensor([tok.encode(clean)]), torch.tensor([tok.encode(corrupt)])

    def ld(out):
        last = out[0][0, -1]
        return (last[a] - last[b]).item()

    with torch.no_grad():
        m_clean, m_corr = ld(minigpt(ci)), ld(minigpt(xi))
    r = probe.patch(
        minigpt, clean, corrupt, what="resid", metric="logit_diff", answer=" ", wrong="t", positions=[24, -1]
    )
    assert r.clean == pytest.approx(m_clean, abs=1e-6) and r.corrupted == pytest.approx(m_corr, abs=1e-6)
    block = minigpt.blocks[1]
    x_clean = _recorded_input(block, lambda: minigpt(ci))
    for pos in (24, 25):
        want = ld(_run_with(minigpt, lambda: minigpt(xi), [lambda p=pos: _swap_hook(block, x_clean, p)]))
        row = next(x for x in r.table if x["layer"] == 1 and x["pos"] == pos)
        assert row["metric"] == pytest.approx(want, abs=1e-5)
        assert row["normalised"] == pytest.approx((want - m_corr) / (m_clean - m_corr), abs=1e-5)
    assert r.grid.shape == (2, 2) and r.rows == ["L0", "L1"]
    # patching everything before the last layer at every position restores the clean run exactly
    x0 = _recorded_input(minigpt.blocks[0], lambda: minigpt(ci))
    full = ld(_run_with(minigpt, lambda: minigpt(xi), [lambda: _swap_hook(minigpt.blocks[0], x0)]))
    assert full == pytest.approx(m_clean, abs=1e-5)


def test_patch_heads_gpt2_prob():
    model = hf.gpt2(100)
    g = torch.Generator().manual_seed(5)
    ci = torch.randint(1, 100, (1, 8), generator=g)
    xi = ci.clone()
    xi[0, 2] = (ci[0, 2] + 7) % 100
    answer = 42

    def prob(out):
        return out.logits[0, -1].float().softmax(-1)[answer].item()

    r = probe.patch(model, ci, xi, what="heads", metric="prob", answer=answer)
    assert r.grid.shape == (3, 4)
    proj = model.transformer.h[1].attn.c_proj
    x_clean = _recorded_input(proj, lambda: model(ci))
    want = prob(_run_with(model, lambda: model(xi), [lambda: _swap_hook(proj, x_clean, cols=slice(32, 48))]))
    row = next(x for x in r.table if x["layer"] == 1 and x["head"] == 2)
    assert row["metric"] == pytest.approx(want, abs=1e-6)
    with torch.no_grad():
        assert r.corrupted == pytest.approx(prob(model(xi)), abs=1e-6)


def test_patch_mlp_llama_loss():
    model = hf.llama(100)
    g = torch.Generator().manual_seed(6)
    ci = torch.randint(1, 100, (1, 6), generator=g)
    xi = torch.randint(1, 100, (1, 6), generator=g)

    def loss(out):
        return torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), ci[0, 1:]).item()

    r = probe.patch(model, ci, xi, what="mlp", metric="loss", positions=[3])
    mlp = model.model.layers[0].mlp
    got = {}
    h = mlp.register_forward_hook(lambda m, a, o: got.setdefault("o", o.detach().clone()))
    with torch.no_grad():
        model(ci)
    h.remove()
    want = loss(_run_with(model, lambda: model(xi), [lambda: _swap_hook(mlp, got["o"], pos=3, output=True)]))
    row = next(x for x in r.table if x["layer"] == 0)
    assert row["metric"] == pytest.approx(want, abs=1e-6)


def test_patch_bad_requests(minigpt):
    with pytest.raises(ProbeError, match="same number of tokens"):
        probe.patch(minigpt, "attention lets", "attention", what="resid", metric="loss", positions=[0])
    with pytest.raises(ProbeError, match="what="):
        probe.patch(minigpt, "at", "ac", what="neurons")
    with pytest.raises(ProbeError, match="answer="):
        probe.patch(minigpt, "at", "ac", metric="logit_diff", answer="a")
    with pytest.raises(ProbeError, match="one of"):
        probe.patch(minigpt, "at", "ac", metric="accuracy")
    r = probe.patch(minigpt, "at", "at", what="attn", metric="loss")
    assert r.notes and "nothing to normalise" in r.notes[0]
    assert "grid" in r.to_dict() and "<table>" in r._repr_html_()


# -- the command line ------------------------------------------------------------------------


def _cli(*args):
    import subprocess

    return subprocess.run([sys.executable, "-m", "probe", *args], capture_output=True, text=True, timeout=600)


def test_cli_ablate_and_patch(tmp_path, minigpt):
    out = _cli("ablate", "--model", "minigpt", TEXT, "--heads", "0.1", "--csv", str(tmp_path / "a.csv"))
    assert out.returncode == 0, out.stderr
    assert "decoder.L0.H1" in out.stdout and "mean_kl" in out.stdout
    r = probe.ablate(minigpt, TEXT, heads=[(0, 1)])
    assert f"{r.summary['mean_kl']:.4g}" in out.stdout  # the same numbers as the Python call
    assert (tmp_path / "a.csv").read_text().startswith("component,stack,layer")
    clean, corrupt = "attention lets tokens read", "attention lets tokens send"
    out = _cli(
        "patch",
        "--model",
        "minigpt",
        "--clean",
        clean,
        "--corrupted",
        corrupt,
        "--answer",
        " ",
        "--wrong",
        "t",
        "--positions",
        "25",
        "--json",
        str(tmp_path / "p.json"),
    )
    assert out.returncode == 0, out.stderr
    import json

    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    want = probe.patch(minigpt, clean, corrupt, answer=" ", wrong="t", positions=[25])
    assert [x["normalised"] for x in rows] == pytest.approx([x["normalised"] for x in want.table], abs=1e-9)
    for cmd in ("ablate", "patch"):  # as tests/test_cli.py checks every command's --help
        h = _cli(cmd, "--help")
        assert h.returncode == 0, h.stderr
        lines = h.stdout.splitlines()
        examples = lines[lines.index("examples:") + 1 :]
        assert examples and all(
            line.startswith("  probe ") and line.count("probe ") == 1 for line in examples
        )


def test_cli_bad_input_exits_2():
    for args in (
        ("ablate", "--model", "minigpt", TEXT, "--heads", "0.9"),
        ("ablate", "--model", "minigpt", TEXT),
        ("ablate", "--model", "minigpt", TEXT, "--heads", "7"),
        ("patch", "--model", "minigpt", "--clean", "attention", "--corrupted", "at", "--metric", "loss"),
    ):
        out = _cli(*args)
        assert out.returncode == 2 and "Traceback" not in out.stderr and out.stderr.count("\n") == 1, (
            out.stderr
        )


# -- head importance -------------------------------------------------------------------------


def test_head_importance_minigpt(minigpt):
    ids = _ids(minigpt)

    def loss(out):
        return torch.nn.functional.cross_entropy(out[0][0, :-1].float(), ids[0, 1:])

    r = probe.head_importance(minigpt, ids, metric="loss")
    assert r.grid.shape == (2, 4)
    with torch.no_grad():
        base = loss(minigpt(ids)).item()
    proj = minigpt.blocks[1].attn.proj
    ablated = loss(_run_with(minigpt, lambda: minigpt(ids), [lambda: _slice_hook(proj, 2, 16)])).item()
    assert r.grid[1, 2].item() == pytest.approx(ablated - base, abs=1e-6)
    # the gradient of Michel et al.: a gate on the head's output, differentiated by autograd
    gate = torch.ones((), requires_grad=True)

    def gated(mod, args):
        x = args[0]
        return (torch.cat([x[..., :32], x[..., 32:48] * gate, x[..., 48:]], -1),)

    h = proj.register_forward_pre_hook(gated)
    try:
        (g,) = torch.autograd.grad(loss(minigpt(ids)), [gate])
    finally:
        h.remove()
    assert r.gradients[1, 2].item() == pytest.approx(g.item(), abs=1e-6)
    assert all(p.grad is None for p in minigpt.parameters())  # parameters untouched
    with pytest.raises(ProbeError, match="how="):
        probe.head_importance(minigpt, ids, how="resample")


# -- attention knockout ----------------------------------------------------------------------


def test_knockout_minigpt_one_head_against_its_own_mask_edited(minigpt):
    import copy

    ids = _ids(minigpt)
    T = ids.shape[1]
    r = probe.knockout(minigpt, ids, edges=[(-1, range(10, 21))], layers=[1], heads=[2])
    twin = copy.deepcopy(minigpt)
    twin.blocks[1].attn.heads[2].tril[T - 1, 10:21] = 0  # the head's own causal mask, edited by hand
    with torch.no_grad():
        want = twin(ids)
    torch.testing.assert_close(_logits(r.outputs), _logits(want), **TOL)
    assert r.table.rows == [{"stack": "decoder", "layer": 1, "role": "self", "head": 2, "ops": 1}]
    assert r.summary["max_abs_change"] > 1e-3


def test_knockout_llama_sdpa_against_a_4d_mask():
    model = hf.llama(100)
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    r = probe.knockout(model, ids, edges=[(-1, range(2, 6)), (5, [0])])
    T = 9
    mask = torch.zeros(T, T).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    mask[-1, 2:6] = float("-inf")
    mask[5, 0] = float("-inf")
    with torch.no_grad():
        want = model(ids, attention_mask=mask[None, None].expand(2, 1, T, T))
    torch.testing.assert_close(_logits(r.outputs), _logits(want), **TOL)
    assert len(r.table) == 2 * 8  # every head of both layers
    assert model.config._attn_implementation == "sdpa"


def test_knockout_gpt2_sdpa_equals_eager_softmax_path():
    model = hf.gpt2(100)
    ids = torch.randint(1, 100, (1, 9), generator=torch.Generator().manual_seed(1))
    kw = dict(edges=[(-1, range(2, 6))], layers=[1], heads=[0, 3])
    r1 = probe.knockout(model, ids, **kw)
    r2 = probe.knockout(hf.eager_twin(model), ids, **kw)  # -inf added to the softmax input there
    torch.testing.assert_close(_logits(r1.outputs), _logits(r2.outputs), **TOL)
    assert r1.summary["max_abs_change"] > 1e-4
    with pytest.raises(ProbeError, match="no key"):
        probe.knockout(model, ids, edges=[(0, 0)])
    with pytest.raises(ProbeError, match="4 heads"):
        probe.knockout(model, ids, edges=[(-1, 0)], heads=[4])


def test_knockout_in_a_fused_layer_is_refused():
    torch.manual_seed(0)
    model = _FusedLM().eval()
    ids = torch.randint(0, 20, (1, 6))
    with pytest.raises(ProbeError, match=r"layer \d"):
        probe.knockout(model, ids, edges=[(-1, 0)])


def test_knockout_bart_cross_attention_against_the_encoder_mask():
    model = hf.bart(100)
    src = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(7))
    tgt = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(8))
    inputs = {"input_ids": src, "decoder_input_ids": tgt, "use_cache": False}
    r = probe.knockout(model, inputs, edges=[(None, [2, 3])], stack="decoder", role="cross")
    # the oracle: the same encoder states, and an encoder mask hiding keys 2 and 3 from every
    # cross-attention (the decoder's self-attention does not read the encoder mask)
    with torch.no_grad():
        enc = model.model.encoder(input_ids=src)
        mask = torch.ones_like(src)
        mask[0, 2:4] = 0
        want = model(encoder_outputs=enc, attention_mask=mask, decoder_input_ids=tgt, use_cache=False)
    torch.testing.assert_close(_logits(r.outputs), _logits(want), **TOL)
    assert {row["role"] for row in r.table} == {"cross"} and len(r.table) == 3 * 4
