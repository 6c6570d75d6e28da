"""Lean decode steps (probe/capture/engine/lean.py): after the first decode step, captured whole,
the steps of a generation are captured by a plan learnt from it. They must hold what the full
capture holds.

Oracles, independent of the stepped capture: the model's eager ``generate(output_attentions=True)``
on a twin with the same weights (its per-step rows), a probe.trace of the whole final sequence in
one forward (its residuals), ``torch.topk`` of those rows, and the weights written here from the
call's own q and K (``decode_row`` against softmax(q kᵀ / sqrt(d)) with the mask applied by hand).
"""

from __future__ import annotations

import importlib

import hf_fixtures as H
import pytest
import torch
from test_generate import eager_decoder_only, whole_sequence

import probe
from probe.capture.engine.lean import decode_row
from probe.errors import ProbeError

ATOL = 1e-5
# transformers' append-only cache layer, whose rows wait (engine/deferred.py); without it none do
APPENDS = getattr(importlib.import_module("transformers.cache_utils"), "DynamicLayer", None) is not None
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
N = 10


@pytest.mark.parametrize("build", [H.llama, H.gpt2, H.mistral], ids=["llama-gqa", "gpt2", "mistral-window"])
def test_lean_steps_hold_the_rows_and_residuals_of_the_full_capture(build):
    model = build(100)
    seq, eager = eager_decoder_only(model, N)
    full = whole_sequence(model, seq[:, :-1])
    P = PROMPT.size(1)
    kinds = {"rows": "rows", "topk": {"topk": 3}, "patterns": None}
    got = {
        k: probe.generate(model, PROMPT, keep=v, max_new_tokens=N, min_new_tokens=N) for k, v in kinds.items()
    }
    for g in got.values():
        assert torch.equal(g.ids, seq)
        assert g.cache.metadata["steps"]["lean"] == N - 2  # the prefill and the first decode step are whole
        # rows over transformers' append-only DynamicLayer wait and are computed together (not a
        # sliding window's, whose keys move): the same rows, checked below against eager
        layers = len(eager)
        window = build is H.mistral
        deferred = 0 if window or not APPENDS else (N - 2) * layers
        assert g.cache.metadata["steps"]["deferred"] == deferred
    for layer, want in enumerate(eager):
        rows = got["rows"].cache.rows("decoder", layer)
        torch.testing.assert_close(rows, want[:, :, P - 1 :], atol=ATOL, rtol=0)
        torch.testing.assert_close(got["patterns"].cache.pattern("decoder", layer), want, atol=ATOL, rtol=0)
        values = got["topk"].cache[f"decoder.blocks.{layer}.self_attn.topk_values"]
        torch.testing.assert_close(values, want.topk(3, dim=-1).values, atol=ATOL, rtol=0)
        for name in ("resid_pre", "self_attn.delta", "mlp.delta", "resid_post"):
            key = f"decoder.blocks.{layer}.{name}"
            for g in got.values():
                torch.testing.assert_close(g.cache[key], full[key], atol=ATOL, rtol=0)


def test_top_k_over_fewer_keys_than_k_while_rows_wait():
    # k = 12 over a prompt of 8: the first steps read fewer than 12 keys, waiting rows included
    model = H.llama(100)
    seq, eager = eager_decoder_only(model, N)
    g = probe.generate(model, PROMPT, keep={"topk": 12}, max_new_tokens=N, min_new_tokens=N)
    assert g.cache.metadata["steps"]["deferred"] == ((N - 2) * len(eager) if APPENDS else 0)
    for layer, want in enumerate(eager):
        values = g.cache[f"decoder.blocks.{layer}.self_attn.topk_values"]
        indices = g.cache[f"decoder.blocks.{layer}.self_attn.topk_indices"].long()
        torch.testing.assert_close(values, want.topk(12, dim=-1).values, atol=ATOL, rtol=0)
        torch.testing.assert_close(want.gather(-1, indices), values, atol=ATOL, rtol=0)


def test_lean_steps_cut_heads_and_store_the_dtype_asked():
    model = H.llama(100)
    seq, eager = eager_decoder_only(model, N)
    g = probe.generate(
        model, PROMPT, keep="rows", heads=[1, 6], dtype="bfloat16", max_new_tokens=N, min_new_tokens=N
    )
    assert g.cache.metadata["steps"]["lean"] == N - 2
    P = PROMPT.size(1)
    for layer, want in enumerate(eager):
        rows = g.cache.rows("decoder", layer)
        assert rows.dtype == torch.bfloat16 and rows.shape[1] == 2
        torch.testing.assert_close(rows.float(), want[:, [1, 6], P - 1 :], atol=1e-2, rtol=0)
        resid = g.cache[f"decoder.blocks.{layer}.resid_post"]
        assert resid.dtype == torch.bfloat16


def test_a_model_without_sdpa_stays_on_full_steps():
    model = H.eager_twin(H.llama(100))  # eager attention: its own softmax, no SDPA call to read
    seq, eager = eager_decoder_only(model, 5)
    g = probe.generate(model, PROMPT, keep="rows", max_new_tokens=5, min_new_tokens=5)
    assert g.cache.metadata["steps"]["lean"] == 0
    torch.testing.assert_close(
        g.cache.rows("decoder", 1), eager[1][:, :, PROMPT.size(1) - 1 :], atol=ATOL, rtol=0
    )


def test_a_decode_step_that_runs_other_layers_is_refused():
    import transformers

    model = H.llama(100)
    layers = model.model.layers
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad(), probe.trace(model, steps=True, keep="rows"):
        out = model(input_ids=PROMPT, past_key_values=cache, use_cache=True)
        for step in range(3):
            nxt = out.logits[:, -1:].argmax(-1)
            if step == 2:  # a layer dropped from the third decode step on
                model.model.layers = layers[:1]
            try:
                with pytest.raises(ProbeError, match="ran differently from the first"):
                    out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                    if step < 2:
                        raise ProbeError("ran differently from the first (not really: a pass)")
            finally:
                model.model.layers = layers


def test_a_lean_step_whose_kept_tensor_is_overwritten_in_place_is_refused():
    # a lean step keeps the model's own residual tensors until the step ends (no copy): one
    # overwritten in place after it was recorded would be stored wrong, so the step is refused
    model = H.llama(100)
    calls = []

    def overwrite(module, args, kwargs):
        calls.append(1)
        if len(calls) == 4:  # layer 1's input (layer 0's output) in the third decode step, a lean one
            (args[0] if args else kwargs["hidden_states"]).mul_(1.0)

    h = model.model.layers[1].register_forward_pre_hook(overwrite, with_kwargs=True)
    try:
        with pytest.raises(ProbeError, match="overwrote a layer's input or output in place"):
            probe.generate(model, PROMPT, keep="rows", max_new_tokens=N, min_new_tokens=N)
    finally:
        h.remove()
    assert len(calls) == 4


def _written_row(q, k, mask, scale):
    """softmax(q kᵀ · scale + mask) by hand, each key head repeated for its group of query heads."""
    g = q.size(1) // k.size(1)
    k = k.repeat_interleave(g, dim=1)
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return torch.softmax(s, -1).nan_to_num(0.0).float()


@pytest.mark.parametrize("mask", ["none", "bool", "float", "all-masked"])
def test_decode_row_is_sdpas_weights(mask):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 6, 1, 8, generator=gen), torch.randn(2, 3, 11, 8, generator=gen)
    m = None
    if mask == "bool":
        m = torch.rand(2, 1, 1, 11, generator=gen) > 0.3
    elif mask == "float":
        m = torch.randn(2, 6, 1, 11, generator=gen)
    elif mask == "all-masked":
        m = torch.zeros(2, 1, 1, 11, dtype=torch.bool)
        m[0, ..., :4] = True
    got = decode_row(q, k, m, False, None)
    torch.testing.assert_close(got, _written_row(q, k, m, 8**-0.5), atol=1e-6, rtol=0)
    if mask == "all-masked":
        assert bool((got[1] == 0).all())
    causal = decode_row(q, k, None, True, 0.5)  # SDPA's is_causal is top-left: query 0 reads key 0
    assert bool((causal[..., 0] == 1).all()) and bool((causal[..., 1:] == 0).all())
    assert decode_row(q.expand(2, 6, 2, 8), k, None, False, None) is None  # two queries: not a decode step
    mf = m.reshape(2, 3, 2, 11) if m is not None and m.size(1) == 6 else m
    folded = decode_row(q.reshape(2, 3, 2, 8), k, mf, False, None, fold=True)  # transformers' GQA layout
    torch.testing.assert_close(folded, got, atol=1e-6, rtol=0)


def test_an_error_inside_a_lean_step_goes_on_and_leaves_no_mode_behind():
    model = H.llama(100)
    attn = model.model.layers[1].self_attn
    calls = {"n": 0}

    def fail_on_fifth(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] == 5:  # the prefill, the first decode step, then lean steps
            raise RuntimeError("a planted failure")

    handle = attn.register_forward_pre_hook(fail_on_fifth, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="a planted failure"):
            probe.generate(model, PROMPT, keep="rows", max_new_tokens=N, min_new_tokens=N)
    finally:
        handle.remove()
    assert torch._C._len_torch_function_stack() == 0
    g = probe.generate(model, PROMPT, keep="rows", max_new_tokens=4, min_new_tokens=4)
    assert g.cache.metadata["steps"]["lean"] == 2
