"""Capture on a GPU: outputs bit-identical, patterns equal to HF eager's, buffers on the model's device.

Skipped where CUDA is absent (CI runners without a GPU); runs wherever ``torch.cuda`` works.
"""

from __future__ import annotations

import hf_fixtures as H
import pytest
import torch
from sorted_oracle import sorted_terms

import probe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def gpt2_cuda(tmp_path_factory):
    tok = H.bpe_tokenizer(tmp_path_factory.mktemp("bpe") / "bpe")
    return H.gpt2(len(tok)).to("cuda"), tok


def test_capture_on_cuda_matches_hf_eager(gpt2_cuda, tmp_path):
    model, tok = gpt2_cuda
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tok), (2, 48), generator=g)  # built on the CPU: probe moves it
    with torch.no_grad():
        plain = model(input_ids=ids.cuda()).logits
        with probe.trace(model) as t:
            traced = model(input_ids=ids.cuda()).logits
        eager = H.eager_twin(model)(input_ids=ids.cuda(), output_attentions=True).attentions
    assert torch.equal(plain, traced), "capture changed the outputs on CUDA"
    memory = probe.capture(model, ids)
    streamed = probe.capture(model, ids, out=tmp_path / "c.safetensors")
    for i, e in enumerate(eager):
        assert t.cache.pattern("decoder", i).device.type == "cuda"  # kept where it was computed
        torch.testing.assert_close(t.cache.pattern("decoder", i), e, atol=1e-5, rtol=0)
        torch.testing.assert_close(memory.pattern("decoder", i), e, atol=1e-5, rtol=0)
        torch.testing.assert_close(streamed.pattern("decoder", i), e.cpu(), atol=1e-5, rtol=0)
    for k in memory.keys():
        assert torch.equal(memory[k].cpu(), streamed[k]), k
    pre, post = memory["decoder.blocks.1.resid_pre"], memory["decoder.blocks.0.resid_post"]
    assert torch.equal(pre, post)


def test_text_capture_on_cuda(gpt2_cuda):
    # texts are tokenized on the CPU; ids and mask must reach the model's device
    model, tok = gpt2_cuda
    cache = probe.capture(model, ["attention lets tokens read context.", "the model"], tokenizer=tok)
    assert cache.pattern("decoder", 0).shape[0] == 2


@pytest.mark.parametrize("K", [1, 7, 300, 4096, 16384, 20000])
def test_row_kernel_matches_a_sort(K):
    rk = pytest.importorskip("probe.analysis.focus.backends.kernels.rowkernel")
    if rk.triton is None:
        pytest.skip("Triton is not installed")
    g = torch.Generator().manual_seed(K)
    S = torch.randn(6, 50, K, generator=g) * torch.linspace(0.1, 6, 50)[:, None]
    S[0, :10, K // 2 + 1 :] = -float("inf")  # causal-like rows: trailing zeros
    P = torch.softmax(S, -1)
    P[1, 0] = 1.0 / K  # one value K times: ties at the threshold
    P[1, 1] = 0.0  # a fully masked row
    P[1, 2, : min(K, 3)] = 1.0 / min(K, 3)
    P[1, 2, 3:] = 0
    got = rk.row_terms(P.cuda())
    want = sorted_terms(P)
    assert torch.equal(got["span"].cpu().long(), want["span"])
    assert torch.equal(got["arg"].cpu(), want["arg"])
    torch.testing.assert_close(got["top"].cpu().double(), want["top"], rtol=0, atol=0)
    torch.testing.assert_close(got["total"].cpu().double(), want["total"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["ent"].cpu().double(), want["ent"], rtol=1e-5, atol=1e-5)
    assert rk.row_terms(-P[:1].cuda()) is None  # a negative weight: the caller sorts instead


def test_long_stats_on_cuda_match_the_full_patterns_on_cpu():
    """At 2,048 tokens, default blocks (the row kernel, causal blocks sized by area) on the GPU
    against the whole-pattern statistics of a CPU capture."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from models.llama import VOCAB, build

    model = build(n_layers=2, n_heads=4, d_model=128)
    ids = torch.randint(0, VOCAB, (1, 2048), generator=torch.Generator().manual_seed(0))
    full = probe.head_stats(probe.capture(model, ids), progress=False)
    streamed = probe.head_stats(model.to("cuda"), ids.cuda())
    a = {(r["layer"], r["head"]): r for r in streamed.table}
    for r in full.table:
        for c in ("entropy", "confidence", "first", "span", "distance", "reach90", "beyond_16", "dup_score"):
            assert a[r["layer"], r["head"]][c] == pytest.approx(r[c], rel=1e-4, abs=1e-5), c


def _llama_ids(T, seed=0, **kw):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from models.llama import VOCAB, build

    model = build(**{"n_layers": 2, "n_heads": 4, "d_model": 128, **kw})
    return model, torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("K", [1, 7, 300, 4096, 20000])
def test_fused_kernel_matches_a_sort(K):
    """The fused kernel (q and k tiles, weights never written) against a sort written here over
    torch's weights: ties (equal keys), a row with no key, padding keys; float32 weights computed
    two ways may differ by an ulp, so a span may move by one key on a few rows."""
    qk = pytest.importorskip("probe.analysis.focus.backends.kernels.qkkernel")
    if qk.triton is None:
        pytest.skip("Triton is not installed")
    g = torch.Generator().manual_seed(K)
    B, Hh, L, E = 2, 2, 40, 64
    q = torch.randn(B, Hh, L, E, generator=g)
    k = torch.randn(B, 1, K, E, generator=g)
    k[0, 0, : K // 2] = k[0, 0, 0]
    q[1, :, 3] = 0
    mask = torch.ones(B, 1, L, K, dtype=torch.bool)
    mask[0, 0, 2] = False
    kreal = torch.ones(B, K, dtype=torch.bool)
    kreal[1, : K // 3] = False
    cols = torch.rand(B, 3, K, generator=g)
    qreal, first = torch.ones(B, L, dtype=torch.bool), torch.zeros(B, dtype=torch.long)
    got = qk.qk_terms(
        q.cuda(),
        k.cuda(),
        mask.cuda(),
        False,
        None,
        kreal=kreal.cuda(),
        qreal=qreal.cuda(),
        cols=cols.cuda(),
        first=first.cuda(),
    )
    s = (q.double() @ k.double().repeat_interleave(Hh, 1).transpose(-1, -2)) / E**0.5
    P = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    P = (P * kreal[:, None, None]).float()
    want = sorted_terms(P)
    d = (got["span"].cpu().long() - want["span"]).abs()
    assert d.max() <= 1 and (d == 0).float().mean() > 0.9
    assert torch.equal(got["span"][1, :, 3].cpu().long(), want["span"][1, :, 3])  # equal weights: exact
    assert float(got["span"][0, :, 2].abs().max()) == 0  # no key: span 0
    torch.testing.assert_close(got["top"].cpu().double(), want["top"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got["total"].cpu().double(), want["total"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["ent"].cpu().double(), want["ent"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["recv"].cpu(), P.double().sum(2), rtol=1e-5, atol=1e-5)


def test_fused_path_on_cuda_equals_the_block_path_and_the_full_patterns(monkeypatch):
    """At 1,500 tokens with grouped-query attention: with PROBE_FUSED=1 every attention goes
    through the fused kernel, and its table and sink profile equal the block path's (the default)
    and the whole-pattern statistics of a CPU capture."""
    from probe.analysis.focus.backends import triton_fused as fused

    model, ids = _llama_ids(1500, n_kv_heads=2)
    full = probe.head_stats(probe.capture(model, ids), progress=False)
    calls = []
    real = fused.read_call
    monkeypatch.setattr(fused, "read_call", lambda *a: calls.append(real(*a)) or calls[-1])
    monkeypatch.setenv("PROBE_FUSED", "1")
    new = probe.head_stats(model.to("cuda"), ids.cuda())
    assert len(calls) == 2 and all(calls)
    monkeypatch.delenv("PROBE_FUSED")
    old = probe.head_stats(model, ids.cuda())
    assert len(calls) == 4 and not any(calls[2:])
    a, o = {(r["layer"], r["head"]): r for r in new.table}, {(r["layer"], r["head"]): r for r in old.table}
    for r in full.table:
        for c, v in r.items():
            if isinstance(v, float) and v == v:
                for got in (a, o):
                    assert got[r["layer"], r["head"]][c] == pytest.approx(v, rel=1e-4, abs=1e-5), c
    torch.testing.assert_close(new.sink_profile(1), full.sink_profile(1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("which", ["llama", "llama_eager", "bart"])
def test_block_path_on_cuda_equals_the_full_patterns(which, tmp_path):
    """The row kernel's every term on the GPU (no wait per block): a padded batch with words and
    templates (Llama, SDPA: the kernel writes the attention's table), the model's own weights
    (eager: read back per block), an encoder's non-causal layers and cross-attention (BART),
    small blocks (many per attention), against the whole-pattern statistics of a CPU capture."""
    from test_long_context import TARGETS, TEXTS

    bpe = H.bpe_tokenizer(tmp_path / "bpe")
    kw = {"target": TARGETS} if which == "bart" else {}
    model = H.bart(len(bpe)) if which == "bart" else H.llama(len(bpe))
    model = H.eager_twin(model) if which == "llama_eager" else model
    full = probe.head_stats(probe.capture(model, TEXTS, tokenizer=bpe, **kw), progress=False)
    streamed = probe.head_stats(model.to("cuda"), TEXTS, tokenizer=bpe, block=3, **kw)
    got = {(r["stack"], r["layer"], r["head"], r["kind"]): r for r in streamed.table}
    assert len(got) == len(full.table)
    for r in full.table:
        g = got[r["stack"], r["layer"], r["head"], r["kind"]]
        for c, v in r.items():
            if isinstance(v, float) and v == v:
                assert g[c] == pytest.approx(v, rel=1e-4, abs=1e-5), (r["stack"], r["layer"], c)
            elif not isinstance(v, float):
                assert g[c] == v, c
    assert any(r["causal"] is False for r in streamed.table) == (which == "bart")  # an encoder's layers
