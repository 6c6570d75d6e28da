"""The fused statistics kernel (probe/analysis/focus/qkkernel.py: every per-row term from tiles of
q and k, the weights never written), run on the CPU by Triton's interpreter.

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
    from probe.analysis.focus import fused, qkkernel

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


@pytest.mark.parametrize(
    "kind",
    [
        "sdpa_gqa",
        *(pytest.param(k, marks=pytest.mark.slow) for k in ("sdpa_causal", "sdpa_float", "sdpa_bool")),
    ],
)
def test_fused_table_equals_the_full_patterns(kernel, kind, monkeypatch):
    torch.manual_seed(7)
    lm = ToyLM(kind, n_kv_heads=2 if kind == "sdpa_gqa" else None).eval()
    ids = torch.randint(0, 12, (2, 45))  # few token ids: many duplicate and induction pairs
    calls = []
    from probe.analysis.focus import fused

    real = fused.read_call
    monkeypatch.setattr(fused, "read_call", lambda *a: calls.append(real(*a)) or calls[-1])
    streamed = probe.head_stats(lm, ids)
    assert calls and all(calls)  # every attention went through the kernel
    full = probe.head_stats(probe.capture(lm, ids), progress=False)
    assert_same(streamed, full)


@pytest.mark.slow
def test_fused_padded_hf_llama_with_words(kernel, tmp_path):
    """A padded batch (HF's SDPA mask), grouped-query attention, word masses from a tokenizer;
    keep='stats' caches give the same table."""
    bpe = H.bpe_tokenizer(tmp_path / "bpe")
    model = H.llama(len(bpe))
    streamed = probe.head_stats(model, TEXTS, tokenizer=bpe)
    full = probe.head_stats(probe.capture(model, TEXTS, tokenizer=bpe), progress=False)
    assert_same(streamed, full)
    cache = probe.capture(model, TEXTS, tokenizer=bpe, keep="stats")
    assert_same(probe.head_stats(cache), full)


def test_fused_can_be_turned_off(kernel, monkeypatch):
    from probe.analysis.focus import fused

    monkeypatch.setenv("PROBE_FUSED", "0")
    assert not fused.enabled(torch.device("cpu"))
    monkeypatch.delenv("PROBE_FUSED")
    assert not fused.enabled(torch.device("cpu"))  # off unless asked for
    monkeypatch.setenv("PROBE_FUSED", "1")
    assert fused.enabled(torch.device("cpu"))
