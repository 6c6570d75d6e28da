"""probe.composition: Q/K/V composition scores against the formulas of Elhage et al. (2021) computed
here, with dense d x d matrices in numpy, from the raw state dict of a tiny GPT-2 (fused ``c_attn``,
LayerNorm: weight and centring folded) and a tiny Llama (grouped-query attention, RMSNorm weight
folded). The norms' weights are drawn at random first, so folding them matters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import hf_fixtures as hf  # noqa: E402

import probe  # noqa: E402
from probe.errors import ProbeError  # noqa: E402
from probe.intervene.anatomy import anatomy  # noqa: E402

VOCAB = 100


def _randomise_norms(model, names):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(n in name for n in names) and name.endswith("weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))


def _score(a, m, b):
    return np.linalg.norm(a @ m) / (np.linalg.norm(a) * np.linalg.norm(m))


def _oracle(heads):
    """{(la, ha, lb, hb): (q, k, v)} from per-layer lists of (W_Q, W_K, W_V, W_O) numpy matrices."""
    want = {}
    for la, A in heads.items():
        for lb, B in heads.items():
            if lb <= la:
                continue
            for ha, (_, _, va, oa) in enumerate(A):
                ov_a = va @ oa
                for hb, (qb, kb, vb, ob) in enumerate(B):
                    qk = qb @ kb.T
                    want[(la, ha, lb, hb)] = (
                        _score(ov_a, qk, 0),
                        _score(ov_a, qk.T, 0),
                        _score(ov_a, vb @ ob, 0),
                    )
    return want


def _check(comp, want):
    got = {
        (r["src_layer"], r["src_head"], r["dst_layer"], r["dst_head"]): (r["q"], r["k"], r["v"])
        for r in comp.table
    }
    assert set(got) == set(want)
    for key, w in want.items():
        np.testing.assert_allclose(got[key], w, rtol=1e-5, atol=1e-7)


def test_gpt2_against_dense_matrices_from_the_state_dict():
    m = hf.gpt2(VOCAB)
    _randomise_norms(m, ["ln_1"])
    comp = probe.composition(m, torch.arange(3, 10)[None])
    sd = {k: v.double().numpy() for k, v in m.state_dict().items()}
    d, H, dh = 64, 4, 16
    P = np.eye(d) - np.ones((d, d)) / d  # LayerNorm's centring
    heads = {}
    for layer in range(3):
        pre = f"transformer.h.{layer}."
        W, O = sd[pre + "attn.c_attn.weight"], sd[pre + "attn.c_proj.weight"]  # Conv1D: [in, out]
        fold = P @ np.diag(sd[pre + "ln_1.weight"])
        heads[layer] = [
            tuple(fold @ W[:, base + h * dh : base + (h + 1) * dh] for base in (0, d, 2 * d))
            + (O[h * dh : (h + 1) * dh],)
            for h in range(H)
        ]
    _check(comp, _oracle(heads))
    assert len(comp.table) == 3 * 16  # layers (0,1), (0,2), (1,2), 4 x 4 heads each


def test_llama_gqa_against_dense_matrices_from_the_state_dict():
    m = hf.llama(VOCAB)
    _randomise_norms(m, ["input_layernorm"])
    an = anatomy(m, torch.arange(3, 10)[None])
    comp = probe.composition(an)
    sd = {k: v.double().numpy() for k, v in m.state_dict().items()}
    H, Hkv, dh = 8, 2, 8
    heads = {}
    for layer in range(2):
        pre = f"model.layers.{layer}."
        fold = np.diag(sd[pre + "input_layernorm.weight"])
        q, k, v, o = (sd[pre + f"self_attn.{n}_proj.weight"].T for n in "qkvo")  # Linear: x @ W.T
        g = H // Hkv  # repeat_kv: head h reads key/value head h // g
        heads[layer] = [
            (
                fold @ q[:, h * dh : (h + 1) * dh],
                fold @ k[:, (h // g) * dh : (h // g + 1) * dh],
                fold @ v[:, (h // g) * dh : (h // g + 1) * dh],
                o[h * dh : (h + 1) * dh],
            )
            for h in range(H)
        ]
    _check(comp, _oracle(heads))


def test_top_score_and_exports():
    m = hf.gpt2(VOCAB)
    comp = probe.composition(m)  # default inputs: eight token ids (the vocabulary is known)
    top = comp.top(5, by="v")
    vs = top.column("v")
    assert len(top) == 5 and vs == sorted(vs, reverse=True) and vs[0] == max(comp.table.column("v"))
    r = top[0]
    assert comp.score((r["src_layer"], r["src_head"]), (r["dst_layer"], r["dst_head"]), "v") == pytest.approx(
        vs[0]
    )
    assert json.loads(comp.to_json())["rows"][0].keys() >= {"src_layer", "dst_head", "q", "k", "v"}
    with pytest.raises(ProbeError, match="by= is one of"):
        comp.top(3, by="x")
    with pytest.raises(ProbeError, match="no k-composition score from layer 2 to layer 1"):
        comp.score((2, 0), (1, 0))


def test_one_layer_model_has_nothing_to_compose():
    m = hf.gpt2(VOCAB)
    m.transformer.h = m.transformer.h[:1]
    m.config.n_layer = 1
    with pytest.raises(ProbeError, match="no two attention layers"):
        probe.composition(m)


def _induction_model():
    import models

    if "induction" not in models.names() or not models.checkpoint_path("induction").exists():
        pytest.skip("the zoo's induction model is not shipped in this checkout yet")
    return models.load("induction")


def test_planted_induction_circuit_ranks_first_by_k_composition():
    """The zoo's induction model (issue 55): the first pair by K-composition is a layer-0
    previous-token head into the layer-1 induction head, both picked out here from the weights the
    model's own attention returns on a repeated random sequence; every previous-token head (more
    than 0.3 of its weight on the token before; training may split the job between two) outranks
    every other layer-0 head as a key-side source of the induction head."""
    m = _induction_model()
    g = torch.Generator().manual_seed(0)
    half = torch.randint(1, m.config.vocab_size, (20,), generator=g)
    ids = torch.cat([torch.zeros(1, dtype=torch.long), half, half])[None]  # BOS, then a segment twice
    with torch.no_grad():
        x = m.tok_emb(ids) + m.pos_emb(torch.arange(ids.shape[1]))
        _, w0 = m.blocks[0].attn(x, return_weights=True)
        _, w1 = m.blocks[1].attn(x + m.blocks[0].attn(x), return_weights=True)
    second = torch.arange(22, ids.shape[1])  # queries in the second copy
    prev = w0[0][:, second, second - 1].mean(-1)  # weight on the token just before
    ind = int(w1[0][:, second, second - 20 + 1].mean(-1).argmax())  # on the one after the earlier occurrence
    previous = {h for h in range(len(prev)) if prev[h] > 0.3}
    comp = probe.composition(m)
    top = comp.top(1, by="k")[0]
    assert (top["src_layer"], top["dst_layer"], top["dst_head"]) == (0, 1, ind) and top[
        "src_head"
    ] in previous
    k = [comp.score((0, h), (1, ind), "k") for h in range(len(prev))]
    assert min(k[h] for h in previous) > max((k[h] for h in range(len(prev)) if h not in previous), default=0)
