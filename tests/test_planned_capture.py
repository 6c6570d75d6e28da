"""Planned captures (probe/capture/engine/planned.py): the third capture of a model on one kind
of input runs with the plan the first two learnt and checked, and stores what the model computed;
a forward that differs from the plan is captured in full.

Oracles: the same weights run by transformers' eager attention (``output_attentions``), and hooks
written here on each layer, attention and MLP of a plain forward (the residual stream).
"""

from __future__ import annotations

import copy
import gc

import hf_fixtures as H
import pytest
import torch
import transformers as tf

import models
import probe
from models.tokenizers import CharTokenizer
from probe.cache.perf.options import using
from probe.cache.selection import Selection
from probe.capture.consumers.kept import parse_keep
from probe.capture.engine import planned

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
CHARS = "_abcdefghijklmnopqrstuvwxyz ."
TOK = CharTokenizer("chars", CHARS, pad_id=0)
TEXTS = ["the cat sat on the mat.", "a dog ran.", "birds sing at dawn and dusk.", "so it goes."]


def tiny_llama() -> tf.LlamaForCausalLM:
    return H.llama(len(CHARS))  # 2 layers, 8 heads over 2 key/value heads, sdpa


def kind(model, cache, heads=None, dtype=None):
    sel = Selection.parse(None, heads)
    return planned.key_for(
        model, cache.metadata, out=None, keep=parse_keep(None), kinds=None, selection=sel, dtype=dtype
    )


def eager_twin(model):
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    return twin


def stream(model, ids, mask):
    """Each layer's input and output, and its attention's and MLP's outputs, by hooks (a plain forward)."""
    got, hooks = {}, []
    for i, layer in enumerate(model.model.layers):

        def pre(m, args, kwargs, i=i):
            got[f"decoder.blocks.{i}.resid_pre"] = (args[0] if args else kwargs["hidden_states"]).clone()

        def post(m, args, out, name):
            got[name] = (out[0] if isinstance(out, tuple) else out).clone()

        hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        for mod, name in (
            (layer, "resid_post"),
            (layer.self_attn, "self_attn.delta"),
            (layer.mlp, "mlp.delta"),
        ):
            key = f"decoder.blocks.{i}.{name}"
            hooks.append(mod.register_forward_hook(lambda m, a, o, key=key: post(m, a, o, key)))
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        for h in hooks:
            h.remove()
    return got


def padded(meta):
    """The batch the capture ran: its texts' ids padded as the attention mask says."""
    mask = torch.tensor(meta["attention_mask"])
    ids = torch.full(mask.shape, meta.get("pad_id") or 0)
    ids[mask.bool()] = torch.tensor([i for row in meta["ids"] for i in row])
    return ids, mask


def assert_what_the_model_computed(model, cache, heads=None):
    ids, mask = padded(cache.metadata)
    with torch.no_grad():
        att = eager_twin(model)(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    for i, a in enumerate(att):
        got = cache[f"decoder.blocks.{i}.self_attn.pattern"].float()
        want = a if heads is None else a[:, heads]
        for b in range(ids.size(0)):
            real = mask[b].bool()  # every real query row, over every key
            torch.testing.assert_close(got[b][:, real], want[b][:, real], atol=2e-3, rtol=0)
    for key, t in stream(model, ids, mask).items():
        torch.testing.assert_close(cache[key].float(), t, atol=1e-6, rtol=0)


@pytest.mark.parametrize("texts", [TEXTS[0], TEXTS[:2]], ids=["one text", "padded batch"])
def test_the_third_capture_is_planned_and_stores_what_the_model_computed(texts):
    model = tiny_llama()
    first = probe.capture(model, texts, tokenizer=TOK)
    k = kind(model, first)
    assert planned.state(model, k) == "proposed"
    second = probe.capture(model, texts, tokenizer=TOK)
    assert planned.state(model, k) == "planned"
    other = [t[::-1] for t in texts] if isinstance(texts, list) else TEXTS[2]
    third = probe.capture(model, other, tokenizer=TOK)  # another input of the same kind
    assert planned.state(model, k) == "planned"  # (a forward unlike the plan drops it)
    for cache in (first, second, third):
        assert_what_the_model_computed(model, cache)
    with using(planned_capture=False):
        full = probe.capture(model, other, tokenizer=TOK)
    assert set(third.keys()) == set(full.keys()) and len(full.keys()) == 2 * 5
    assert third.metadata == full.metadata
    assert third.metadata["dtype"] == "float32" and third.metadata["attention_implementations"] == ["sdpa"]


def test_token_ids_are_planned_as_a_kind_of_their_own():
    model = tiny_llama()
    ids = [torch.tensor([TOK.encode(t)]) for t in TEXTS]
    caches = [probe.capture(model, i) for i in ids[:3]]
    assert planned.state(model, kind(model, caches[0])) == "planned"
    assert planned.state(model, kind(model, probe.capture(model, TEXTS[0], tokenizer=TOK))) == "proposed"
    for cache in caches:
        assert_what_the_model_computed(model, cache)


def test_heads_and_dtype_are_planned_as_the_full_capture_keeps_them():
    model = tiny_llama()
    for _ in range(3):
        cache = probe.capture(model, TEXTS[1], tokenizer=TOK, heads=[0, 3], dtype="bfloat16")
    assert planned.state(model, kind(model, cache, heads=(0, 3), dtype=torch.bfloat16)) == "planned"
    assert cache["decoder.blocks.1.self_attn.pattern"].shape[1] == 2
    assert {t.dtype for t in cache.values()} == {torch.bfloat16}
    with using(planned_capture=False):
        full = probe.capture(model, TEXTS[1], tokenizer=TOK, heads=[0, 3], dtype="bfloat16")
    assert full.metadata == cache.metadata
    ids = torch.tensor(cache.metadata["ids"])
    with torch.no_grad():
        att = eager_twin(model)(input_ids=ids, output_attentions=True).attentions
    for i, a in enumerate(att):
        want = a[:, [0, 3]].to(torch.bfloat16).float()
        got = cache[f"decoder.blocks.{i}.self_attn.pattern"].float()
        torch.testing.assert_close(got, want, atol=1e-2, rtol=0)
    for key, t in stream(model, ids, torch.ones_like(ids)).items():
        assert torch.equal(cache[key], t.to(torch.bfloat16))


def planned_model():
    model = tiny_llama()
    for _ in range(2):
        cache = probe.capture(model, TEXTS[0], tokenizer=TOK)
    k = kind(model, cache)
    assert planned.state(model, k) == "planned"
    return model, k


def no_hooks_left(model) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_forward_unlike_the_plan_is_captured_in_full():
    # a module of the plan replaced: its hooks never run, so the planned capture is given up
    model, k = planned_model()
    model.model.layers[1].mlp = copy.deepcopy(model.model.layers[1].mlp)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(3.0)
    cache = probe.capture(model, TEXTS[2], tokenizer=TOK)
    assert planned.state(model, k) == "refused"
    assert_what_the_model_computed(model, cache)
    assert no_hooks_left(model)


def test_a_model_switched_to_eager_attention_is_captured_in_full():
    model, k = planned_model()
    model.set_attn_implementation("eager")  # no SDPA call in the attention sublayers any more
    cache = probe.capture(model, TEXTS[3], tokenizer=TOK)
    assert planned.state(model, k) == "refused"
    assert cache.metadata["attention_implementations"] == ["softmax"]
    assert_what_the_model_computed(model, cache)


def test_a_layer_list_that_grew_is_captured_in_full():
    model, k = planned_model()
    model.model.layers.append(copy.deepcopy(model.model.layers[1]))
    model.model.layers[2].self_attn.layer_idx = 2
    model.config.num_hidden_layers = 3
    cache = probe.capture(model, TEXTS[2], tokenizer=TOK)
    assert planned.state(model, k) == "refused"
    assert cache.metadata["stacks"]["decoder"]["layers"] == 3
    assert_what_the_model_computed(model, cache)


def test_a_planned_forward_that_raises_leaves_no_hook_or_mode_behind():
    model, _k = planned_model()
    mlp = model.model.layers[1].mlp
    real = mlp.forward
    mlp.forward = lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        probe.capture(model, TEXTS[2], tokenizer=TOK)
    assert no_hooks_left(model) and torch._C._len_torch_function_stack() == 0
    mlp.forward = real
    assert_what_the_model_computed(model, probe.capture(model, TEXTS[2], tokenizer=TOK))
    assert no_hooks_left(model) and torch._C._len_torch_function_stack() == 0


def test_softmax_models_and_switched_off_plans_are_never_planned():
    gpt = models.load("minigpt")  # its attention is a softmax the tracer reads, not an SDPA call
    caches = [probe.capture(gpt, "the cat sat on the mat.") for _ in range(3)]
    assert planned.state(gpt, kind(gpt, caches[0])) == "refused"
    model = tiny_llama()
    with using(planned_capture=False):
        for _ in range(3):
            cache = probe.capture(model, TEXTS[0], tokenizer=TOK)
    assert kind(model, cache) is None or planned.state(model, kind(model, cache)) == "none"


def test_patterns_in_mapped_memory_equal_softmax_written_here():
    # a pattern of at least 2 MiB lives in its own zero-filled mapping: the keys no query may
    # see are left as the kernel gave them, so they must read as zeros
    torch.manual_seed(1)
    q, k = torch.randn(1, 4, 400, 16), torch.randn(1, 2, 400, 16)
    from probe.cache.perf import heap
    from probe.capture.patterns import sdpa_weights

    got = sdpa_weights(q, k, None, is_causal=True, empty=heap.mapped_empty)
    assert got.numel() * 4 >= heap.HUGE
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / 4.0
    scores = scores.masked_fill(torch.ones(400, 400, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(got, scores.softmax(-1), atol=1e-6, rtol=0)
    assert torch.count_nonzero(got.triu(1)) == 0
    small = heap.mapped_empty((3, 5), torch.float32, "cpu")
    assert small.shape == (3, 5) and torch.count_nonzero(small) == 0


def test_a_system_out_of_mappings_gets_heap_memory(monkeypatch):
    from probe.cache.perf import heap

    def refuse(*a, **k):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(heap.mmap, "mmap", refuse)
    t = heap.mapped_empty((4, 400, 400), torch.float32, "cpu")
    assert t.shape == (4, 400, 400) and torch.count_nonzero(t) == 0


def test_a_planned_capture_with_mapped_patterns_saves_and_loads(tmp_path):
    model = tiny_llama()
    model.config.max_position_embeddings = 512  # rotary: any length; the config's limit is probe's check
    text = "the cat sat on the mat. " * 12  # 288 tokens: 8 heads x 288 x 288 floats, 2.6 MB a pattern
    for _ in range(3):
        cache = probe.capture(model, text, tokenizer=TOK)
    assert planned.state(model, kind(model, cache)) == "planned"
    assert cache["decoder.blocks.0.self_attn.pattern"].numel() * 4 >= 2 << 20
    cache.save(tmp_path / "c.safetensors")
    back = probe.load(tmp_path / "c.safetensors")
    assert set(back.keys()) == set(cache.keys())
    assert all(torch.equal(back[k], cache[k]) for k in cache.keys())
    assert_what_the_model_computed(model, cache)


# -- memory of its own: residual copies and patterns in pool mappings ---------------------------
@pytest.fixture
def pooled(monkeypatch):
    """Every residual and pattern of a planned capture in pool mappings (the tiny model's tensors
    are far below the size where that starts), the pool empty before and after."""
    from probe.cache.perf import pool

    monkeypatch.setattr(planned, "POOL_MIN", 0)
    gc.collect()  # caches of earlier tests give their mappings back first
    pool.release()
    yield pool
    pool.release()


def test_pooled_captures_store_what_the_model_computed_after_a_scribbled_cache(pooled):
    model, k = planned_model()
    model.config.max_position_embeddings = 512  # rotary: any length; the config's limit is probe's check
    text = "the cat sat on the mat. " * 12  # 288 tokens: blocks of query rows that see only some keys
    probe.capture(model, text, tokenizer=TOK)  # after a pause: only the patterns in the pool...
    first = probe.capture(model, text, tokenizer=TOK)  # ...then, captures in a row, everything
    assert planned.state(model, k) == "planned"
    assert_what_the_model_computed(model, first)
    mine = {t.untyped_storage().data_ptr() for t in first.values()}
    assert all(pooled.lends(p) for p in mine)  # every tensor in a mapping of the pool
    for t in first.values():  # whatever a user wrote into a dropped cache...
        t.fill_(float("nan"))
    del first
    assert pooled.kept_bytes() > 0
    second = probe.capture(model, text, tokenizer=TOK)
    assert planned.state(model, k) == "planned"
    assert {t.untyped_storage().data_ptr() for t in second.values()} & mine  # ...comes back here
    assert_what_the_model_computed(model, second)  # ...and none of it shows
    for i in range(2):
        assert torch.count_nonzero(second[f"decoder.blocks.{i}.self_attn.pattern"].triu(1)) == 0
    with using(planned_capture=False):
        full = probe.capture(model, text, tokenizer=TOK)
    for key in full.keys():
        if not key.endswith("pattern"):
            assert torch.equal(second[key], full[key]), key


def test_after_a_pause_the_model_residuals_are_kept_and_then_copied(pooled):
    model, _k = planned_model()
    pooled.release()  # nothing kept: the pool has been idle
    cold = probe.capture(model, TEXTS[2], tokenizer=TOK)
    lent = {k: pooled.lends(t.untyped_storage().data_ptr()) for k, t in cold.items()}
    assert all(lent[k] for k in lent if k.endswith("pattern"))
    assert not any(lent[k] for k in lent if not k.endswith("pattern"))  # the model's own tensors
    del cold
    warm = probe.capture(model, TEXTS[2], tokenizer=TOK)
    assert all(pooled.lends(t.untyped_storage().data_ptr()) for t in warm.values())
    assert_what_the_model_computed(model, warm)


def test_a_layer_input_is_kept_once_and_saves_under_both_keys(pooled, tmp_path):
    model, _k = planned_model()
    cache = probe.capture(model, TEXTS[1], tokenizer=TOK)
    # the second layer's input is the first layer's output: one tensor, under both keys
    assert cache["decoder.blocks.1.resid_pre"] is cache["decoder.blocks.0.resid_post"]
    cache.save(tmp_path / "c.safetensors")
    back = probe.load(tmp_path / "c.safetensors")
    assert set(back.keys()) == set(cache.keys())
    assert all(torch.equal(back[k], cache[k]) for k in cache.keys())


def test_a_tensor_changed_in_place_after_its_copy_is_not_planned(pooled):
    # the attention's output is bumped in place (same values, a new version) after probe copied
    # it and before the layer adds it: the planned capture cannot vouch for it and is given up
    model, k = planned_model()
    layer = model.model.layers[0]
    seen = {}
    hooks = [
        layer.self_attn.register_forward_hook(lambda m, a, o: seen.update(out=o[0])),
        layer.mlp.register_forward_pre_hook(lambda m, a: seen["out"].mul_(1.0)),
    ]
    try:
        cache = probe.capture(model, TEXTS[3], tokenizer=TOK)
        assert planned.state(model, k) == "refused"
        # captured in full: the tracer sees the bump as an operation of the layer, and keeps
        # what it can name (the bumped output is no longer the attention's delta as it stood)
        ids = torch.tensor(cache.metadata["ids"])
        kept = {key: t for key, t in stream(model, ids, torch.ones_like(ids)).items() if key in cache}
        assert "decoder.blocks.1.mlp.delta" in kept
        for key, t in kept.items():
            torch.testing.assert_close(cache[key], t, atol=1e-6, rtol=0)
    except probe.ProbeError as e:  # or it refuses the tensor the model overwrote
        assert "in place" in str(e)
        assert planned.state(model, k) == "refused"
    finally:
        for h in hooks:
            h.remove()


def test_pool_mappings_refused_by_the_system_give_heap_memory(pooled, monkeypatch):
    model, _k = planned_model()

    def refuse(*a, **kw):
        raise OSError(12, "Cannot allocate memory")

    pooled.release()  # (the plan's second capture kept some)
    monkeypatch.setattr(pooled.mmap, "mmap", refuse)
    cache = probe.capture(model, TEXTS[2], tokenizer=TOK)
    assert not any(pooled.lends(t.untyped_storage().data_ptr()) for t in cache.values())
    assert_what_the_model_computed(model, cache)
