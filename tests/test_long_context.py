"""Long contexts in bounded memory: ``probe.head_stats(model, inputs)`` computes every statistic
row block by row block while the model runs; its oracle is the full-pattern path,
``probe.head_stats(probe.capture(model, inputs))`` (itself tested against hand computations in
test_focus.py), on causal and bidirectional, padded, GQA, sliding-window, ALiBi and
cross-attention models, at several lengths and block sizes."""

from __future__ import annotations

import math

import hf_fixtures as H
import pytest
import torch
from toys import ToyLM

import probe
from probe.errors import ProbeError

TEXTS = ["attention lets tokens read context.", "the model is reading the tokens one by one, quickly."]
TARGETS = ["ich mochte ein bier.", "graph neural networks pass messages, said he"]


def assert_same(streamed, full):
    """Every row and column equal: means within 1e-6 (relative above 1), the sample std across
    texts within 1e-5 (a difference of two means near each other amplifies float32 rounding)."""
    a = {(r["stack"], r["layer"], r["head"], r["kind"]): r for r in streamed.table}
    b = {(r["stack"], r["layer"], r["head"], r["kind"]): r for r in full.table}
    assert a.keys() == b.keys()
    assert streamed.table.columns == full.table.columns
    for k, row in a.items():
        for c, v in row.items():
            w = b[k][c]
            if isinstance(v, float) and isinstance(w, float):
                if math.isnan(w):
                    assert math.isnan(v), (k, c, v, w)
                    continue
                tol = 1e-5 if c.endswith("_std") else 1e-6
                assert abs(v - w) <= tol * max(1.0, abs(w)), (k, c, v, w)
            else:
                assert v == w, (k, c, v, w)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return H.bpe_tokenizer(tmp_path_factory.mktemp("bpe"))


@pytest.mark.parametrize("kind", ["sdpa_causal", "F.softmax", "sdpa_float", "sdpa_gqa", "mha", "sdpa_bool"])
@pytest.mark.parametrize("T,block", [(9, 2), (50, 7), (61, 64)])
def test_toy_decoders_match_the_full_patterns(kind, T, block):
    torch.manual_seed(T)
    lm = ToyLM(kind, n_kv_heads=2 if kind == "sdpa_gqa" else None).eval()
    ids = torch.randint(0, 40, (2, T))
    streamed = probe.head_stats(lm, ids, block=block)
    full = probe.head_stats(probe.capture(lm, ids), progress=False)
    assert_same(streamed, full)
    assert all(r["causal"] for r in streamed.table)
    assert streamed.rollout is None and "rollout" in streamed.not_computed
    assert full.rollout is not None  # the full path computes it


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt2"])
def test_padded_hf_decoders_match(bpe, name):
    """Padded batches; Llama has grouped-query attention, Mistral a sliding window of 4 keys."""
    model = getattr(H, name)(len(bpe))
    streamed = probe.head_stats(model, TEXTS, tokenizer=bpe, block=3)
    full = probe.head_stats(probe.capture(model, TEXTS, tokenizer=bpe), progress=False)
    assert_same(streamed, full)
    if name == "llama":
        assert streamed.kv_groups == full.kv_groups and streamed.kv_groups


def test_bidirectional_padded_encoder_matches():
    model, tok, _ = H.minilm()
    streamed = probe.head_stats(model, TEXTS, tokenizer=tok, block=4)
    full = probe.head_stats(probe.capture(model, TEXTS, tokenizer=tok), progress=False)
    assert_same(streamed, full)
    assert not any(r["causal"] for r in streamed.table)


def test_cross_attention_matches(bpe):
    model = H.bart(len(bpe))
    streamed = probe.head_stats(model, TEXTS, tokenizer=bpe, target=TARGETS, block=3)
    full = probe.head_stats(probe.capture(model, TEXTS, tokenizer=bpe, target=TARGETS), progress=False)
    assert_same(streamed, full)
    assert {r["kind"] for r in streamed.table} == {"self", "cross"}


def test_layer_selection_and_bad_arguments():
    lm = ToyLM("sdpa_causal").eval()
    ids = torch.randint(0, 40, (1, 12))
    s = probe.head_stats(lm, ids, layers=[1])
    assert {r["layer"] for r in s.table} == {1}
    full = probe.head_stats(probe.capture(lm, ids), progress=False)
    want = [r for r in full.table if r["layer"] == 1]
    assert [r["entropy"] for r in s.table] == pytest.approx([r["entropy"] for r in want], abs=1e-6)
    with pytest.raises(ProbeError, match="block"):
        probe.head_stats(lm, ids, block=0)
    with pytest.raises(ProbeError, match="inputs"):
        probe.head_stats(lm)


def test_blocks_never_hold_a_whole_pattern(monkeypatch):
    """Every block handed to the statistics has at most ``block`` query rows."""
    from probe.analysis.focus import streaming

    seen = []
    real = streaming.RowTerms.rows

    def spy(self, q0, q1, blk):
        seen.append(tuple(blk.shape))
        return real(self, q0, q1, blk)

    monkeypatch.setattr(streaming.RowTerms, "rows", spy)
    lm = ToyLM("sdpa_causal").eval()
    probe.head_stats(lm, torch.randint(0, 40, (1, 40)), block=8)
    assert seen and all(s[2] <= 8 for s in seen)
    # causal SDPA blocks read only the keys their rows can see
    assert min(s[3] for s in seen) == 8
