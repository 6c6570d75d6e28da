"""probe.generate and probe.trace(steps=True): a generation captured step by step through the KV cache.

Oracles, each independent of the stepped capture: the model's eager ``generate(output_attentions=True,
return_dict_in_generate=True)`` on a twin with the same weights, its ragged per-step tuples
reassembled here into one causal pattern; a capture (or probe.trace) of the whole final sequence
in one forward; ``torch.topk`` on those weights; an argmax loop written here for the zoo model.
"""

from __future__ import annotations

import hf_fixtures as H
import pytest
import torch
from generation_caches import llava_pair

import models
import probe
from probe.errors import ProbeError

ATOL = 1e-5
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
N = 6


def reassemble(steps, T: int) -> torch.Tensor:
    """Eager generate's attentions of one layer, one ``[B, H, q, K]`` per step, placed in
    ``[B, H, T, T]``: a step's q rows end at the positions read so far; its K keys are the last K
    of them (a sliding-window cache keeps fewer than all)."""
    B, Hh = steps[0].shape[:2]
    out = torch.zeros(B, Hh, T, T)
    end = 0
    for a in steps:
        q, K = a.shape[2], a.shape[3]
        end += q
        out[:, :, end - q : end, end - K : end] = a
    return out


def eager_decoder_only(model, n=N, prompt=PROMPT):
    twin = H.eager_twin(model)
    with torch.no_grad():
        out = twin.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_attentions=True,
            return_dict_in_generate=True,
        )
    T = out.sequences.size(1) - 1
    layers = len(out.attentions[0])
    return out.sequences, [reassemble([step[i] for step in out.attentions], T) for i in range(layers)]


def whole_sequence(model, ids):
    """probe.trace of one forward over the whole sequence the generation read."""
    with torch.no_grad(), probe.trace(model) as t:
        model(input_ids=ids, use_cache=False)
    return t.cache


@pytest.mark.parametrize("build", [H.gpt2, H.llama, H.mistral], ids=["gpt2", "llama-gqa", "mistral-window"])
def test_generated_rows_match_eager_generate_and_one_forward(build):
    model = build(100)
    g = probe.generate(model, PROMPT, max_new_tokens=N, min_new_tokens=N)
    seq, eager = eager_decoder_only(model)
    assert torch.equal(g.ids, seq)
    T = PROMPT.size(1) + N - 1
    full = whole_sequence(model, seq[:, :-1])
    for layer, want in enumerate(eager):
        got = g.cache.pattern("decoder", layer)
        assert got.shape == (1, want.shape[1], T, T)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        torch.testing.assert_close(got, full.pattern("decoder", layer), atol=ATOL, rtol=0)
        for name in ("resid_pre", "resid_post"):
            torch.testing.assert_close(
                g.cache[f"decoder.blocks.{layer}.{name}"],
                full[f"decoder.blocks.{layer}.{name}"],
                atol=ATOL,
                rtol=0,
            )


def test_mistral_steps_ran_past_the_window():
    # the oracle's own steps show the sliding cache: keys fewer than the positions read
    model = H.mistral(100)
    twin = H.eager_twin(model)
    with torch.no_grad():
        out = twin.generate(
            input_ids=PROMPT,
            max_new_tokens=3,
            min_new_tokens=3,
            output_attentions=True,
            return_dict_in_generate=True,
        )
    assert out.attentions[-1][0].shape[-1] < PROMPT.size(1) + 2
    g = probe.generate(model, PROMPT, max_new_tokens=3, min_new_tokens=3)
    p = g.cache.pattern("decoder", 0)[0, :, -1]
    assert (p[:, : PROMPT.size(1) + 2 - model.config.sliding_window] == 0).all() and (
        p.sum(-1) - 1
    ).abs().max() < 1e-5


@pytest.mark.parametrize("build", [H.bart, H.t5], ids=["bart", "t5"])
def test_encoder_decoder_cross_attention_per_step(build):
    model = build(100)
    g = probe.generate(model, PROMPT, max_new_tokens=N, min_new_tokens=N)
    twin = H.eager_twin(model)
    with torch.no_grad():
        out = twin.generate(
            input_ids=PROMPT,
            max_new_tokens=N,
            min_new_tokens=N,
            output_attentions=True,
            return_dict_in_generate=True,
        )
    assert torch.equal(g.new_ids, out.sequences[:, 1:])
    T = out.sequences.size(1) - 1
    S = PROMPT.size(1)
    for layer in range(len(out.decoder_attentions[0])):
        self_want = reassemble([s[layer] for s in out.decoder_attentions], T)
        cross_want = torch.cat([s[layer] for s in out.cross_attentions], 2)
        torch.testing.assert_close(g.cache.pattern("decoder", layer), self_want, atol=ATOL, rtol=0)
        torch.testing.assert_close(g.cache.pattern("decoder", layer, "cross"), cross_want, atol=ATOL, rtol=0)
        assert cross_want.shape[-2:] == (T, S)
    for layer, want in enumerate(out.encoder_attentions):
        torch.testing.assert_close(g.cache.pattern("encoder", layer), want, atol=ATOL, rtol=0)
    with torch.no_grad(), probe.trace(model) as t:  # the whole decoder sequence in one forward
        model(input_ids=PROMPT, decoder_input_ids=out.sequences[:, :-1], use_cache=False)
    for layer in range(len(out.decoder_attentions[0])):
        torch.testing.assert_close(
            g.cache.pattern("decoder", layer, "cross"),
            t.cache.pattern("decoder", layer, "cross"),
            atol=ATOL,
            rtol=0,
        )
    assert g.cache.metadata["generation"]["prompt_length"] == 1


def test_zoo_minigpt_greedy_loop():
    model = models.load("minigpt")
    g = probe.generate(model, "attention lets", max_new_tokens=8)
    ids = torch.tensor([model.tokenizer.encode("attention lets")])
    with torch.no_grad():  # the greedy loop, written here
        for _ in range(8):
            ids = torch.cat([ids, model(ids)[0][:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(g.ids, ids)
    assert g.text == model.tokenizer.decode(ids[0, 14:].tolist())
    full = probe.capture(model, ids[:, :-1])
    for layer in range(2):
        torch.testing.assert_close(
            g.cache.pattern("decoder", layer), full.pattern("decoder", layer), atol=ATOL, rtol=0
        )
    meta = g.cache.metadata
    assert meta["generation"]["new_tokens"] == 8 and meta["generation"]["prompt_length"] == 14
    kinds = meta["stacks"]["decoder"]["positions"]["kinds"]
    assert kinds == ["prompt"] * 14 + ["generated"] * 7


@pytest.mark.slow
def test_zoo_translator_untrained_loop():
    model = models.module("translator").build().eval()
    src = "ich mochte ein bier"
    g = probe.generate(model, src, max_new_tokens=5)
    enc = torch.tensor([model.tokenizer.encode(src)])
    dec = g.cache.metadata["target_ids"]
    with torch.no_grad():
        _, enc_attn, dec_attn, cross_attn = model(enc, torch.tensor(dec))  # its own returned weights
    for layer in range(len(dec_attn)):
        torch.testing.assert_close(g.cache.pattern("decoder", layer), dec_attn[layer], atol=ATOL, rtol=0)
        torch.testing.assert_close(
            g.cache.pattern("decoder", layer, "cross"), cross_attn[layer], atol=ATOL, rtol=0
        )
        torch.testing.assert_close(g.cache.pattern("encoder", layer), enc_attn[layer], atol=ATOL, rtol=0)


def test_keep_rows_and_topk_per_step():
    model = H.llama(100)
    full = probe.generate(model, PROMPT, max_new_tokens=N, min_new_tokens=N)
    rows = probe.generate(model, PROMPT, max_new_tokens=N, min_new_tokens=N, keep="rows")
    top = probe.generate(model, PROMPT, max_new_tokens=N, min_new_tokens=N, keep={"topk": 3})
    T, P = PROMPT.size(1) + N - 1, PROMPT.size(1)
    assert rows.cache.kept == {"rows": list(range(-N, 0))}
    for layer in range(2):
        want = full.cache.pattern("decoder", layer)
        got = rows.cache.rows("decoder", layer)
        assert got.shape == (1, 8, N, T)
        torch.testing.assert_close(got, want[:, :, P - 1 :], atol=ATOL, rtol=0)
        assert rows.cache.row_index("decoder", layer).tolist() == [list(range(P - 1, T))]
        values, indices, mass = top.cache.topk("decoder", layer, batch=0)
        torch.testing.assert_close(values, want[0].topk(3, dim=-1).values, atol=ATOL, rtol=0)
        torch.testing.assert_close(want[0].gather(-1, indices.long()), values, atol=ATOL, rtol=0)
        torch.testing.assert_close(mass, values.sum(-1), atol=ATOL, rtol=0)
    assert not any(k.endswith(".pattern") for k in rows.cache.keys() + top.cache.keys())


@pytest.mark.slow
def test_keep_rows_past_the_window_and_with_cross_attention():
    model = H.mistral(100)
    full = probe.generate(model, PROMPT, max_new_tokens=N, min_new_tokens=N)
    rows = probe.generate(model, PROMPT, max_new_tokens=N, min_new_tokens=N, keep="rows")
    P = PROMPT.size(1)
    torch.testing.assert_close(
        rows.cache.rows("decoder", 1), full.cache.pattern("decoder", 1)[:, :, P - 1 :], atol=ATOL, rtol=0
    )
    bart = H.bart(100)
    full = probe.generate(bart, PROMPT, max_new_tokens=N, min_new_tokens=N)
    rows = probe.generate(bart, PROMPT, max_new_tokens=N, min_new_tokens=N, keep="rows")
    torch.testing.assert_close(
        rows.cache.rows("decoder", 0, "cross"), full.cache.pattern("decoder", 0, "cross"), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize(
    "build, kwargs",
    [
        (H.llama, {"cache_implementation": "static"}),
        (H.mistral, {"cache_implementation": "static"}),  # a static sliding window, past it
        (H.gpt2, {"use_cache": False}),  # every step re-reads the whole sequence
    ],
    ids=["llama-static", "mistral-static-window", "gpt2-no-cache"],
)
def test_other_caches(build, kwargs):
    model = build(100)
    full = probe.generate(model, PROMPT, max_new_tokens=N, min_new_tokens=N)
    other = probe.generate(model, PROMPT, max_new_tokens=N, min_new_tokens=N, **kwargs)
    assert torch.equal(full.ids, other.ids)
    torch.testing.assert_close(
        other.cache.pattern("decoder", 1), full.cache.pattern("decoder", 1), atol=ATOL, rtol=0
    )


def test_trace_steps_records_a_loop_written_by_hand(tmp_path):
    model = H.gpt2(100)
    ids = PROMPT
    with torch.no_grad(), probe.trace(model, steps=True) as t:
        out = model(input_ids=ids, use_cache=True)
        past = out.past_key_values
        for _ in range(3):
            nxt = out.logits[:, -1:].argmax(-1)
            ids = torch.cat([ids, nxt], 1)
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
    assert t.steps == 4
    full = whole_sequence(model, ids)
    torch.testing.assert_close(t.cache.pattern("decoder", 2), full.pattern("decoder", 2), atol=ATOL, rtol=0)
    with pytest.raises(ProbeError, match="forward passes inside probe.trace"):
        with torch.no_grad(), probe.trace(model):
            model(input_ids=PROMPT)
            model(input_ids=PROMPT)
    with pytest.raises(ProbeError, match="read already"):
        with torch.no_grad(), probe.trace(model, steps=True):
            model(input_ids=PROMPT)
            model(input_ids=PROMPT)


def test_generation_saves_and_loads(tmp_path):
    model = H.gpt2(100)
    g = probe.generate(model, PROMPT, max_new_tokens=3, min_new_tokens=3)
    g.save(tmp_path / "g.safetensors")
    back = probe.load(tmp_path / "g.safetensors")
    assert back.metadata["generation"] == g.cache.metadata["generation"]
    assert back.metadata["generation"]["output_ids"] == g.new_ids[0].tolist()
    assert "3 new tokens after 8" in repr(g)


def test_sampling_under_a_seed():
    model = H.gpt2(100)
    a = probe.generate(model, PROMPT, max_new_tokens=4, do_sample=True, seed=3)
    b = probe.generate(model, PROMPT, max_new_tokens=4, do_sample=True, seed=3)
    assert torch.equal(a.ids, b.ids) and a.cache.metadata["generation"]["strategy"] == "sample"
    torch.manual_seed(3)
    with torch.no_grad():
        plain = model.generate(
            input_ids=PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=4, do_sample=True
        )
    assert torch.equal(a.ids, plain)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be a positive"),
        ({"max_new_tokens": 3, "num_beams": 2, "num_return_sequences": 2}, "one returned sequence"),
        ({"max_new_tokens": 3, "keep": {"rows": [-1]}}, "last query row"),
        ({"max_new_tokens": 3, "keep": "nope"}, "keep="),
    ],
)
def test_bad_input_is_one_line(kwargs, match):
    with pytest.raises(ProbeError, match=match) as e:
        probe.generate(H.gpt2(100), PROMPT, **kwargs)
    assert "\n" not in str(e.value)


def test_bad_prompts_and_models():
    with pytest.raises(ProbeError, match="one prompt at a time"):
        probe.generate(H.gpt2(100), ["a", "b"], max_new_tokens=2)
    with pytest.raises(ProbeError, match="torch.nn.Module"):
        probe.generate(object(), PROMPT, max_new_tokens=2)
    with pytest.raises(ProbeError, match="reads at most"):
        probe.generate(models.load("minigpt"), "a", max_new_tokens=10_000)
    with pytest.raises(ProbeError, match="no tokenizer"):
        probe.generate(H.gpt2(100), "text", max_new_tokens=2)


@pytest.mark.slow
def test_keep_stats_of_a_generation():
    model = H.llama(100)
    full = probe.generate(model, PROMPT, max_new_tokens=N, min_new_tokens=N)
    stats = probe.generate(model, PROMPT, max_new_tokens=N, min_new_tokens=N, keep="stats")
    assert torch.equal(full.ids, stats.ids) and stats.cache.kept == "stats"
    assert stats.cache.metadata["generation"]["output_ids"] == full.new_ids[0].tolist()
    assert not any(k.endswith((".pattern", ".rows")) for k in stats.cache.keys())
    want, got = probe.head_stats(full.cache), probe.head_stats(stats.cache)
    for metric in ("entropy", "first", "distance", "induction_score"):
        for layer_map in ((got.map(metric), want.map(metric)),):
            torch.testing.assert_close(*layer_map, atol=1e-5, rtol=0)
    with pytest.raises(ProbeError, match="decoder-only"):
        probe.generate(H.bart(100), PROMPT, max_new_tokens=2, keep="stats")


def test_a_model_that_cannot_generate():
    bert, _, _ = H.minilm()
    with pytest.raises(ProbeError, match="logits") as e:
        probe.generate(bert, torch.tensor([[101, 2000, 102]]), max_new_tokens=2)
    assert "\n" not in str(e.value)
    with pytest.raises(ProbeError, match="cannot generate here"):
        probe.generate(torch.nn.Linear(4, 4).eval(), PROMPT, max_new_tokens=2)


@pytest.mark.slow
def test_layers_heads_and_keep_across_encoder_decoders():
    model = H.llama(100)
    full = probe.generate(model, PROMPT, max_new_tokens=4, min_new_tokens=4)
    some = probe.generate(model, PROMPT, max_new_tokens=4, min_new_tokens=4, layers=[1], heads=[0, 5])
    assert not any(k.startswith("decoder.blocks.0.") for k in some.cache.keys())
    want = full.cache.pattern("decoder", 1)[:, [0, 5]]
    torch.testing.assert_close(some.cache["decoder.blocks.1.self_attn.pattern"], want, atol=ATOL, rtol=0)
    for build in (H.t5, H.marian):
        m = build(100)
        full = probe.generate(m, PROMPT, max_new_tokens=4, min_new_tokens=4)
        top = probe.generate(m, PROMPT, max_new_tokens=4, min_new_tokens=4, keep={"topk": 2})
        for kind in ("self", "cross"):
            values, indices, _ = top.cache.topk("decoder", 1, kind, batch=0)
            w = full.cache.pattern("decoder", 1, kind)[0]
            torch.testing.assert_close(values, w.topk(2, dim=-1).values, atol=ATOL, rtol=0)
            torch.testing.assert_close(w.gather(-1, indices.long()), values, atol=ATOL, rtol=0)
    with pytest.raises(ProbeError, match="probe.generate"):
        probe.trace(model, steps=True, keep="stats")


@pytest.mark.slow
def test_vision_language_generation_reads_its_picture():
    model, eager, inputs = llava_pair()
    pixels = inputs["pixel_values"]
    g = probe.generate(model, inputs, max_new_tokens=4, min_new_tokens=4)
    with torch.no_grad():
        out = eager.generate(
            **inputs, max_new_tokens=4, min_new_tokens=4, output_attentions=True, return_dict_in_generate=True
        )
        tower = eager.model.vision_tower(pixels, output_attentions=True).attentions
    assert torch.equal(g.ids, out.sequences)
    T = out.sequences.size(1) - 1
    for layer in range(2):
        want = reassemble([s[layer] for s in out.attentions], T)
        torch.testing.assert_close(g.cache.pattern("decoder", layer), want, atol=ATOL, rtol=0)
        torch.testing.assert_close(
            g.cache.pattern("model.vision_tower.encoder.layers", layer), tower[layer], atol=ATOL, rtol=0
        )
    kinds = g.cache.metadata["stacks"]["decoder"]["positions"]["rows"][0]["kinds"]
    assert kinds[:3] == ["text", "text", "image"] and kinds.count("image") == 16 and len(kinds) == T


@pytest.mark.parametrize("build", [H.gpt2, H.bart], ids=["gpt2", "bart"])
def test_beam_search_follows_the_returned_beam(build):
    model = build(100)
    kw = {"max_new_tokens": N, "min_new_tokens": N, "num_beams": 3}
    with torch.no_grad():  # the plain beam search: its sequence, and beams that really switch
        plain = model.generate(input_ids=PROMPT, return_dict_in_generate=True, **kw)
    assert bool((plain.beam_indices[0, 1:] > 0).any())
    g = probe.generate(model, PROMPT, **kw)
    rows = probe.generate(model, PROMPT, keep="rows", **kw)
    assert g.cache.metadata["generation"]["strategy"] == "beam"
    enc_dec = model.config.is_encoder_decoder
    read = plain.sequences[:, :-1]
    with torch.no_grad(), probe.trace(model) as t:  # the returned sequence in one forward
        if enc_dec:
            model(input_ids=PROMPT, decoder_input_ids=read, use_cache=False)
        else:
            model(input_ids=read, use_cache=False)
    assert torch.equal(g.new_ids, plain.sequences[:, -N:])
    P = 1 if enc_dec else PROMPT.size(1)
    for layer in range(2):
        want = t.cache.pattern("decoder", layer)
        torch.testing.assert_close(g.cache.pattern("decoder", layer), want, atol=ATOL, rtol=0)
        torch.testing.assert_close(rows.cache.rows("decoder", layer), want[:, :, P - 1 :], atol=ATOL, rtol=0)
        for name in ("resid_post", "self_attn.delta"):
            key = f"decoder.blocks.{layer}.{name}"
            torch.testing.assert_close(g.cache[key], t.cache[key], atol=ATOL, rtol=0)
        if enc_dec:
            cross = t.cache.pattern("decoder", layer, "cross")
            torch.testing.assert_close(g.cache.pattern("decoder", layer, "cross"), cross, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_beam_search_that_ends_before_its_last_step():
    model = H.llama(100)
    kw = {"max_new_tokens": 6, "num_beams": 3, "eos_token_id": 10}
    with torch.no_grad():
        plain = model.generate(input_ids=PROMPT, return_dict_in_generate=True, **kw)
    g = probe.generate(model, PROMPT, **kw)
    assert g.cache.metadata["steps"]["forwards"] == 6 and plain.sequences.size(1) < PROMPT.size(1) + 6
    assert torch.equal(g.ids, plain.sequences)
    full = whole_sequence(model, plain.sequences[:, :-1])
    torch.testing.assert_close(g.cache.pattern("decoder", 1), full.pattern("decoder", 1), atol=ATOL, rtol=0)


def test_a_long_generation_hands_freed_heap_back_every_few_steps(monkeypatch):
    """Whole patterns keep each step's rows, a little larger than the last: glibc cannot reuse the
    freed blocks, so the stepped capture trims the heap every TRIM_EVERY steps. Rows and top-k
    grow one buffer per key instead and are never trimmed (benchmarks/generation.py measures the
    resident memory: at 2,048 + 2,048 tokens `keep="rows"` peaks at its result)."""
    from probe.cache.perf import heap
    from probe.capture.engine import steps

    calls = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(1) or True)
    g = probe.generate(models.load("minigpt"), "attention lets", max_new_tokens=18)
    forwards = g.cache.metadata["steps"]["forwards"]
    assert forwards >= steps.TRIM_EVERY and len(calls) == forwards // steps.TRIM_EVERY
    # rows and top-k grow one buffer per key (no block a step left in the heap): never trimmed
    calls.clear()
    for keep in ("rows", {"topk": 3}):
        probe.generate(models.load("minigpt"), "attention lets", max_new_tokens=18, keep=keep)
    assert calls == []
