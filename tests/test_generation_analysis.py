"""probe.lookback on generation caches: the lookback ratio, the masses and the prompt tokens read
most, against loops written here over minigpt's own attention weights (its heads return them)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from generation_caches import aligner_generation, llava_pair, minigpt_generation, minigpt_weights

import models
import probe


@pytest.fixture(scope="module")
def gpt():
    return models.load("minigpt")


@pytest.fixture(scope="module")
def full(gpt):
    cache, ids, new = minigpt_generation(gpt)
    return cache, ids, new, minigpt_weights(gpt, ids + new[:-1])


def _oracle(weights, P: int, N: int, sink: int = 1):
    """Loops over the weights: per layer, head and step the ratio and masses (Chuang et al. Eq. 1)."""
    L, H = len(weights), weights[0].shape[0]
    out = {
        k: torch.full((L, H, N), math.nan, dtype=torch.float64) for k in ("ratio", "prompt", "output", "sink")
    }
    for li, w in enumerate(weights):
        for h in range(H):
            for t in range(N):
                row = w[h, P - 1 + t]
                out["prompt"][li, h, t] = sum(float(row[j]) for j in range(P))
                out["output"][li, h, t] = sum(float(row[j]) for j in range(P, P + t))
                out["sink"][li, h, t] = sum(float(row[j]) for j in range(sink))
                if t > 0:
                    ctx = out["prompt"][li, h, t] / P
                    new = out["output"][li, h, t] / t
                    out["ratio"][li, h, t] = ctx / (ctx + new)
    return out


def _close(a, b, tol=1e-6):
    assert a.shape == b.shape
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.allclose(a.nan_to_num(), b.nan_to_num(), atol=tol, rtol=0), (a - b).abs().nan_to_num().max()


def test_lookback_ratio_and_masses_are_the_weights(full):
    cache, ids, new, weights = full
    P, N = len(ids), len(new)
    lb = probe.lookback(cache, sink=2)
    want = _oracle(weights, P, N, sink=2)
    assert lb.layers == [0, 1] and lb.n_heads == 4 and lb.steps.n_steps == N
    _close(lb.ratio, want["ratio"])
    _close(lb.prompt_mass, want["prompt"])
    _close(lb.output_mass, want["output"])
    _close(lb.sink_mass, want["sink"])
    assert lb.image_mass is None
    # every row sums to 1: what is not on the prompt is on the earlier output
    assert torch.allclose(lb.prompt_mass + lb.output_mass, torch.ones_like(lb.prompt_mass), atol=1e-5)
    # the long table holds the same numbers, a row per step, layer and head
    assert len(lb.table) == N * 2 * 4
    r = lb.table.rows[5 * 8 + 4 + 3]  # step 5, layer 1, head 3
    assert (r["step"], r["layer"], r["head"], r["query"]) == (5, 1, 3, P - 1 + 5)
    assert r["lookback_ratio"] == pytest.approx(float(want["ratio"][1, 3, 5]), abs=1e-6)


def test_generated_tokens_and_their_labels(full, gpt):
    cache, ids, new, _ = full
    lb = probe.lookback(cache)
    assert lb.steps.output == list(gpt.tokenizer.decode(new))  # characters; the last from output_text
    assert lb.steps.writers == list(range(len(ids) - 1, len(ids) + len(new) - 1))
    assert lb.by_step.column("token") == lb.steps.output


def test_top_prompt_tokens_are_the_largest_weights(full):
    cache, ids, new, weights = full
    P = len(ids)
    lb = probe.lookback(cache, top=3)
    tokens = cache.metadata["tokens"][0]
    for t in (0, 4, len(new) - 1):
        for layer in (0, 1):
            for h in range(4):
                row = weights[layer][h, P - 1 + t, :P]
                order = sorted(range(P), key=lambda j: -float(row[j]))[:3]
                got = lb.reads(t, layer=layer, head=h)
                assert got.column("position") == order
                assert got.column("token") == [tokens[j] for j in order]
                assert got.column("weight") == pytest.approx([float(row[j]) for j in order], abs=1e-6)
            mean = weights[layer][:, P - 1 + t, :P].mean(0)
            order = sorted(range(P), key=lambda j: -float(mean[j]))[:3]
            assert lb.reads(t, layer=layer).column("position") == order
        every = torch.stack([w[:, P - 1 + t, :P].mean(0) for w in weights]).mean(0)
        order = sorted(range(P), key=lambda j: -float(every[j]))[:3]
        assert lb.reads(t).column("position") == order
        assert lb.by_step[t]["read_most"] == [tokens[j] for j in order]
        assert lb.by_step[t]["read_weights"] == pytest.approx([float(every[j]) for j in order], abs=1e-6)


def test_rows_cache_gives_the_kept_steps_exactly(gpt, full):
    _, ids, new, weights = full
    P, N = len(ids), len(new)
    kept = [P - 1 + t for t in (0, 3, 7)]  # the rows that wrote tokens 0, 3 and 7
    cache, _, _ = minigpt_generation(gpt, keep={"rows": kept})
    lb = probe.lookback(cache)
    want = _oracle(weights, P, N)
    for t in range(N):
        if t in (0, 3, 7):
            _close(lb.prompt_mass[..., t], want["prompt"][..., t])
            _close(lb.ratio[..., t], want["ratio"][..., t])
        else:
            assert lb.prompt_mass[..., t].isnan().all()
    assert lb.missing == {0: N - 3, 1: N - 3}
    assert "rows not kept" in lb.summary()


def test_topk_cache_top_tokens_exact_masses_only_for_whole_rows(gpt, full):
    _, ids, new, weights = full
    P, N = len(ids), len(new)
    whole, _, _ = minigpt_generation(gpt, keep={"topk": 32})  # every key of every row
    _close(probe.lookback(whole).ratio, _oracle(weights, P, N)["ratio"], tol=1e-5)
    cache, _, _ = minigpt_generation(gpt, keep={"topk": 2})
    lb = probe.lookback(cache, top=2)
    # the rows the two largest keys do not hold whole: no mass, no ratio
    assert lb.prompt_mass.isnan().any() and "top-k rows" in lb.summary()
    for t in (1, 6):
        row = weights[1][2, P - 1 + t]
        top2 = sorted(range(P + t), key=lambda j: -float(row[j]))[:2]
        on_prompt = [j for j in top2 if j < P]
        assert lb.reads(t, layer=1, head=2).column("position") == on_prompt


def test_stats_cache_and_plain_capture_are_refused(gpt):
    cache, _, _ = minigpt_generation(gpt, keep="stats")
    with pytest.raises(probe.ProbeError, match="keep='stats'.*keep='rows'"):
        probe.lookback(cache)
    with pytest.raises(probe.ProbeError, match="not a generation.*probe.generate"):
        probe.lookback(probe.capture(gpt, "attention"))


def test_bad_arguments_are_one_line_errors(full):
    cache = full[0]
    lb = probe.lookback(cache)
    for call, match in [
        (lambda: probe.lookback(cache, top=0), "top must be"),
        (lambda: probe.lookback(cache, batch=1), "batch 1 is out of range"),
        (lambda: lb.reads(99), "step 99 is out of range"),
        (lambda: lb.reads(0, head=1), "give layer="),
        (lambda: lb.reads(0, layer=5), "layer 5 is not in this result"),
    ]:
        with pytest.raises(probe.ProbeError, match=match) as e:
            call()
        assert "\n" not in str(e.value)


def test_exports_round_trip(full):
    lb = probe.lookback(full[0])
    d = json.loads(lb.to_json())
    assert len(d["rows"]) == len(lb.table) and d["rows"][0]["lookback_ratio"] is None  # step 0: NaN
    assert d["new_tokens"] == len(full[2]) and len(d["by_step"]) == len(full[2])
    assert lb.to_csv().splitlines()[0].startswith("step,token,query,layer,head,lookback_ratio")
    assert "<table>" in lb._repr_html_() and "Lookback" in repr(lb)


def test_encoder_decoder_generation_reads_its_start_token():
    model = models.load("aligner")
    cache, read = aligner_generation(model)
    lb = probe.lookback(cache)
    assert lb.steps.prompt == [0] and lb.steps.output[-1] == "E"
    assert lb.steps.output[:-1] == cache.metadata["target_tokens"][0][1:]
    w = cache.pattern("decoder", 2, batch=0).double()  # checked against eager in test_capture_zoo
    assert float(lb.prompt_mass[2, 1, 3]) == pytest.approx(float(w[1, 3, 0]), abs=1e-7)


@pytest.mark.slow  # a LLaVA-shaped model generating beside its eager twin: seconds each
def test_vision_language_generation_share_on_image_tokens():
    """A LLaVA-shaped model generates from a text holding a picture: the share of each generated
    token's attention on the image tokens, against eager generate's own per-step attentions."""
    model, eager, inputs = llava_pair()
    g = probe.generate(model, inputs, max_new_tokens=5, min_new_tokens=5)
    with torch.no_grad():
        out = eager.generate(
            **inputs, max_new_tokens=5, min_new_tokens=5, output_attentions=True, return_dict_in_generate=True
        )
    lb = probe.lookback(g.cache)
    assert lb.steps.image_positions() == list(range(2, 18)) and len(lb.steps.prompt) == 21
    for t in range(5):
        for layer in range(2):
            step = out.attentions[t][layer][0].double()  # [H, q, keys so far]
            row = step[:, -1]  # the row that wrote token t (the prefill's last row at t = 0)
            want_img = row[:, 2:18].sum(-1)
            want_prompt = row[:, :21].sum(-1)
            assert torch.allclose(lb.image_mass[layer, :, t], want_img, atol=1e-5)
            assert torch.allclose(lb.prompt_mass[layer, :, t], want_prompt, atol=1e-5)
    assert "image_mass" in lb.table.columns and "attention on the image tokens" in lb.summary()


def test_encoder_decoder_source_reads_are_its_cross_attention():
    """What each generated word read of the source: the aligner's own returned cross-attention."""
    model = models.load("aligner")
    cache, read = aligner_generation(model)
    src = torch.tensor([cache.metadata["ids"][0]])
    with torch.no_grad():
        cross = [w[0].double() for w in model(src, torch.tensor([read]))[3]]  # [H, T, S] per layer
    lb = probe.lookback(cache, top=3)
    words = cache.metadata["tokens"][0]
    for t in (0, 3, 7):
        row = cross[1][2, t]  # the decoder row that wrote word t (the start token wrote word 0)
        order = sorted(range(len(words)), key=lambda j: -float(row[j]))[:3]
        got = lb.reads(t, layer=1, head=2, source=True)
        assert got.column("position") == order and got.column("token") == [words[j] for j in order]
        assert got.column("weight") == pytest.approx([float(row[j]) for j in order], abs=1e-6)
        every = torch.stack([w[:, t].mean(0) for w in cross]).mean(0)
        assert (
            lb.reads(t, source=True).column("position")
            == sorted(range(len(words)), key=lambda j: -float(every[j]))[:3]
        )
    with pytest.raises(probe.ProbeError, match="has none"):
        probe.lookback(minigpt_generation(models.load("minigpt"))[0]).reads(0, source=True)


def test_lookback_on_layers_with_different_head_counts():
    """The induction model has 4 heads in layer 0 and 1 in layer 1: each layer's own heads only,
    none repeated. Oracle: the prompt mass of each generated token read off the cache's patterns."""
    lm = models.load("induction")
    g = probe.generate(lm, "^abcdefabc", max_new_tokens=4)
    lb = probe.lookback(g.cache)
    assert [(r["layer"], r["head"]) for r in lb.by_head.rows] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]
    assert "2 layers of 4, 1 heads" in lb.summary()
    st = lb.steps
    masses = []
    for layer in (0, 1):
        p = g.cache.pattern("decoder", layer, batch=0).double()  # [heads, q, k]
        for h in range(p.shape[0]):
            for t in range(st.n_steps):
                masses.append(float(p[h, st.writers[t], st.prompt].sum()))
    got = [r["prompt_mass"] for r in lb.table.rows]
    assert len(got) == 5 * st.n_steps
    want = {(r["layer"], r["head"], r["step"]): r["prompt_mass"] for r in lb.table.rows}
    i = 0
    for layer, heads in ((0, 4), (1, 1)):
        for h in range(heads):
            for t in range(st.n_steps):
                assert want[(layer, h, t)] == pytest.approx(masses[i], abs=1e-6)
                i += 1
    per_step = sum(masses[k * st.n_steps + 2] for k in range(5)) / 5
    assert lb.by_step.rows[2]["prompt_mass"] == pytest.approx(per_step, abs=1e-6)
    with pytest.raises(probe.ProbeError, match="layer 1 has 1 heads"):
        lb.reads(1, layer=1, head=2)
