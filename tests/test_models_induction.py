"""models.induction: the shipped checkpoint grew a previous-token head and an induction head.

Oracle: the model is run by hand in this file from its state dict (embeddings, then per head
q/k/v/o slices, scores, a causal softmax, the heads' writes summed into the stream, the
unembedding), checked against the module's own forward; the heads' scores, the ablations and the
composition paths are computed from that hand-run, and probe's capture is compared with it.
Test input: Olsson et al.'s `[BOS] r r`, r = 31 distinct random tokens, built here.
"""

import math

import pytest
import torch

import models
import probe
from models import induction

PREV = 3  # layer 0's previous-token head in the shipped checkpoint
INDUCTION = 0  # layer 1's (only) head
L = 31  # |r|: BOS + r + r fills 63 of the 64 positions


def _bos_r_r(n: int = 64, length: int = L, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r = torch.stack([torch.randperm(64, generator=g)[:length] + 1 for _ in range(n)])
    return torch.cat([torch.zeros(n, 1, dtype=torch.long), r, r], dim=1)


def _sinusoids(T: int, d: int, scale: float) -> torch.Tensor:
    table = torch.zeros(T, d)
    for p in range(T):
        for i in range(0, d, 2):
            table[p, i] = math.sin(p / 10000 ** (i / d))
            table[p, i + 1] = math.cos(p / 10000 ** (i / d))
    return scale * table


def _run(model, ids, *, zero=None, no_prev_in=()):
    """The model by hand: (logits, [pattern of layer 0, of layer 1] each [B, H, T, T]).

    zero: (layer, head) whose write is left out of the stream; no_prev_in: the inputs ("q", "k",
    "v") of layer 1 that read the stream without the previous-token head's write."""
    sd, cfg = model.state_dict(), model.config
    B, T = ids.shape
    dh = cfg.d_head
    x = sd["tok_emb.weight"][ids] + _sinusoids(T, cfg.d_model, cfg.position_scale)
    mask = torch.ones(T, T).tril().bool()
    patterns, prev_write = [], None
    for layer, H in enumerate(cfg.n_head):
        w = {p: sd[f"blocks.{layer}.attn.{p}.weight"] for p in "qkvo"}
        writes = []
        for h in range(H):
            cols = slice(h * dh, (h + 1) * dh)
            read = {}
            for p in "qkv":
                src = x - prev_write if (layer == 1 and p in no_prev_in) else x
                read[p] = src @ w[p][cols].T  # [B, T, dh]
            scores = read["q"] @ read["k"].transpose(1, 2) / math.sqrt(dh)
            pattern = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            write = (pattern @ read["v"]) @ w["o"][:, cols].T  # [B, T, d_model]
            if (layer, h) == zero:
                write = torch.zeros_like(write)
            if (layer, h) == (0, PREV):
                prev_write = write
            patterns.append(pattern)
            writes.append(write)
        x = x + sum(writes)
    pats = [torch.stack(patterns[: cfg.n_head[0]], 1), torch.stack(patterns[cfg.n_head[0] :], 1)]
    return x @ sd["lm_head.weight"].T, pats


def _prev_score(pattern):  # [B, H, T, T] -> [H]: mean weight from each position to the one before
    T = pattern.shape[-1]
    q = torch.arange(1, T)
    return pattern[:, :, q, q - 1].mean((0, 2))


def _induction_score(pattern):  # on [BOS] r r: from r's second copy to the token after its first
    q = torch.arange(L + 2, 2 * L + 1)  # second copy, after its first token
    return pattern[:, :, q, q - L + 1].mean((0, 2))


def _accuracy(logits, ids):
    hit = (logits[:, :-1].argmax(-1) == ids[:, 1:]).float()  # hit[:, t]: the token at t + 1
    return hit[:, 1:L].mean().item(), hit[:, L + 1 :].mean().item()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These are many small products: one thread runs them fastest (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def lm():
    return models.load("induction")


@pytest.fixture(scope="module")
def clean(lm):
    ids = _bos_r_r()
    with torch.no_grad():
        return ids, *_run(lm, ids)


def test_the_checkpoint_loads_with_the_zoo_attributes(lm):
    assert not lm.training and lm.name == "induction" and lm.is_encoder_decoder is False
    assert lm.context_length == 64 and lm.config.n_head == [4, 1] and lm.config.n_layer == 2
    assert lm.train_info["steps"] == 1500 and lm.train_info["recipe"]["seed"] == 2022
    assert sum(p.numel() for p in lm.parameters()) == 90_240
    tok = lm.tokenizer
    assert tok.vocab_size == 65 and tok.pad_id is None and tok.bos_id == 0
    assert tok.encode("^AB/") == [0, 1, 2, 64] and tok.decode([0, 27, 64]) == "^a/"


def test_the_hand_run_is_the_model(lm, clean):
    ids, logits, (p0, p1) = clean
    with torch.no_grad():
        torch.testing.assert_close(logits, lm(ids)[0], atol=1e-4, rtol=1e-5)
        x = lm.tok_emb(ids) + lm.pos_emb(torch.arange(ids.shape[1]))
        out0, w0 = lm.blocks[0].attn(x, return_weights=True)
        _, w1 = lm.blocks[1].attn(x + out0, return_weights=True)
    torch.testing.assert_close(p0, w0, atol=1e-5, rtol=0)
    torch.testing.assert_close(p1, w1, atol=1e-5, rtol=0)


def test_layer_0_has_one_previous_token_head(clean):
    prev = _prev_score(clean[2][0])
    assert prev[PREV] > 0.99
    assert all(prev[h] < 0.05 for h in range(4) if h != PREV), prev


def test_layer_1_is_an_induction_head(clean):
    assert _induction_score(clean[2][1])[INDUCTION] > 0.95


def test_the_second_copy_is_predicted_and_the_first_is_chance(clean):
    ids, logits, _ = clean
    first, second = _accuracy(logits, ids)
    assert first < 0.05 and second > 0.99  # chance is 1/64


def test_accuracy_counts_what_the_hand_run_predicts(lm):
    ids = induction.repeated_tokens(8, L, seed=3)
    assert ids.shape == (8, 1 + 2 * L) and (ids[:, 0] == 0).all()
    assert torch.equal(ids[:, 1 : L + 1], ids[:, L + 1 :])
    assert all(len(set(row[1 : L + 1].tolist())) == L for row in ids)  # distinct tokens
    with torch.no_grad():
        first, second = _accuracy(_run(lm, ids)[0], ids)
    assert induction.accuracy(lm, 8, L, seed=3) == pytest.approx({"first": first, "second": second})


def test_ablating_the_previous_token_head_kills_induction(lm):
    ids = _bos_r_r()
    with torch.no_grad():
        logits, (_, p1) = _run(lm, ids, zero=(0, PREV))
        other, (_, q1) = _run(lm, ids, zero=(0, (PREV + 1) % 4))
    assert _induction_score(p1)[INDUCTION] < 0.05 and _accuracy(logits, ids)[1] < 0.1
    assert _induction_score(q1)[INDUCTION] > 0.95 and _accuracy(other, ids)[1] > 0.99  # any other head


def test_the_induction_head_reads_the_previous_token_head_through_its_keys(lm):
    """K-composition: without the previous-token head's write in its keys alone the induction head
    loses its pattern; without it in its queries and values the head still works."""
    ids = _bos_r_r()
    with torch.no_grad():
        k_logits, (_, k1) = _run(lm, ids, no_prev_in=("k",))
        qv_logits, (_, qv1) = _run(lm, ids, no_prev_in=("q", "v"))
    assert _induction_score(k1)[INDUCTION] < 0.05 and _accuracy(k_logits, ids)[1] < 0.1
    assert _induction_score(qv1)[INDUCTION] > 0.95 and _accuracy(qv_logits, ids)[1] > 0.99


def test_probe_captures_the_patterns_of_the_hand_run(lm):
    texts = [lm.tokenizer.decode(row) for row in _bos_r_r(n=3, seed=1)]
    cache = probe.capture(lm, texts)
    ids = torch.tensor([lm.tokenizer.encode(t) for t in texts])
    with torch.no_grad():
        _, (p0, p1) = _run(lm, ids)
    assert cache.tokens[0] == list(texts[0])
    torch.testing.assert_close(cache.pattern("decoder", 0), p0, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache.pattern("decoder", 1), p1, atol=1e-5, rtol=0)


def test_batches_repeat_segments_over_distinct_tokens():
    x, y, repeat = induction.repeated_batch(16, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == repeat.shape == (16, 64)
    assert (x[:, 0] == 0).all() and torch.equal(x[:, 1:], y[:, :-1]) and (y >= 1).all()
    for b in range(16):
        for t in range(64):  # the mask by its definition, one position at a time
            seen = any(x[b, j] == x[b, t] and y[b, j] == y[b, t] for j in range(t))
            assert bool(repeat[b, t]) == seen, (b, t)
    assert 0.2 < repeat.float().mean() < 0.8  # a large share of positions is predictable
    again = induction.repeated_batch(16, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip((x, y, repeat), again, strict=True))


def test_training_is_deterministic_and_keeps_the_thread_count():
    torch.set_num_threads(2)  # the recipe runs on one thread and puts this back
    try:
        first, stats = induction.train(steps=3)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    second, _ = induction.train(steps=3)
    assert stats.steps == 3 and len(stats.losses) == 3 and stats.recipe["threads"] == 1
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name]), name


def test_context_longer_than_64_is_an_error(lm):
    with pytest.raises(ValueError, match="65 tokens, the context holds at most 64"):
        lm(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.slow
def test_the_recipe_grows_the_circuit_again():
    """The whole recipe (1-3 minutes): the loss of the shipped checkpoint within 0.15 (other CPUs
    round differently), a previous-token head in layer 0 and the induction head, by behaviour."""
    model, stats = induction.train()
    assert abs(stats.final_loss - models.load("induction").train_info["final_loss"]) < 0.15
    ids = _bos_r_r()
    with torch.no_grad():
        logits, (p0, p1) = _run(model, ids)
    assert _prev_score(p0).max() > 0.9 and _induction_score(p1)[0] > 0.9
    first, second = _accuracy(logits, ids)
    assert first < 0.05 and second > 0.99
