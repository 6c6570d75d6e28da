"""probe.contributions: ||a_ij v_j W_O^h|| beside the weights, against hand computations.

Oracles, all written here: the weights Hugging Face's eager attention returns
(``output_attentions``), the values computed from the model's own modules and weights (GPT-2's
``ln_1`` and fused ``c_attn``, Llama's ``input_layernorm`` and ``v_proj`` with grouped-query
sharing, minigpt's per-head ``value`` modules and its ``return_weights``), and the heads' rows of
the output projection. The capture's derived-kind seam is also checked with a scale of the test's
own through ``probe.trace``; the statistics by contribution against ``head_stats`` of a cache
holding the test's own contribution rows as weights.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).parent))

import hf_fixtures as hf  # noqa: E402

import models  # noqa: E402
import probe  # noqa: E402
from probe.cache import Cache  # noqa: E402
from probe.errors import ProbeError  # noqa: E402

VOCAB = 100


def _ids(b=2, n=7, seed=0):
    return torch.randint(3, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


def _gpt2_want(m, ids):
    """Per layer ``[B, H, T, T]``: eager GPT-2's weights times ||v_j W_O^h||, by hand."""
    out = hf.eager_twin(m)(ids, output_attentions=True, output_hidden_states=True)
    d, H = m.config.n_embd, m.config.n_head
    dh = d // H
    want = []
    with torch.no_grad():
        for layer, blk in enumerate(m.transformer.h):
            x = blk.ln_1(out.hidden_states[layer])
            v = x @ blk.attn.c_attn.weight[:, 2 * d :] + blk.attn.c_attn.bias[2 * d :]  # [q | k | v]
            W = blk.attn.c_proj.weight  # Conv1D: x @ W
            n = torch.stack(
                [(v[..., h * dh : (h + 1) * dh] @ W[h * dh : (h + 1) * dh]).norm(dim=-1) for h in range(H)], 1
            )
            want.append(out.attentions[layer] * n[:, :, None, :])
    return want


def _llama_want(m, ids):
    """The same for Llama with grouped-query attention: head h reads kv head h // (H / Hkv)."""
    out = hf.eager_twin(m)(ids, output_attentions=True, output_hidden_states=True)
    cfg = m.config
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    dh = cfg.hidden_size // H
    want = []
    with torch.no_grad():
        for layer, blk in enumerate(m.model.layers):
            v = blk.self_attn.v_proj(blk.input_layernorm(out.hidden_states[layer]))  # no rotary on values
            Wo = blk.self_attn.o_proj.weight  # [d, H * dh]: y = z @ Wo.T
            n = []
            for h in range(H):
                g = h // (H // Hkv)
                n.append((v[..., g * dh : (g + 1) * dh] @ Wo[:, h * dh : (h + 1) * dh].T).norm(dim=-1))
            want.append(out.attentions[layer] * torch.stack(n, 1)[:, :, None, :])
    return want


@pytest.fixture(scope="module")
def gpt2():
    return hf.gpt2(VOCAB)


@pytest.fixture(scope="module")
def llama():
    return hf.llama(VOCAB)


def _close(got, want):
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=1e-6)


def test_gpt2_contributions_by_hand(gpt2):
    ids = _ids()
    cache = probe.contributions(gpt2, ids)
    for layer, want in enumerate(_gpt2_want(gpt2, ids)):
        _close(cache.pattern("decoder", layer, by="contribution"), want)
        _close(
            cache.pattern("decoder", layer),
            hf.eager_twin(gpt2)(ids, output_attentions=True).attentions[layer],
        )
    assert cache.metadata["contribution"]["refused"] == {}
    assert "Kobayashi" in cache.metadata["contribution"]["definition"]


def test_llama_gqa_contributions_by_hand_sdpa_and_eager(llama):
    ids = _ids(n=9, seed=1)
    want = _llama_want(llama, ids)
    for model in (llama, hf.eager_twin(llama)):  # SDPA recomputed, and the model's own softmax
        cache = probe.contributions(model, ids)
        for layer, w in enumerate(want):
            _close(cache.pattern("decoder", layer, by="contribution"), w)


def test_minigpt_per_head_modules_by_hand():
    gpt = models.load("minigpt")
    text = "the cat sat on the mat"
    cache = probe.contributions(gpt, text)
    ids = torch.tensor([gpt.tokenizer.encode(text)])
    seen = {}
    hooks = [
        b.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[0]))
        for i, b in enumerate(gpt.blocks)
    ]
    with torch.no_grad():
        gpt(ids)
    for h in hooks:
        h.remove()
    for layer, blk in enumerate(gpt.blocks):
        with torch.no_grad():
            x = blk.ln1(seen[layer])
            _, alpha = blk.attn(x, return_weights=True)
            W = blk.attn.proj.weight.T  # [H * dh, d]
            dh = W.shape[0] // len(blk.attn.heads)
            n = torch.stack(
                [
                    (hd.value(x) @ W[h * dh : (h + 1) * dh]).norm(dim=-1)
                    for h, hd in enumerate(blk.attn.heads)
                ],
                1,
            )
        _close(cache.pattern("decoder", layer, by="contribution"), alpha * n[:, :, None, :])


def test_selection_rows_and_topk_by_hand(gpt2):
    ids = _ids()
    want = _gpt2_want(gpt2, ids)
    some = probe.contributions(gpt2, ids, layers=[1], heads=[1, 3])
    assert [k for k in some.keys() if k.endswith("contribution")] == [
        "decoder.blocks.1.self_attn.contribution"
    ]
    _close(some.pattern("decoder", 1, by="contribution"), want[1][:, [1, 3]])
    rows = probe.contributions(gpt2, ids, keep={"rows": [-1, 2]})
    _close(rows["decoder.blocks.2.self_attn.contribution_rows"], want[2][:, :, [6, 2]])
    top = probe.contributions(gpt2, ids, keep={"topk": 3})
    values, _ = want[0].topk(3, dim=-1)
    _close(top["decoder.blocks.0.self_attn.contribution_topk_values"], values)
    _close(top["decoder.blocks.0.self_attn.contribution_topk_mass"], values.sum(-1))
    got_ix = top["decoder.blocks.0.self_attn.contribution_topk_indices"].long()
    _close(want[0].gather(-1, got_ix), values)  # the keys it names hold those contributions


def test_the_capture_keeps_a_scale_of_the_callers(gpt2):
    """The seam itself: any scale(attn) -> [B, H, K] is kept as a kind beside the weights."""
    ids = _ids()
    col = torch.arange(1.0, 8.0)

    def scale(attn):
        return col.expand(ids.shape[0], 4, attn.qk[1])

    with torch.no_grad(), probe.trace(gpt2, kinds={"contribution": scale}) as t:
        gpt2(ids)
    w = t.cache["decoder.blocks.1.self_attn.pattern"]
    _close(t.cache.pattern("decoder", 1, by="contribution"), w * col)
    with pytest.raises(ProbeError, match="'ramp' is not a pattern kind of the cache format"):
        probe.trace(gpt2, kinds={"ramp": scale}).__enter__()


def _as_weights(cache: Cache, want: list) -> Cache:
    """The capture with its weights replaced by the test's contribution rows (renormalised)."""
    tensors = {k: cache[k] for k in cache.keys() if not k.endswith("contribution")}
    for layer, w in enumerate(want):
        tensors[f"decoder.blocks.{layer}.self_attn.pattern"] = w / w.sum(-1, keepdim=True)
    return Cache(tensors, cache.metadata)


def test_stats_by_contribution_against_the_tests_own_rows(llama):
    ids = _ids(n=12, seed=2)
    want = _llama_want(llama, ids)
    whole = probe.contributions(llama, ids)
    oracle = probe.head_stats(_as_weights(whole, want), progress=False)
    streamed = [
        probe.head_stats(probe.contributions(model, ids, keep="stats", block=block), progress=False)
        for model, block in ((llama, None), (llama, 5), (hf.eager_twin(llama), 5))  # SDPA, blocks, softmax
    ]
    held = probe.head_stats(whole, progress=False)
    for got in (held, *streamed):
        assert got.by_contribution is not None
        for a, b, w in zip(got.by_contribution.table, oracle.table, got.table, strict=True):
            for m in ("first", "distance", "entropy", "prev", "content"):
                assert a[m] == pytest.approx(b[m], rel=1e-4, abs=1e-6), (m, a, b)
            assert w["first_contrib"] == a["first"] and w["distance_contrib"] == a["distance"]
    assert all(not math.isnan(r["first_contrib"]) for r in held.table)


def test_stats_without_contributions_in_every_cache_are_left_out(gpt2):
    ids = _ids()
    both = probe.head_stats([probe.contributions(gpt2, ids), probe.capture(gpt2, ids)], progress=False)
    assert both.by_contribution is None and "contributions" in both.not_computed
    assert "first_contrib" not in both.table.columns
    plain = probe.head_stats(probe.capture(gpt2, ids), progress=False)
    assert plain.by_contribution is None and "contributions" not in plain.not_computed


def test_refusals(gpt2):
    ids = _ids()
    with pytest.raises(ProbeError, match="holds no contributions; capture them with probe.contributions"):
        probe.capture(gpt2, ids).pattern("decoder", 0, by="contribution")
    with pytest.raises(ProbeError, match="by must be one of"):
        probe.capture(gpt2, ids).pattern("decoder", 0, by="norm")
    with pytest.raises(ProbeError, match="block= sets the row blocks"):
        probe.contributions(gpt2, ids, block=4)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    fused = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    with pytest.raises(ProbeError, match="probe has no contributions for this model"):
        probe.contributions(fused, torch.randn(1, 5, 16))


def test_an_anatomy_found_once_serves_other_inputs(gpt2):
    from probe.intervene.anatomy import anatomy

    an = anatomy(gpt2, _ids(b=1, seed=5))
    ids = _ids(seed=6)
    cache = probe.contributions(an, ids)
    for layer, want in enumerate(_gpt2_want(gpt2, ids)):
        _close(cache.pattern("decoder", layer, by="contribution"), want)


def test_post_norm_bert_has_contributions():
    """Kobayashi et al. measured BERT: the contribution needs the values and W_O, not a pre-norm."""
    torch.manual_seed(0)
    cfg = tf.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    bert = tf.BertModel(cfg).eval()
    ids = torch.tensor([[1, 5, 7, 9, 2]])
    cache = probe.contributions(bert, ids)
    out = hf.eager_twin(bert)(ids, output_attentions=True, output_hidden_states=True)
    for layer, blk in enumerate(bert.encoder.layer):
        with torch.no_grad():
            v = blk.attention.self.value(out.hidden_states[layer])
            W = blk.attention.output.dense.weight
            n = torch.stack(
                [(v[..., h * 8 : (h + 1) * 8] @ W[:, h * 8 : (h + 1) * 8].T).norm(dim=-1) for h in range(4)],
                1,
            )
        _close(cache.pattern("encoder", layer, by="contribution"), out.attentions[layer] * n[:, :, None, :])
