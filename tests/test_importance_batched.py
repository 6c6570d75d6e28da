"""probe.head_importance, batched (the heads of a layer as row blocks of one forward) and one
forward per head, against an oracle written here: a pre-hook on the output projection zeroing
(or mean-filling) the head's slice, one plain forward per head, and the metric computed here.
On the zoo's minigpt, HF GPT-2 (sdpa), Llama (GQA) and all-MiniLM-L6-v2 (a padded batch)."""

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

TOL = 1e-6


def _removed(model, proj, head, d_head, run, value=None):
    """The model's outputs with ``head``'s slice of ``proj``'s input replaced (zeros by default)."""

    def hook(mod, args):
        x = args[0].clone()
        sl = slice(head * d_head, (head + 1) * d_head)
        x[..., sl] = 0 if value is None else value.to(x.dtype).expand_as(x[..., sl])
        return (x,) + args[1:]

    h = proj.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            return run()
    finally:
        h.remove()


def _loss(logits, ids):
    """Next-token cross-entropy over every position of every text (no padding here)."""
    lg = logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1)).item()


def _oracle(model, projs, heads, d_head, run, metric):
    """``[layers, heads]``: metric(ablated) - metric(clean), one forward per head."""
    with torch.no_grad():
        base = metric(run())
    return torch.tensor(
        [[metric(_removed(model, p, h, d_head, run)) - base for h in range(heads)] for p in projs]
    )


def _check(r, want):
    assert r.grid.shape == want.shape
    torch.testing.assert_close(r.grid, want, rtol=0, atol=TOL)
    assert r.grid.abs().max() > 1e-3  # the ablations changed the metric


@pytest.fixture(scope="module")
def minigpt():
    return models.load("minigpt")


def test_minigpt_batched_and_per_head_equal_the_oracle(minigpt):
    tok = minigpt.tokenizer
    texts = ["attention lets tokens read", "tokens read attention"]
    ids = torch.tensor([tok.encode(t)[:20] for t in texts])
    projs = [b.attn.proj for b in minigpt.blocks]
    want = _oracle(minigpt, projs, 4, 16, lambda: minigpt(ids), lambda out: _loss(out[0], ids))
    batched = probe.head_importance(minigpt, ids)
    assert batched.notes == []  # it did run batched
    _check(batched, want)
    one = probe.head_importance(minigpt, ids, batched=False)
    _check(one, want)
    small = probe.head_importance(minigpt, ids, max_batch=5)  # 2 heads (4 rows) a forward
    _check(small, want)


def test_gpt2_sdpa_logit_diff(minigpt):
    model = hf.gpt2(100)
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(1, 100, (3, 9), generator=torch.Generator().manual_seed(0))
    projs = [b.attn.c_proj for b in model.transformer.h]

    def ld(out):
        return (out.logits[:, -1, 7] - out.logits[:, -1, 11]).float().mean().item()

    want = _oracle(model, projs, 4, 16, lambda: model(ids), ld)
    r = probe.head_importance(model, ids, metric="logit_diff", answer=7, wrong=11)
    assert r.notes == []
    _check(r, want)
    assert model.config._attn_implementation == "sdpa"


def test_llama_gqa_mean_ablation():
    model = hf.llama(100)
    ids = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(2))
    projs = [layer.self_attn.o_proj for layer in model.model.layers]
    means = []
    for p in projs:  # each head's mean input over the inputs' positions, recorded by a hook
        got = {}
        h = p.register_forward_pre_hook(lambda m, a, _g=got: _g.setdefault("x", a[0].detach().clone()))
        with torch.no_grad():
            model(ids)
        h.remove()
        means.append(got["x"].reshape(-1, 8, 8).mean(0))  # [heads, d_head]

    def loss(out):
        return _loss(out.logits, ids)

    with torch.no_grad():
        base = loss(model(ids))
    want = torch.tensor(
        [
            [loss(_removed(model, p, h, 8, lambda: model(ids), means[i][h])) - base for h in range(8)]
            for i, p in enumerate(projs)
        ]
    )
    r = probe.head_importance(model, ids, how="mean")
    assert r.notes == []
    _check(r, want)


def test_minilm_padded_batch():
    model, tok, _ = hf.minilm()
    texts = ["attention lets tokens read context.", "graph networks"]
    enc = tok(texts, return_tensors="pt", padding=True)
    last = enc["attention_mask"].sum(1) - 1  # each text's last real position (right padding)
    projs = [layer.attention.output.dense for layer in model.encoder.layer[:2]]

    def diff(out):
        h = out.last_hidden_state[torch.arange(2), last]
        return (h[:, 5] - h[:, 7]).float().mean().item()

    want = _oracle(model, projs, 12, 32, lambda: model(**enc), diff)
    r = probe.head_importance(model, texts, tokenizer=tok, metric="logit_diff", answer=5, wrong=7)
    assert r.notes == []
    _check(r.__class__(r.metric_name, r.how, r.table, r.grid[:2], r.gradients[:2], r.rows[:2]), want)


def test_a_metric_function_falls_back_to_one_forward_per_head(minigpt):
    ids = torch.tensor([minigpt.tokenizer.encode("attention lets tokens read")])
    projs = [b.attn.proj for b in minigpt.blocks]

    def top(out):  # a function of the whole outputs: no per-example form
        return out[0][:, -1].float().max()

    want = _oracle(minigpt, projs, 4, 16, lambda: minigpt(ids), lambda out: top(out).item())
    r = probe.head_importance(minigpt, ids, metric=top)
    assert r.notes and "one forward per head" in r.notes[0]
    _check(r, want)
    with pytest.raises(ProbeError, match="max_batch"):
        probe.head_importance(minigpt, ids, max_batch=0)


class _BatchMean(nn.Module):
    """minigpt whose logits are averaged over the batch: its outputs have no row per input row."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids):
        return self.inner(ids)[0].mean(0, keepdim=True)


def test_a_model_whose_rows_do_not_line_up_falls_back(minigpt):
    model = _BatchMean(minigpt).eval()
    ids = torch.tensor([minigpt.tokenizer.encode("attention lets tokens read")])
    projs = [b.attn.proj for b in minigpt.blocks]
    want = _oracle(model, projs, 4, 16, lambda: model(ids), lambda out: _loss(out, ids))
    r = probe.head_importance(model, ids)
    assert r.notes and "one row per" in r.notes[0]
    _check(r, want)


def test_bart_cross_attention_batched():
    model = hf.bart(100)
    src = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(3))
    tgt = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(4))
    inputs = {"input_ids": src, "decoder_input_ids": tgt, "use_cache": False}
    projs = [layer.encoder_attn.out_proj for layer in model.model.decoder.layers]

    def ld(out):
        return (out.logits[:, -1, 5] - out.logits[:, -1, 9]).float().mean().item()

    want = _oracle(model, projs, 4, 16, lambda: model(**inputs), ld)
    kw = dict(stack="decoder", role="cross", metric="logit_diff", answer=5, wrong=9)
    r = probe.head_importance(model, inputs, **kw)
    assert r.notes == []  # encoder and decoder inputs repeated together
    _check(r, want)
