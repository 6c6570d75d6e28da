"""The causal audit of a model whose weights hold NaN: each functional check says it cannot run
(the model's outputs are NaN), in one line, in the audit and in the report, never a traceback or
a 'pass' read from NaN compared with NaN.

Oracle: the NaN the tests write into the weights, and the model's own outputs on the text.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import probe
from probe.report.context import ReportContext
from probe.report.html import discover, render

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
IDS = torch.tensor([[1, 5, 7, 9, 11, 13, 17, 19]])
COMPARED = ("suffix", "gradient")  # the checks that compare the model's outputs on the text


def tiny_llama():
    cfg = tf.LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).eval()


def _skipped(report) -> dict[str, str]:
    return {c["check"]: c["detail"] for c in report.checks if c["status"] == "skipped"}


def test_all_nan_weights_cannot_be_checked_and_say_so():
    model = tiny_llama()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
        assert torch.isnan(model(IDS).logits).all()  # the premise
    cache = probe.capture(model, IDS)
    report = probe.check_causal(model, cache)
    skipped = _skipped(report)
    assert set(COMPARED) <= set(skipped)
    assert all(
        skipped[c]
        == "the model's outputs are NaN/inf on the text itself (NaN/inf weights, or a fully masked row)"
        for c in COMPARED
    )
    assert "pass" not in {c["status"] for c in report.checks if c["check"] in COMPARED}
    line = str(report).splitlines()[0]
    assert "suffix, gradient not run: the model's outputs are NaN/inf on the text itself" in line
    # the report shows the same one line, and is written
    text = render(
        ReportContext(caches=[cache], model=model), [s for s in discover() if s.name in ("summary", "causal")]
    )
    assert "not run: the model&#39;s outputs are NaN/inf on the text itself" in text
    assert "Traceback" not in text and "could not be built" not in text


def test_nan_weights_of_unused_tokens_do_not_crash_the_suffix_check():
    """The text's own outputs are finite; the random suffixes draw tokens whose embeddings are
    NaN, and a NaN reaches earlier positions through a zero attention weight (0 x NaN): the check
    cannot tell a leak from that (it crashed with an IndexError)."""
    model = tiny_llama()
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        keep = emb[IDS[0]].clone()
        emb.fill_(float("nan"))
        emb[IDS[0]] = keep
        assert torch.isfinite(model(IDS).logits).all()  # the premise
    cache = probe.capture(model, IDS)
    report = probe.check_causal(model, cache)
    why = _skipped(report)["suffix"]
    assert (
        why.startswith("the model's outputs are NaN/inf on ")
        and "copies of the text with a random suffix" in why
    )
    assert _skipped(report)["gradient"] == why
    assert not [f for f in report.findings if f.check in COMPARED]  # nothing is claimed from NaN
