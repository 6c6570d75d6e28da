"""Layers, stacks and roles as the model runs them (issue 22, items 2 and 4).

Oracles: HF eager ``output_attentions`` with the same weights (T5Gemma 2's merged attention,
Funnel's pooled queries, Canine's stacks, ALBERT's shared layer), the attention weights a toy
block keeps as it computes them, and the tensors the model hands from one layer to the next
(forward hooks), never probe's own output.
"""

from __future__ import annotations

import copy
import threading

import arch_toys as toys
import pytest
import torch
import transformers as tf
from torch import nn

import probe
from probe.errors import ProbeError

PATTERN_TOL = 1e-5
VOCAB = 96


def _seeded(cls, cfg, seed: int = 0):
    torch.manual_seed(seed)
    return cls._from_config(cfg).eval()


def _eager(model):
    twin = type(model)._from_config(copy.deepcopy(model.config), attn_implementation="eager")
    twin.load_state_dict(model.state_dict())
    return twin.eval()


def _ids(b: int = 2, t: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def t5gemma2():
    """T5Gemma 2: its decoder's self-attention is one softmax over its own keys then the encoder's."""
    cfg = tf.T5Gemma2Config()
    small = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, layer_types=["full_attention"] * 2, sliding_window=16,
    )  # fmt: skip
    for part in (cfg.encoder.text_config, cfg.decoder):
        for k, v in small.items():
            setattr(part, k, v)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    for k, v in vision.items():
        setattr(cfg.encoder.vision_config, k, v)
    cfg.vocab_size = VOCAB
    return _seeded(tf.T5Gemma2Model, cfg)


def funnel(repeats=None):
    cfg = tf.FunnelConfig(
        vocab_size=VOCAB, block_sizes=[1, 1], block_repeats=repeats, num_decoder_layers=1, d_model=32,
        n_head=4, d_head=8, d_inner=64, max_position_embeddings=64,
    )  # fmt: skip
    return _seeded(tf.FunnelModel, cfg)


def canine():
    cfg = tf.CanineConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, downsampling_rate=2,
        num_hash_buckets=64, num_hash_functions=2, local_transformer_stride=4, max_position_embeddings=64,
    )  # fmt: skip
    return _seeded(tf.CanineModel, cfg)


def albert(layers: int = 3):
    cfg = tf.AlbertConfig(
        vocab_size=VOCAB, max_position_embeddings=64, hidden_size=32, num_hidden_layers=layers,
        num_attention_heads=4, intermediate_size=64, embedding_size=16,
    )  # fmt: skip
    return _seeded(tf.AlbertModel, cfg)


def xlm():
    return _seeded(tf.XLMModel, tf.XLMConfig(vocab_size=VOCAB, emb_dim=32, n_layers=2, n_heads=4))


def K(stack: str, layer: int, name: str) -> str:
    return f"{stack}.blocks.{layer}.{name}"


def flaubert():
    # post-norm (its pre_norm=True path indexes the cache object and fails in transformers itself)
    cfg = tf.FlaubertConfig(vocab_size=VOCAB, emb_dim=32, n_layers=2, n_heads=4, layerdrop=0.0)
    return _seeded(tf.FlaubertModel, cfg)


def _close(got, want):
    torch.testing.assert_close(got, want, atol=PATTERN_TOL, rtol=0)


# -- roles ---------------------------------------------------------------------------------------


def test_t5gemma2_merged_attention_is_stored_as_the_self_and_cross_parts_eager_returns():
    model, x, y = t5gemma2(), _ids(), _ids(2, 5, 1)
    with torch.no_grad(), probe.trace(model) as t:
        model(input_ids=x, decoder_input_ids=y)
    cache = t.cache
    with torch.no_grad():
        want = _eager(model)(input_ids=x, decoder_input_ids=y, output_attentions=True)
    assert cache.stacks == ["encoder", "decoder"]
    for i in range(2):
        _close(cache[K("encoder", i, "self_attn.pattern")], want.encoder_attentions[i])
        _close(cache[K("decoder", i, "self_attn.pattern")], want.decoder_attentions[i])
        _close(cache[K("decoder", i, "cross_attn.pattern")], want.cross_attentions[i])
        entry = cache.metadata["layers"][2 + i]
        assert entry["module"] == f"decoder.layers.{i}" and "merged_attention" in entry
    # one softmax: each query's self row and cross row sum to 1 together, neither alone
    both = cache[K("decoder", 0, "self_attn.pattern")].sum(-1) + cache[
        K("decoder", 0, "cross_attn.pattern")
    ].sum(-1)
    _close(both, torch.ones_like(both))
    assert (cache[K("decoder", 0, "self_attn.pattern")].sum(-1) < 0.999).any()


def test_funnel_pooled_queries_over_their_own_sequence_are_self_attention_in_its_own_stacks():
    model, x = funnel(), _ids(2, 8)
    cache = probe.capture(model, x)
    with torch.no_grad():
        want = _eager(model)(input_ids=x, output_attentions=True).attentions
    names = ["encoder.blocks.0", "encoder.blocks.1", "decoder.layers"]
    assert cache.stacks == names
    assert not [k for k in cache.keys() if "cross_attn" in k]
    for stack, w in zip(names, want, strict=True):
        _close(cache[K(stack, 0, "self_attn.pattern")], w)
        assert cache.metadata["stacks"][stack]["module"] == stack
    assert tuple(want[1].shape[-2:]) == (4, 8)  # queries pooled, keys the full sequence
    assert cache.metadata["stacks"]["encoder.blocks.1"]["tokens"] is None  # pooled positions
    assert cache.metadata["stacks"]["encoder.blocks.0"]["tokens"] == "source"


# -- several stacks and the chain ----------------------------------------------------------------


def _layer_io(model, paths: list[str], run) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer module's input and output as the model handed them (forward hooks)."""
    seen, handles = {}, []
    for p in paths:

        def hook(mod, args, kwargs, out, p=p):
            inp = args[0] if args else next(iter(kwargs.values()))
            seen.setdefault(p, []).append(
                (inp.detach().clone(), (out[0] if isinstance(out, tuple) else out).detach().clone())
            )

        handles.append(model.get_submodule(p).register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return seen


def test_canine_stacks_are_named_by_module_path_and_each_is_exact():
    model, x = canine(), _ids(2, 8)
    cache = probe.capture(model, x)
    with torch.no_grad():
        want = _eager(model)(input_ids=x, output_attentions=True).attentions
    # eager returns the deep encoder's layers, then the final character encoder's
    assert [s for s in cache.stacks if s != "initial_char_encoder.layer"] == [
        "encoder.layer",
        "final_char_encoder.layer",
    ]
    got = [
        cache[K("encoder.layer", 0, "self_attn.pattern")],
        cache[K("encoder.layer", 1, "self_attn.pattern")],
    ]
    got.append(cache[K("final_char_encoder.layer", 0, "self_attn.pattern")])
    for g, w in zip(got, want[-3:], strict=True):
        _close(g, w)
    assert cache.metadata["stacks"]["encoder.layer"]["tokens"] is None  # downsampled molecules
    assert cache.metadata["stacks"]["final_char_encoder.layer"]["tokens"] == "source"


class _Between(toys.LM):
    """Scales the stream between its blocks: no layer's input is the previous one's output."""

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x) * 0.5
        return self.head(x)


def test_chain_is_claimed_exactly_where_each_layers_output_is_the_next_layers_input():
    between = toys.seeded(
        lambda: _Between([toys.Block(toys.SoftmaxAttention(), toys.MLP()) for _ in range(2)])
    )
    cases = [(albert, _ids()), (canine, _ids(2, 8)), (xlm, _ids()), (lambda: between, _ids(1, 5, 2) % 50)]
    for build, x in cases:
        model = build()
        cache = probe.capture(model, x)
        for stack, info in cache.metadata["stacks"].items():
            n = info["layers"]
            holds = all(
                torch.equal(cache[K(stack, i, "resid_post")], cache[K(stack, i + 1, "resid_pre")])
                for i in range(n - 1)
            )
            assert info["chain"] is holds, (type(model).__name__, stack)
    assert cache.metadata["stacks"]["decoder"]["chain"] is False  # the scaled stream
    io = _layer_io(between, ["blocks.0", "blocks.1"], lambda: between(x))
    torch.testing.assert_close(io["blocks.1"][0][0], io["blocks.0"][0][1] * 0.5, atol=0, rtol=0)


# -- a layer is one call of a block ---------------------------------------------------------------


def test_albert_gets_one_layer_per_call_of_its_shared_module():
    model, x = albert(3), _ids()
    cache = probe.capture(model, x)
    with torch.no_grad():
        want = _eager(model)(input_ids=x, output_attentions=True).attentions
    assert cache.n_layers("encoder") == 3
    for i in range(3):
        _close(cache[K("encoder", i, "self_attn.pattern")], want[i])
        entry = cache.metadata["layers"][i]
        assert (entry["module"], entry["call"], entry["layer"]) == ("encoder.albert_layer_groups.0", i, i)
    io = _layer_io(model, ["encoder.albert_layer_groups.0"], lambda: model(input_ids=x))
    for i, (inp, out) in enumerate(io["encoder.albert_layer_groups.0"]):
        torch.testing.assert_close(cache[K("encoder", i, "resid_pre")], inp, atol=0, rtol=0)
        torch.testing.assert_close(cache[K("encoder", i, "resid_post")], out, atol=0, rtol=0)
    # a selection picks calls
    picked = probe.capture(model, x, layers=[1])
    _close(picked[K("encoder", 1, "self_attn.pattern")], want[1])
    assert not [k for k in picked.keys() if ".blocks.0." in k or ".blocks.2." in k]


class Looped(nn.Module):
    """A Universal-Transformer-style loop: one block (not in a list) run ``steps`` times."""

    def __init__(self, steps: int = 3, vocab: int = 50):
        super().__init__()
        self.steps = steps
        self.emb = nn.Embedding(vocab, toys.D)
        self.block = toys.Block(toys.SoftmaxAttention(), toys.MLP())
        self.head = nn.Linear(toys.D, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for _ in range(self.steps):
            x = self.block(x)
        return self.head(x)


@pytest.mark.parametrize("in_list", [False, True])
def test_a_looped_block_gets_one_layer_per_step(in_list):
    torch.manual_seed(0)
    model = Looped().eval()
    if in_list:  # the same block held in a one-element ModuleList and run from there
        model.blocks = nn.ModuleList([model.block])
        del model.block
        model.forward = lambda ids, m=model: m.head(_run_list(m, m.emb(ids)))
    attn = model.get_submodule("blocks.0.attn" if in_list else "block.attn")
    weights = []
    h = attn.register_forward_hook(lambda m, a, o: weights.append(m.weights.detach().clone()))
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    try:
        cache = probe.capture(model, ids)
    finally:
        h.remove()
    (stack,) = cache.stacks
    assert cache.n_layers(stack) == 3 and len(weights) == 3
    for i in range(3):
        torch.testing.assert_close(cache[K(stack, i, "self_attn.pattern")], weights[i], atol=0, rtol=0)
        assert cache.metadata["layers"][i]["call"] == i
    assert cache.metadata["stacks"][stack]["chain"] is True


def _run_list(m, x):
    for _ in range(m.steps):
        x = m.blocks[0](x)
    return x


def test_funnel_block_repeats_are_layers_per_call():
    model, x = funnel(repeats=[2, 1]), _ids(2, 8)
    cache = probe.capture(model, x)
    with torch.no_grad():
        want = _eager(model)(input_ids=x, output_attentions=True).attentions
    assert cache.n_layers("encoder.blocks.0") == 2
    assert [e["call"] for e in cache.metadata["layers"] if e["stack"] == "encoder.blocks.0"] == [0, 1]
    _close(cache[K("encoder.blocks.0", 0, "self_attn.pattern")], want[0])
    _close(cache[K("encoder.blocks.0", 1, "self_attn.pattern")], want[1])
    _close(cache[K("encoder.blocks.1", 0, "self_attn.pattern")], want[2])


# -- parallel per-sublayer lists ------------------------------------------------------------------


@pytest.mark.parametrize("build", [xlm, flaubert])
def test_parallel_per_sublayer_lists_are_grouped_by_index_into_layers(build):
    model, x = build(), _ids()
    mask = torch.ones_like(x)
    mask[1, 5:] = 0  # padding: the model zeroes padded positions after each layer, in place
    paths = ["attentions.0", "attentions.1", "layer_norm1.0", "layer_norm1.1"]
    io = _layer_io(model, paths, lambda: model(input_ids=x, attention_mask=mask))
    with torch.no_grad():
        out = model(input_ids=x, attention_mask=mask).last_hidden_state
        want = _eager(model)(input_ids=x, attention_mask=mask, output_attentions=True).attentions
    with torch.no_grad(), probe.trace(model) as t:
        model(input_ids=x, attention_mask=mask)
    cache = t.cache
    assert cache.n_layers("encoder") == 2 and cache.metadata["stacks"]["encoder"]["chain"] is True
    assert cache.metadata["layers"][0]["module"] == "attentions.0, layer_norm1.0, ffns.0, layer_norm2.0"
    for i in range(2):
        _close(cache[K("encoder", i, "self_attn.pattern")], want[i])
        pre = io[f"attentions.{i}"][0][0]
        post = io["attentions.1"][0][0] if i == 0 else out
        torch.testing.assert_close(cache[K("encoder", i, "resid_pre")], pre, atol=0, rtol=0)
        torch.testing.assert_close(cache[K("encoder", i, "resid_post")], post, atol=0, rtol=0)
        # post-norm: each delta is the change of the stream across its sublayer (and its norm)
        after_attn = io[f"layer_norm1.{i}"][0][1]
        torch.testing.assert_close(cache[K("encoder", i, "self_attn.delta")], after_attn - pre)
        torch.testing.assert_close(cache[K("encoder", i, "mlp.delta")], post - after_attn)


# -- capture under load and nesting --------------------------------------------------------------


class _FirstCallerWaits(nn.Module):
    """Holds the first thread that runs it until ``release`` is set; later callers pass."""

    def __init__(self):
        super().__init__()
        self.entered, self.release, self.first = threading.Event(), threading.Event(), None

    def forward(self, x):
        if self.first is None:
            self.first = threading.get_ident()
        if self.first == threading.get_ident():
            self.entered.set()
            self.release.wait(timeout=60)
        return x


def test_threads_capturing_one_model_each_see_only_their_own_forward():
    model = toys.seeded(lambda: toys.LM([toys.Block(toys.SoftmaxAttention(), toys.MLP()) for _ in range(2)]))
    gate = _FirstCallerWaits()
    model.blocks[1].register_forward_pre_hook(lambda m, a: gate(a[0]))
    seen: dict[int, list] = {}  # thread -> what each layer computed there, in order (the oracle)
    for b in model.blocks:

        def hook(m, args, out):
            seen.setdefault(threading.get_ident(), []).append(
                (args[0].clone(), out.clone(), m.attn.weights.clone())
            )

        b.register_forward_hook(hook)
    texts = {0: torch.randint(0, 50, (1, 5)), 1: torch.randint(0, 50, (2, 9))}
    caches, errors, idents = {}, [], {}

    def run(k):
        idents[k] = threading.get_ident()
        try:
            caches[k] = probe.capture(model, texts[k])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    first = threading.Thread(target=run, args=(0,))
    first.start()
    assert gate.entered.wait(60)  # the first capture is inside its forward, between layers
    second = threading.Thread(target=run, args=(1,))
    second.start()
    second.join(60)
    gate.release.set()
    first.join(60)
    assert not errors, errors
    for k in (0, 1):
        layers = seen[idents[k]]
        assert caches[k].n_layers("decoder") == 2 and len(layers) == 2
        for i, (pre, post, weights) in enumerate(layers):
            torch.testing.assert_close(
                caches[k][K("decoder", i, "self_attn.pattern")], weights, atol=0, rtol=0
            )
            torch.testing.assert_close(caches[k][K("decoder", i, "resid_pre")], pre, atol=0, rtol=0)
            torch.testing.assert_close(caches[k][K("decoder", i, "resid_post")], post, atol=0, rtol=0)


def test_a_capture_inside_trace_on_the_same_model_says_so():
    model = toys.moe_lm()
    ids = torch.randint(0, 50, (1, 5))
    with torch.no_grad(), probe.trace(model) as t:
        with pytest.raises(
            ProbeError, match=r"already capturing this LM object in this thread.*inside probe\.trace"
        ):
            probe.capture(model, ids)
        model(ids)
    assert t.cache.n_layers("decoder") == 2  # the outer capture is unharmed


def test_a_lazily_read_cache_whose_file_was_truncated_is_an_error_not_a_crash(tmp_path):
    out = tmp_path / "run.safetensors"
    probe.capture(toys.moe_lm(), torch.randint(0, 50, (1, 5)), out=out)
    cache = probe.load(out)
    key = cache.keys()[-1]
    cache[key]  # readable
    with open(out, "r+b") as f:
        f.truncate(out.stat().st_size // 2)
    with pytest.raises(ProbeError, match=r"run\.safetensors was truncated after it was opened"):
        cache[key]


class _BetweenNormed(_Between):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.ln_f = nn.LayerNorm(toys.D)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x) * 0.5
        return self.head(self.ln_f(x))


def test_attribution_says_when_the_stack_does_not_chain():
    model = toys.seeded(
        lambda: _BetweenNormed([toys.Block(toys.SoftmaxAttention(), toys.MLP()) for _ in range(2)])
    )
    ids = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(3))
    att = probe.logit_lens(model, ids, norm=model.ln_f, unembed=model.head).attribution
    assert any("do not chain" in n for n in att.notes)
    assert att.max_error > 1e-2  # indeed: the parts miss the model's logit (the scaling between layers)
