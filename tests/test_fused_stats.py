"""The fused statistics kernel (probe/analysis/focus/backends/kernels/qkkernel.py: every per-row
term from tiles of q and k, the weights never written), run on the CPU by Triton's interpreter.

Oracles: a sort and loops written here over weights computed here with torch (for the kernel's
span, top, argmax, total, entropy, column sums), and the whole-pattern statistics
``probe.head_stats(probe.capture(...))`` for the streamed table (causal, float and boolean masks,
grouped-query attention, padded Hugging Face batches with words and templates).
"""

from __future__ import annotations

import importlib
import os
import sys

import torch
from sorted_oracle import sorted_terms

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # read when Triton is imported: its kernels run on the CPU

import hf_fixtures as H  # noqa: E402
import pytest  # noqa: E402
from test_long_context import TEXTS, assert_same  # noqa: E402
from toys import ToyLM  # noqa: E402

import probe  # noqa: E402

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kernel():
    """qkkernel compiled for Triton's interpreter (on a CPU), and the fused path allowed on CPU
    tensors; skipped where Triton was imported before this module could ask for the interpreter."""
    from probe.analysis.focus.backends import triton_fused as fused
    from probe.analysis.focus.backends.kernels import qkkernel

    if torch.cuda.is_available():
        pytest.skip("these run the interpreter on CPU tensors; tests/test_cuda.py runs the kernel on the GPU")
    importlib.reload(qkkernel)
    if type(qkkernel._qk_stats).__name__ != "InterpretedFunction":
        pytest.skip("Triton was imported without TRITON_INTERPRET=1 (run this file on its own)")
    fused.CPU = True
    old = os.environ.get("PROBE_FUSED")
    os.environ["PROBE_FUSED"] = "1"
    try:
        yield qkkernel
    finally:
        fused.CPU = False
        if old is None:
            os.environ.pop("PROBE_FUSED")
        else:
            os.environ["PROBE_FUSED"] = old


def _inputs(B, H, L, S, E, seed, kv=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=g) * 0.6
    k = torch.randn(B, kv or H, S, E, generator=g) * 0.6
    return q, k


def _run(kernel, q, k, mask, causal, kreal=None, qreal=None):
    B, H, L, _ = q.shape
    S = k.size(2)
    kreal = torch.ones(B, S, dtype=torch.bool) if kreal is None else kreal
    qreal = torch.ones(B, L, dtype=torch.bool) if qreal is None else qreal
    cols = torch.rand(B, 3, S, generator=torch.Generator().manual_seed(1))
    first = torch.zeros(B, dtype=torch.long)
    return kernel.qk_terms(q, k, mask, causal, None, kreal=kreal, qreal=qreal, cols=cols, first=first), cols


def _weights(q, k, mask, causal, kreal):
    """The weights written here: softmax(q kᵀ/√E + mask), NaN rows to zero, padding keys zeroed."""
    B, H, L, E = q.shape
    k = k.repeat_interleave(H // k.size(1), 1)
    s = (q.double() @ k.double().transpose(-1, -2)) / E**0.5
    if causal:
        s = s.masked_fill(torch.ones(L, k.size(2), dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p * kreal[:, None, None, :]).float()


@pytest.mark.parametrize("K", [1, 7, pytest.param(33, marks=pytest.mark.slow), 100])
def test_kernel_terms_match_a_sort(kernel, K):
    """Random rows, a row with every key masked, rows with ties (equal keys), padding keys."""
    q, k = _inputs(2, 2, 9, K, 16, K, kv=1)
    k[0, 0, : K // 2] = k[0, 0, 0]  # many equal scores: ties at the span's threshold
    q[1, :, 3] = 0  # a uniform row: every weight the same
    mask = torch.ones(2, 1, 9, K, dtype=torch.bool)
    mask[0, 0, 2] = False  # a row with no key
    kreal = torch.ones(2, K, dtype=torch.bool)
    kreal[1, : K // 3] = False  # padding keys: their weight is zeroed after the softmax
    got, cols = _run(kernel, q, k, mask, False, kreal=kreal)
    P = _weights(q, k, mask, False, kreal)
    want = sorted_terms(P)
    span_diff = (got["span"].long() - want["span"]).abs()
    assert (
        span_diff.max() <= 1 and (span_diff == 0).float().mean() > 0.9
    )  # float32 weights may differ by an ulp
    assert torch.equal(got["span"][0, :, 2], torch.zeros(2)) and torch.equal(
        got["total"][0, :, 2], torch.zeros(2)
    )
    assert torch.equal(got["arg"], want["arg"])
    torch.testing.assert_close(got["top"].double(), want["top"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got["total"].double(), want["total"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["ent"].double(), want["ent"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["recv"], P.double().sum(2), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        got["special"].double(), (P.double() * cols[:, None, None, 0]).sum(-1), atol=1e-6, rtol=1e-5
    )
    # equal weights exactly: the span is the count the sort gives, not within one
    assert torch.equal(got["span"][1, :, 3].long(), want["span"][1, :, 3])


def test_kernel_causal_float_mask_distances(kernel):
    """is_causal with an additive float mask: the distance terms against loops written here."""
    q, k = _inputs(1, 2, 40, 40, 8, 5)
    mask = torch.randn(1, 2, 40, 40, generator=torch.Generator().manual_seed(2))
    got, _ = _run(kernel, q, k, mask, True)
    P = _weights(q, k, mask, True, torch.ones(1, 40, dtype=torch.bool)).double()
    i = torch.arange(40)
    dij = i[None, :] - i[:, None]
    torch.testing.assert_close(got["signed"].double(), (P * dij).sum(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["dist"].double(), (P * dij.abs()).sum(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["beyond_16"].double(), (P * (dij.abs() > 16)).sum(-1), atol=1e-6, rtol=0)
    within = torch.stack([(P * (dij.abs() <= d)).sum(-1) for d in range(40)], -1)
    reach = (within < 0.9 * P.sum(-1, keepdim=True) - 1e-9).sum(-1)
    assert (got["reach"].long() - reach).abs().max() <= 1
    assert float(got["after"].max()) == 0  # causal: no weight after the query


@pytest.mark.slow  # about 13 s a kind on two cores: CI's slow job runs them (default pytest: ~15 min)
@pytest.mark.parametrize("kind", ["sdpa_gqa", "sdpa_causal", "sdpa_float", "sdpa_bool"])
def test_fused_table_equals_the_full_patterns(kernel, kind, monkeypatch):
    torch.manual_seed(7)
    lm = ToyLM(kind, n_kv_heads=2 if kind == "sdpa_gqa" else None).eval()
    ids = torch.randint(0, 12, (2, 45))  # few token ids: many duplicate and induction pairs
    calls = []
    from probe.analysis.focus.backends import triton_fused as fused

    real = fused.read_call
    monkeypatch.setattr(fused, "read_call", lambda *a: calls.append(real(*a)) or calls[-1])
    streamed = probe.head_stats(lm, ids)
    assert calls and all(calls)  # every attention went through the kernel
    full = probe.head_stats(probe.capture(lm, ids), progress=False)
    assert_same(streamed, full)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["kernel", "rowk"])
def test_padded_hf_llama_with_words(path, request, tmp_path):
    """A padded batch (HF's SDPA mask), grouped-query attention, word masses from a tokenizer,
    through the fused kernel and through the block path's row kernel; keep='stats' caches give
    the same table."""
    request.getfixturevalue(path)
    bpe = H.bpe_tokenizer(tmp_path / "bpe")
    model = H.llama(len(bpe))
    streamed = probe.head_stats(model, TEXTS, tokenizer=bpe)
    full = probe.head_stats(probe.capture(model, TEXTS, tokenizer=bpe), progress=False)
    assert_same(streamed, full)
    cache = probe.capture(model, TEXTS, tokenizer=bpe, keep="stats")
    assert_same(probe.head_stats(cache), full)


def test_fused_can_be_turned_off(kernel, monkeypatch):
    from probe.analysis.focus.backends import triton_fused as fused

    monkeypatch.setenv("PROBE_FUSED", "0")
    assert not fused.enabled(torch.device("cpu"))
    monkeypatch.delenv("PROBE_FUSED")
    assert not fused.enabled(torch.device("cpu"))  # off unless asked for
    monkeypatch.setenv("PROBE_FUSED", "1")
    assert fused.enabled(torch.device("cpu"))


@pytest.fixture
def rowk(monkeypatch):
    """The block path's row kernel (probe/analysis/focus/backends/kernels/rowkernel.py) compiled for Triton's
    interpreter and allowed on CPU blocks, so the streamed statistics take the GPU's path here
    (blocks computed whole, as on a GPU, not part by part in the CPU's row loop)."""
    from probe.analysis.focus.backends.kernels import rowkernel
    from probe.analysis.focus.streamed import reader as streaming

    if torch.cuda.is_available():
        pytest.skip("these run the interpreter on CPU tensors; tests/test_cuda.py runs the kernel on the GPU")
    importlib.reload(rowkernel)
    if type(rowkernel._row_terms).__name__ != "InterpretedFunction":
        pytest.skip("Triton was imported without TRITON_INTERPRET=1 (run this file on its own)")
    rowkernel.CPU = True
    monkeypatch.setattr(streaming.RowTerms, "fills", lambda self, device: False)
    monkeypatch.setenv("PROBE_FUSED", "0")  # the block path (the fused kernel's fixture may be on)
    try:
        yield rowkernel
    finally:
        rowkernel.CPU = False


def test_row_kernel_words_and_after(rowk):
    """The row kernel's word masses and largest weight after the query (the causal audit) against
    running sums and a maximum written here, and its span against the sort written in the test."""
    g = torch.Generator().manual_seed(3)
    B, Hh, q0, r, kend, K = 2, 2, 10, 6, 40, 50
    P = torch.softmax(torch.randn(B, Hh, r, kend, generator=g) * 2, -1)
    i = torch.arange(q0, q0 + r)
    P[0, 0] *= torch.arange(kend)[None, :] <= i[:, None]  # causal rows: nothing after the query
    P[1, 1, 2] = 0  # a row with no weight
    s = torch.randint(0, kend + 8, (B, K, 3), generator=g)  # word starts, some past the block's keys
    e = s + torch.randint(0, 5, (B, K, 3), generator=g)
    s[0, q0, 0], e[0, q0 + 1, 1], s[1, q0 + 2] = 0, -1, 0  # from the first key; no word (e < 0)
    words = {n: (s[..., t], e[..., t]) for t, n in enumerate(rowk.WORDS)}
    ends = rowk.word_ends(words)[:, q0 : q0 + r]
    first = torch.tensor([3, kend + 4])  # the second text's first real key is past this block
    got = rowk.row_terms(P, q0, K, ends, first=first)
    C = P.double().cumsum(-1)

    def upto(j):  # C at key j, clamped to the block as word_masses clamps it
        return C.gather(-1, j.clamp(0, kend - 1)[:, None, :, None].expand(B, Hh, r, 1))[..., 0]

    for t, n in enumerate(rowk.WORDS):
        st, en = s[:, q0 : q0 + r, t], e[:, q0 : q0 + r, t]
        want = torch.where((st > 0)[:, None], upto(en) - upto(st - 1), upto(en))
        torch.testing.assert_close(got[n].double(), want, atol=1e-6, rtol=0)
    after = (P * (torch.arange(kend)[None, :] > i[:, None])).amax(-1)
    assert torch.equal(got["after"], after)
    assert float(got["after"][0, 0].max()) == 0
    for d in range(-2, 3):  # a_i,i+d, 0 where that key is missing (row 0's query 10 sees 11 keys)
        k = i + d
        want = torch.where((k >= 0) & (k < kend), P[..., torch.arange(r), k.clamp(0, kend - 1)], 0)
        assert torch.equal(got[f"diag_{d}"], want), d
    assert torch.equal(got["first"][0], P[0, ..., 3]) and float(got["first"][1].abs().max()) == 0
    assert torch.equal(got["span"].long(), sorted_terms(P)["span"])
    assert rowk.row_terms(-P, q0, K, ends) is None  # a negative weight: the caller sorts instead
    assert rowk.row_terms(-P, q0, K, ends, check=False) is not None  # the caller vouched for the signs


@pytest.mark.slow  # about 50 s on two cores: CI's slow job runs it (the default pytest keeps to ~15 min)
@pytest.mark.parametrize("kind", ["sdpa_causal", "F.softmax", "sdpa_bool"])
def test_row_kernel_table_equals_the_full_patterns(rowk, kind, monkeypatch):
    """The streamed statistics through the row kernel, as on a GPU (the causal audit kept on the
    device and read once per attention; SDPA blocks not read back for negative weights), against
    the whole-pattern statistics."""
    from probe.analysis.focus.backends import numba_rows

    torch.manual_seed(7)
    lm = ToyLM(kind).eval()
    ids = torch.randint(0, 12, (2, 24))  # few token ids: duplicate and induction pairs
    launched, checked = [], []
    launch, row_terms = rowk.launch, rowk.row_terms
    monkeypatch.setattr(rowk, "launch", lambda *a, **k: launched.append(1) or launch(*a, **k))
    monkeypatch.setattr(rowk, "row_terms", lambda *a, **k: checked.append(k["check"]) or row_terms(*a, **k))
    monkeypatch.setattr(numba_rows.RowLoop, "loop_terms", lambda *a, **k: pytest.fail("the CPU loop ran"))
    streamed = probe.head_stats(lm, ids)
    assert launched  # every block through the kernel; only the model's own weights read back
    assert checked == ([True] * len(launched) if kind == "F.softmax" else [])
    full = probe.head_stats(probe.capture(lm, ids), progress=False)
    assert_same(streamed, full)
    assert [r["causal"] for r in streamed.table] == [r["causal"] for r in full.table]


@pytest.mark.slow  # an end-to-end run in Triton's interpreter (about 30 s); CI's slow job runs it
def test_row_kernel_seq2seq_with_terms_copied_as_off_a_gpu(rowk, monkeypatch, tmp_path):
    """An encoder-decoder whose source and target have the same length (each self-attention is
    read for both stacks until the forward names it), padded, with the terms copied each time
    they move, as bringing them back from a GPU does (on a CPU .to("cpu") returns the same
    tensors): the kernel's table must be spread into the terms before they are read."""
    import copy

    from probe.analysis.focus.definitions.terms import Terms

    to = Terms.to
    monkeypatch.setattr(Terms, "to", lambda self, device: copy.deepcopy(to(self, device)))
    bpe = H.bpe_tokenizer(tmp_path / "bpe")
    model = H.bart(len(bpe))
    texts = ["attention reads.", "the model is reading"]
    streamed = probe.head_stats(model, texts, tokenizer=bpe, target=texts)
    full = probe.head_stats(probe.capture(model, texts, tokenizer=bpe, target=texts), progress=False)
    assert_same(streamed, full)
