"""Capture on a GPU: outputs bit-identical, patterns equal to HF eager's, buffers on the model's device.

Skipped where CUDA is absent (CI runners without a GPU); runs wherever ``torch.cuda`` works.
"""

from __future__ import annotations

import hf_fixtures as H
import pytest
import torch

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
