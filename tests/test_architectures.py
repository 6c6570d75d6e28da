"""The architecture matrix: every family probe promises, on tiny random configs, against oracles
probe never computes: attention weights from eager attention modules (hooked on an eager twin),
residual deltas from forward hooks on the sublayer modules (pre-norm, parallel) or from the
stream the model hands on around a sublayer (post-norm), and clear errors where probe cannot see.

``measure(name)`` and ``toy_deviation(build)`` return the max deviations;
``python benchmarks/architectures.py`` prints them as the README's table.
"""

from __future__ import annotations

import threading
import warnings

import arch_fixtures as A
import arch_toys as toys
import pytest
import torch

import probe
from probe.errors import ProbeError

DELTA_TOL = 1e-6
PATTERN_TOL = 1e-5


def _module(root, path: str):
    m = root
    for part in path.split("."):
        m = m[int(part)] if part.isdigit() else getattr(m, part)
    return m


def _has(root, path: str) -> bool:
    try:
        return _module(root, path) is not None
    except (AttributeError, IndexError):
        return False


def _first(o):
    if isinstance(o, torch.Tensor):
        return o
    if isinstance(o, (tuple, list)) and o and isinstance(o[0], torch.Tensor):
        return o[0]
    return None


def _hooked(model, paths: list[str], run) -> tuple[dict, dict]:
    """Run ``run()`` with forward hooks on ``paths``: (outputs, first positional/hidden inputs)."""
    outs, ins, handles = {}, {}, []

    def hook(path):
        def f(mod, args, kwargs, out):
            # a copy: some models write into a sublayer's output afterwards (Falcon's +=)
            outs[path] = (
                tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)
                if isinstance(out, tuple)
                else out.clone()
            )
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("hidden_state", kwargs.get("x")))
            ins[path] = x

        return f

    for p in paths:
        handles.append(_module(model, p).register_forward_hook(hook(p), with_kwargs=True))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return outs, ins


def measure(name: str) -> dict[str, float]:
    """Capture ``name`` and compare with the oracles; returns max |deviation| of patterns and deltas."""
    arch = A.ARCHS[name]
    model = arch.build()
    x = A.inputs(name, model)
    with torch.no_grad(), probe.trace(model) as t:
        model(**x)
    cache = t.cache
    # patterns: the weights each eager attention module returns
    twin = A.eager_twin(model)
    attn_paths = {}
    for stack, lp in arch.layers.items():
        for i, layer in enumerate(_module(twin, lp)):
            if not hasattr(layer, arch.attn["self"].split(".")[0]):
                continue  # a layer without attention (hybrids): checked below
            for role in arch.stack_roles.get(stack, tuple(arch.attn)):
                attn_paths[(stack, i, role)] = f"{lp}.{i}.{arch.attn[role]}"
    outs, _ = _hooked(twin, list(attn_paths.values()), lambda: twin(**x, output_attentions=True))
    dev_p = 0.0
    for (stack, i, role), path in attn_paths.items():
        want = outs[path][1]
        got = cache.pattern(stack, i, role)
        assert got.shape == want.shape, (name, stack, i, role)
        dev_p = max(dev_p, float((got - want).abs().max()))
    # deltas: hooks on the sublayers of the model itself (no probe)
    sub = {"self_attn", "mlp", "fc2", "attention", "sa_layer_norm", "self_attention", "encoder_attn"}
    sub |= {"self_attn_layer_norm", "post_attention_layernorm", "post_feedforward_layernorm", "attn"}
    sub |= {
        "feed_forward",
        "self_attention.dense",
        "mlp.dense_4h_to_h",
        "ffn.down_proj",
        "ffn1",
        "conv_module",
    }
    paths = []
    for lp in arch.layers.values():
        for i, layer in enumerate(_module(model, lp)):
            paths.append(f"{lp}.{i}")
            paths += [f"{lp}.{i}.{s}" for s in sub if _has(layer, s)]
    outs, ins = _hooked(model, paths, lambda: model(**x))
    dev_d = dev_chain = 0.0
    for stack, lp in arch.layers.items():
        n = len(_module(model, lp))
        for i in range(n):
            base = f"{lp}.{i}"
            inp = ins[base]

            def out(s, base=base):
                o = outs.get(f"{base}.{s}" if s else base)
                return None if o is None else _first(o)

            attends = hasattr(_module(model, base), arch.attn["self"].split(".")[0])
            want = arch.deltas(out, inp) if attends else {}
            if not attends:
                assert not any(k.startswith(f"{stack}.blocks.{i}.") and "attn" in k for k in cache.keys())
                entry = next(e for e in cache.metadata["layers"] if e["stack"] == stack and e["layer"] == i)
                assert "no attention" in entry["residual_note"]
            assert torch.equal(cache[f"{stack}.blocks.{i}.resid_pre"], inp)
            assert torch.equal(cache[f"{stack}.blocks.{i}.resid_post"], out(""))
            got = {
                k.split(".")[-2]: cache[k]
                for k in cache.keys()
                if k.startswith(f"{stack}.blocks.{i}.") and k.endswith(".delta")
            }
            assert set(got) == set(want), (name, stack, i, sorted(got), sorted(want))
            for k in want:
                dev_d = max(dev_d, float((got[k] - want[k]).abs().max()))
            if attends:
                total = inp + sum(got.values())
                dev_chain = max(dev_chain, float((total - out("")).abs().max()))
            if i + 1 < n:
                assert torch.equal(
                    cache[f"{stack}.blocks.{i}.resid_post"], cache[f"{stack}.blocks.{i + 1}.resid_pre"]
                )
    return {"pattern": dev_p, "delta": dev_d, "resid_pre+deltas-resid_post": dev_chain}


@pytest.mark.parametrize("name", sorted(A.ARCHS))
def test_hf_architecture(name):
    dev = measure(name)
    assert dev["pattern"] <= PATTERN_TOL, dev
    assert dev["delta"] <= DELTA_TOL, dev
    assert dev["resid_pre+deltas-resid_post"] <= DELTA_TOL, dev


def test_bloom_self_attention_is_not_cross():
    cache_keys = _capture_keys("bloom")
    assert not any("cross_attn" in k for k in cache_keys)


def _capture_keys(name):
    arch = A.ARCHS[name]
    model = arch.build()
    with torch.no_grad(), probe.trace(model) as t:
        model(**A.inputs(name, model))
    return t.cache.keys()


# -- hand-written shapes -------------------------------------------------------------------------
def _toy_capture(model, ids=None):
    ids = (
        torch.randint(0, 50, (2, toys.T), generator=torch.Generator().manual_seed(1)) if ids is None else ids
    )
    cache = probe.capture(model, ids)
    return cache, ids


def _toy_oracle(model, ids, paths):
    outs, ins = _hooked(model, paths, lambda: model(ids))
    return {p: _first(o) for p, o in outs.items()}, ins


def toy_deviation(build) -> dict[str, float]:
    """Patterns vs the weights the toy's attention modules kept; deltas vs their sublayer hooks;
    the chain ``resid_pre + Σ deltas`` vs the block's own output (its hook)."""
    model = build()
    cache, ids = _toy_capture(model)
    dev_p = dev_d = dev_chain = 0.0
    paths = []
    for i, b in enumerate(model.blocks):
        if isinstance(b, toys.Block):
            paths += [f"blocks.{i}", f"blocks.{i}.attn", f"blocks.{i}.mlp"]
    outs, ins = _toy_oracle(model, ids, paths)
    for i, b in enumerate(model.blocks):
        if not isinstance(b, toys.Block):
            continue
        w = getattr(b.attn, "weights", None)
        if w is not None:
            dev_p = max(dev_p, float((cache.pattern("decoder", i) - w).abs().max()))
        total = ins[f"blocks.{i}"]
        for part, path in (("self_attn", f"blocks.{i}.attn"), ("mlp", f"blocks.{i}.mlp")):
            got = cache[f"decoder.blocks.{i}.{part}.delta"]
            dev_d = max(dev_d, float((got - outs[path]).abs().max()))
            total = total + got
        dev_chain = max(dev_chain, float((total - outs[f"blocks.{i}"]).abs().max()))
    return {"pattern": dev_p, "delta": dev_d, "resid_pre+deltas-resid_post": dev_chain}


def test_baddbmm_scores_are_restored_to_batch_heads():
    model = toys.baddbmm_lm()
    cache, _ = _toy_capture(model)
    assert cache.pattern("decoder", 0).shape == (2, toys.H, toys.T, toys.T)
    dev = toy_deviation(toys.baddbmm_lm)
    assert dev["pattern"] == 0 and dev["delta"] == 0 and dev["resid_pre+deltas-resid_post"] == 0, dev


def test_moe_router_is_not_a_pattern_and_expert_sums_are_not_residual_adds():
    cache, _ = _toy_capture(toys.moe_lm())
    assert not any("cross" in k for k in cache.keys())
    dev = toy_deviation(toys.moe_lm)
    assert dev["pattern"] == 0 and dev["delta"] == 0 and dev["resid_pre+deltas-resid_post"] == 0, dev


@pytest.mark.parametrize("build", [toys.router_lm, toys.probs_lm], ids=["moe-router", "softmax-output"])
def test_softmax_that_is_not_attention_is_never_a_pattern(build):
    with pytest.raises(ProbeError, match="no attention found"):
        _toy_capture(build())


def test_hybrid_keeps_the_models_layer_indices():
    model = toys.hybrid_lm()
    cache, ids = _toy_capture(model)
    assert cache.n_layers("decoder") == 4
    assert cache.metadata["stacks"]["decoder"]["layers"] == 4
    for i in (1, 3):
        assert f"decoder.blocks.{i}.self_attn.pattern" in cache
    for i in (0, 2):
        assert not any(k.startswith(f"decoder.blocks.{i}.") and "attn" in k for k in cache.keys())
        entry = next(e for e in cache.metadata["layers"] if e["layer"] == i)
        assert "no attention" in entry["residual_note"]
    # the chain holds across the layers without attention: same tensors as the model hands on
    outs, ins = _toy_oracle(model, ids, [f"blocks.{i}" for i in range(4)])
    for i in range(4):
        assert torch.equal(cache[f"decoder.blocks.{i}.resid_pre"], ins[f"blocks.{i}"])
        assert torch.equal(cache[f"decoder.blocks.{i}.resid_post"], outs[f"blocks.{i}"])
    assert torch.equal(cache.pattern("decoder", 1), model.blocks[1].attn.weights)
    dev = toy_deviation(toys.hybrid_lm)
    assert dev["pattern"] <= PATTERN_TOL and dev["delta"] == 0, dev


def test_layer_probe_cannot_decompose_keeps_the_stream_and_says_why(tmp_path):
    model = toys.entangled_lm()
    ids = torch.randint(0, 50, (1, toys.T), generator=torch.Generator().manual_seed(2))
    path = tmp_path / "c.safetensors"
    cache = probe.capture(model, ids, out=path)
    keys = [k for k in cache.keys() if k.startswith("decoder.blocks.0.")]
    assert sorted(keys) == [f"decoder.blocks.0.{n}" for n in ("resid_post", "resid_pre", "self_attn.pattern")]
    entry = cache.metadata["layers"][0]
    assert "cannot separate" in entry["residual_note"] and "deltas" not in entry
    outs, ins = _toy_oracle(model, ids, ["blocks.0"])
    assert torch.equal(cache["decoder.blocks.0.resid_post"], outs["blocks.0"])
    # the next layer is a plain block: its deltas are there and exact
    outs, _ = _toy_oracle(model, ids, ["blocks.1.attn", "blocks.1.mlp"])
    assert torch.equal(cache["decoder.blocks.1.self_attn.delta"], outs["blocks.1.attn"])
    assert cache.metadata["layers"][1]["deltas"] == {"self_attn": "sublayer output", "mlp": "sublayer output"}
    from probe.cli import info_text

    assert (
        "no deltas: decoder.blocks.0: the outputs of mlp and self_attn are mixed before they reach the "
        "stream; probe cannot separate them (blocks.0.attn, blocks.0.mlp)"
    ) in info_text(path)


# DeepNorm hands on x1 = ln1(2·x + attn(x)) and the MLP's add takes 2·x1: the stream between the
# sublayers is x1 (what ln1 returns), not 2·x1, so the factor belongs to the MLP's delta. Likewise
# for a pre-norm block whose second add takes x1 / 0.5: attention's delta stays its output.
@pytest.mark.parametrize(
    "build, sub, definitions, oracle",
    [
        (
            toys.deepnorm_lm,
            "ln1",
            {"self_attn": "stream difference", "mlp": "stream difference"},
            lambda x, x1, y: {"self_attn": x1 - x, "mlp": y - x1},
        ),
        (
            toys.scaled_stream_lm,
            "attn",
            {"self_attn": "sublayer output", "mlp": "stream difference"},
            lambda x, a, y: {"self_attn": a, "mlp": y - (x + a)},
        ),
    ],
    ids=["deepnorm", "prenorm-scaled-stream"],
)
def test_stream_rescaled_before_its_residual_add_is_not_a_sublayers_output(build, sub, definitions, oracle):
    model = build()
    cache, ids = _toy_capture(model)
    outs, ins = _toy_oracle(model, ids, [p for i in range(2) for p in (f"blocks.{i}", f"blocks.{i}.{sub}")])
    for i in range(2):
        want = oracle(ins[f"blocks.{i}"], outs[f"blocks.{i}.{sub}"], outs[f"blocks.{i}"])
        assert cache.metadata["layers"][i]["deltas"] == definitions
        for k, v in want.items():
            assert torch.equal(cache[f"decoder.blocks.{i}.{k}.delta"], v), (i, k)


def test_input_written_in_place_before_the_first_add_is_a_stream_difference():
    # the first add's stream is the layer's input memory, but written since resid_pre was copied
    # from it: its values are not resid_pre's, so attention's delta is the stream difference
    model = toys.inplace_input_lm()
    cache, ids = _toy_capture(model)
    outs, _ = _toy_oracle(model, ids, ["blocks.0", "blocks.0.attn", "blocks.0.mlp"])
    with torch.no_grad():
        x0 = model.emb(ids)  # the layer's input before the layer doubled it
    a, m, y = outs["blocks.0.attn"], outs["blocks.0.mlp"], outs["blocks.0"]
    want = {"self_attn": "stream difference", "mlp": "sublayer output"}
    assert cache.metadata["layers"][0]["deltas"] == want
    assert torch.equal(cache["decoder.blocks.0.resid_pre"], x0)
    assert torch.equal(cache["decoder.blocks.0.self_attn.delta"], (2.0 * x0 + a) - x0)
    assert torch.equal(cache["decoder.blocks.0.mlp.delta"], m)
    assert torch.equal(cache["decoder.blocks.0.resid_post"], y)


def test_untouched_layer_input_needs_no_comparison_with_its_copy(monkeypatch):
    # the first add's stream is the layer's input, unwritten since resid_pre was copied from it:
    # known equal without comparing them value by value (still "sublayer output", still exact)
    calls = []
    equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: calls.append(a.shape) or equal(a, b))
    model = toys.seeded(lambda: toys.LM([toys.Block(toys.SdpaAttention(), toys.MLP()) for _ in range(2)]))
    cache, ids = _toy_capture(model)
    monkeypatch.undo()
    assert calls == []
    outs, _ = _toy_oracle(model, ids, ["blocks.1.attn"])
    assert cache.metadata["layers"][1]["deltas"] == {"self_attn": "sublayer output", "mlp": "sublayer output"}
    assert torch.equal(cache["decoder.blocks.1.self_attn.delta"], outs["blocks.1.attn"])


def test_flex_attention_layer_is_captured_exactly():
    # flex_attention's weights are recomputed from its own q, k (tests/test_attention_kinds.py
    # covers score_mod, block masks and a transformers model); here: one flex layer among SDPA ones
    model = toys.flex_lm()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention's own "called without torch.compile"
        cache, ids = _toy_capture(model)
        _, ins = _toy_oracle(model, ids, ["blocks.1.attn"])
    with torch.no_grad():
        q, k, _ = model.blocks[1].attn.heads(ins["blocks.1.attn"])
        want = torch.softmax(q.double() @ k.double().transpose(-1, -2) / q.size(-1) ** 0.5, -1)
    # layer 1 sees every key, layer 0 is causal: the list is named as an encoder
    got = cache[f"{cache.stacks[0]}.blocks.1.self_attn.pattern"]
    assert float((got - want.float()).abs().max()) <= 1e-6
    assert cache.metadata["layers"][1]["self_attn"]["impl"] == ["flex"]


def test_weight_shared_layers_are_one_layer_per_call_and_copies_one_per_module():
    import copy

    model = A.albert()
    ids = A.inputs("albert", model)
    with torch.no_grad():
        want = A.eager_twin(model)(**ids, output_attentions=True).attentions
    # one module run 3 times: one layer per call (tests/test_catalogue_structure.py has more)
    cache = probe.capture(model, ids["input_ids"])
    assert [e["call"] for e in cache.metadata["layers"]] == [0, 1, 2]
    for i in range(3):
        torch.testing.assert_close(cache.pattern("encoder", i), want[i], atol=PATTERN_TOL, rtol=0)
    # one module per layer (ALBERT picks group i for layer i): numbered by the list, no calls
    shared = model.encoder.albert_layer_groups[0]
    model.encoder.albert_layer_groups = torch.nn.ModuleList([copy.deepcopy(shared) for _ in range(3)])
    model.config.num_hidden_groups = 3
    cache = probe.capture(model, ids["input_ids"])
    assert cache.n_layers("encoder") == 3
    assert not [e for e in cache.metadata["layers"] if "call" in e]
    for i in range(3):
        torch.testing.assert_close(cache.pattern("encoder", i), want[i], atol=PATTERN_TOL, rtol=0)


def test_train_mode_is_recorded_and_warned():
    model = toys.dropout_lm().train()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cache, _ = _toy_capture(model)
    said = [str(w.message) for w in seen if "train mode" in str(w.message)]
    assert len(said) == 1 and "before dropout" in said[0], said  # once per capture, not per layer
    assert cache.metadata["training"] is True
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache, _ = _toy_capture(model)
    assert cache.metadata["training"] is False


def test_concurrent_captures_on_separate_models_work():
    # one model object in several threads: tests/test_catalogue_structure.py
    # separate model objects in two threads at once: both exact
    models = [toys.moe_lm(), toys.baddbmm_lm()]
    results: dict[int, dict] = {}

    def run(k):
        results[k] = toy_deviation(lambda: models[k])

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    for k in range(2):
        assert results[k]["pattern"] == 0 and results[k]["delta"] == 0, results


@pytest.fixture(scope="module")
def left_tokenizer(tmp_path_factory):
    import hf_fixtures as H

    tok = H.bpe_tokenizer(tmp_path_factory.mktemp("bpe"), vocab=300)
    tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


# RoBERTa/XLM-R count positions from padding_idx + 1, OPT and GPT-NeoX from 0 (OPT adds its own
# offset inside); BLOOM takes no position ids (ALiBi), so probe pads it on the right instead
@pytest.mark.parametrize(
    "name, side", [("roberta", "left"), ("xlm-roberta", "left"), ("opt-prenorm", "left"), ("bloom", "right")]
)
def test_left_padding_keeps_each_texts_positions(left_tokenizer, name, side):
    tok = left_tokenizer
    cfg = A.ARCHS[name].build().config
    cfg.vocab_size = len(tok)
    cfg.pad_token_id = tok.pad_token_id
    torch.manual_seed(0)
    model = type(A.ARCHS[name].build())(cfg).eval()
    texts = ["attention lets tokens read context.", "the model"]
    cache = probe.capture(model, texts, tokenizer=tok)
    assert cache.metadata["padding_side"] == side
    assert ("padding_note" in cache.metadata) == (side == "right")
    stack = next(iter(cache.metadata["stacks"]))
    twin = A.eager_twin(model)
    for b, text in enumerate(texts):
        ids = torch.tensor([tok(text)["input_ids"]])
        with torch.no_grad():
            want = twin(input_ids=ids, output_attentions=True).attentions
        n = ids.shape[1]
        real = slice(-n, None) if side == "left" else slice(0, n)
        for layer in range(2):
            got = cache.pattern(stack, layer)[b, :, real, real]
            torch.testing.assert_close(got, want[layer][0], atol=PATTERN_TOL, rtol=0)


def test_falcon_alibi_patterns_are_what_its_sdpa_path_computes(monkeypatch):
    # Falcon with alibi hands its position bias to scaled_dot_product_attention in attn_mask. Some
    # transformers versions scale it differently on their eager path (huggingface/transformers#29946),
    # others do not: the oracle is what the default (sdpa) path computes, a softmax of the arguments
    # the model hands to scaled_dot_product_attention, whether or not eager agrees with it
    import transformers as tf

    cfg = A.ARCHS["falcon"].build().config
    cfg.alibi, cfg.parallel_attn = True, False
    model = A._seeded(tf.FalconForCausalLM, cfg)
    ids = A.inputs("falcon", model)["input_ids"]
    sdpa, want, unbiased = torch.nn.functional.scaled_dot_product_attention, [], []

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
        causal = torch.ones(s.shape[-2:], dtype=torch.bool).triu(1)
        unbiased.append(s.masked_fill(causal, float("-inf")).softmax(-1))
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
        if is_causal:
            s = s.masked_fill(causal, float("-inf"))
        want.append(s.softmax(-1))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)

    with monkeypatch.context() as m:
        m.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        with torch.no_grad():
            model(ids)
    cache = probe.capture(model, ids)
    assert len(want) == 2
    for i in range(2):
        torch.testing.assert_close(cache.pattern("decoder", i), want[i], atol=PATTERN_TOL, rtol=0)
        # the case exercises alibi: the bias moves the pattern far past the tolerance above (by
        # about 0.04 here: its slopes times key distances of up to 6)
        assert float((want[i] - unbiased[i]).abs().max()) > 1e-3
