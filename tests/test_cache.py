"""The safetensors cache: keys, save/load round trips, lazy reads, streaming and bad files."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file
from toys import ToyLM, ToySeq2Seq, streamed_both_ways

import probe
from probe import Cache, ProbeError
from probe.cache.format import FORMAT_VERSION, key, parse_key, parse_name


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return ToyLM("sdpa_causal", n_layers=4).eval()


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(1)
    return torch.randint(0, 40, (2, 12))


def test_key_scheme():
    assert key("decoder", 3, "self_attn.pattern") == "decoder.blocks.3.self_attn.pattern"
    assert parse_key("encoder.blocks.11.resid_post") == ("encoder", 11, "resid_post")
    with pytest.raises(ValueError):
        key("two words", 0, "resid_pre")  # a stack is encoder, decoder or a module path
    with pytest.raises(ValueError):
        key("decoder", 0, "attn")
    with pytest.raises(ValueError):
        parse_key("blocks.0.attn")


@pytest.mark.parametrize(
    "k, stack, layer, name, role, index, field",
    [
        ("decoder.blocks.3.self_attn.pattern", "decoder", 3, "self_attn.pattern", "self", None, "pattern"),
        ("decoder.blocks.0.cross_attn.1.sink", "decoder", 0, "cross_attn.1.sink", "cross", 1, "sink"),
        # a stack named by its module path, which may itself hold ".blocks.<i>."
        (
            "enc.blocks.0.blocks.2.self_attn.0.pattern",
            "enc.blocks.0",
            2,
            "self_attn.0.pattern",
            "self",
            0,
            "pattern",
        ),
        (
            "a.layer.blocks.1.self_attn.stat.entropy",
            "a.layer",
            1,
            "self_attn.stat.entropy",
            "self",
            None,
            "stat.entropy",
        ),
        ("decoder.blocks.1.self_attn.delta", "decoder", 1, "self_attn.delta", "self", None, None),
        ("decoder.blocks.1.mlp.delta.norm", "decoder", 1, "mlp.delta.norm", None, None, None),
    ],
)
def test_key_scheme_version_2(k, stack, layer, name, role, index, field):
    assert parse_key(k) == (stack, layer, name)
    assert key(stack, layer, name) == k
    n = parse_name(name)
    assert (n.role, n.index, n.field) == (role, index, field)


@pytest.mark.parametrize(
    "bad",
    [
        "decoder.blocks.0.self_attn.0.delta",  # deltas are per role, not per attention
        "decoder.blocks.0.self_attn.weights",  # not a field of the format
        "decoder.blocks.0.mlp.pattern",
        "decoder.blocks.x.self_attn.pattern",
        "9stack.blocks.0.resid_pre",
    ],
)
def test_key_scheme_refuses(bad):
    with pytest.raises(ValueError):
        parse_key(bad)


def test_several_attentions_of_a_kind(tmp_path):
    # a layer with two self-attentions: each under its own number, chosen with index=
    p0, p1 = torch.rand(1, 2, 3, 3).softmax(-1), torch.rand(1, 2, 3, 3).softmax(-1)
    meta = {
        "tokens": [["a", "b", "c"]],
        "stacks": {"decoder": {"layers": 1}},
        "layers": [
            {"stack": "decoder", "layer": 0, "self_attn.0": {"heads": 2}, "self_attn.1": {"heads": 2}}
        ],
    }
    tensors = {"decoder.blocks.0.self_attn.0.pattern": p0, "decoder.blocks.0.self_attn.1.pattern": p1}
    for cache in (Cache(tensors, meta), Cache(tensors, meta).save(tmp_path / "c.safetensors")):
        cache = probe.load(cache) if not isinstance(cache, Cache) else cache
        assert cache.attentions("decoder", 0) == [("self", 0), ("self", 1)]
        assert torch.equal(cache.pattern("decoder", 0, index=1), p1)
        with pytest.raises(ProbeError, match="computes 2 self-attentions; choose one with index="):
            cache.pattern("decoder", 0)


def test_stacks_named_by_module_path_keep_the_model_order(tmp_path):
    meta = {
        "tokens": [["a", "b"]],
        "stacks": {
            "initial.layer": {"layers": 1, "module": "initial.layer", "tokens": "source"},
            "pooled.layer": {"layers": 1, "module": "pooled.layer", "tokens": None},
        },
        "layers": [],
    }
    x = torch.rand(1, 2, 4)
    tensors = {
        "pooled.layer.blocks.0.resid_pre": torch.rand(1, 1, 4),  # one position: not tokens
        "initial.layer.blocks.0.resid_pre": x,
    }
    cache = probe.load(Cache(tensors, meta).save(tmp_path / "c.safetensors"))
    assert cache.stacks == ["initial.layer", "pooled.layer"]
    bad = dict(meta, stacks=dict(meta["stacks"], **{"pooled.layer": {"layers": 1, "tokens": "source"}}))
    with pytest.raises(ProbeError, match="spans \\[1\\] positions but the metadata has \\[2\\] tokens"):
        probe.load(Cache(tensors, bad).save(tmp_path / "d.safetensors"))


def test_keys_shapes_and_metadata(lm, ids):
    cache = probe.capture(lm, ids)
    names = ["self_attn.pattern", "resid_pre", "self_attn.delta", "mlp.delta", "resid_post"]
    assert cache.keys() == [f"decoder.blocks.{i}.{n}" for i in range(4) for n in names]
    assert cache["decoder.blocks.0.self_attn.pattern"].shape == (2, 4, 12, 12)
    assert cache["decoder.blocks.0.resid_pre"].shape == (2, 12, 32)
    meta = cache.metadata
    assert meta["model"]["class"].endswith("ToyLM")
    assert meta["attention_implementations"] == ["sdpa"]
    assert meta["probe_version"] == probe.__version__ and meta["format_version"] == FORMAT_VERSION
    assert meta["ids"] == ids.tolist()
    assert [e["module"] for e in meta["layers"]] == [f"blocks.{i}" for i in range(4)]


def test_save_load_roundtrip_is_exact_and_lazy(lm, ids, tmp_path):
    cache = probe.capture(lm, ids)
    path = cache.save(tmp_path / "run.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["run.safetensors"]  # no temp file left
    loaded = probe.load(path)
    assert loaded.keys() == cache.keys()
    assert loaded.metadata == json.loads(json.dumps(cache.metadata))
    for k in cache.keys():
        assert torch.equal(loaded[k], cache[k])
    assert torch.equal(loaded.pattern("decoder", 2, head=1, batch=0), cache.pattern("decoder", 2)[0, 1])
    assert loaded.shape("decoder.blocks.0.self_attn.pattern") == (2, 4, 12, 12)
    # it is an ordinary safetensors file, readable without probe
    plain = load_file(path)
    assert torch.equal(plain["decoder.blocks.1.mlp.delta"], cache["decoder.blocks.1.mlp.delta"])


def test_streamed_capture_equals_in_memory_and_writes_as_it_goes(lm, ids, tmp_path, monkeypatch):
    from probe.cache.perf import OPTIONS

    # written in the capture's own thread, so what layers 0-2 put is in the file when layer 3
    # starts (less than one 4096-byte block may wait for the next tensor, fewer bytes than the
    # header's reservation); the I/O thread's lag is covered by the tests below
    monkeypatch.setattr(OPTIONS, "io_thread", False)
    out = tmp_path / "stream.safetensors"
    sizes = []

    def look(module, args):  # before layer 3 runs, layers 0-2 must already be on disk
        tmp = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        sizes.append(sum(p.stat().st_size for p in tmp))

    h = lm.blocks[3].register_forward_pre_hook(look)
    try:
        streamed = probe.capture(lm, ids, out=out)
    finally:
        h.remove()
    layer_bytes = 2 * 4 * 12 * 12 * 4 + 4 * 2 * 12 * 32 * 4
    assert sizes and sizes[0] >= 3 * layer_bytes
    assert streamed.path == out and out.exists()
    memory = probe.capture(lm, ids)
    assert streamed.keys() == memory.keys()
    for k in memory.keys():
        assert torch.equal(streamed[k], memory[k])
    assert [p.name for p in tmp_path.iterdir()] == ["stream.safetensors"]


def test_header_larger_than_reservation_still_valid(tmp_path):
    from probe.cache.writer import FileSink

    sink = FileSink(tmp_path / "x.safetensors", reserve=1024)
    handles = {sink.put(torch.full((3,), float(i))): f"t{i:03d}" for i in range(200)}
    sink.finish(handles, {"format": "probe-cache", "format_version": "1", "probe": "{}"})
    data = load_file(tmp_path / "x.safetensors")
    assert len(data) == 200 and torch.equal(data["t123"], torch.full((3,), 123.0))


def test_encoder_decoder_cache_roundtrip(tmp_path):
    torch.manual_seed(5)
    model = ToySeq2Seq().eval()
    src, tgt = torch.tensor([[3, 4, 5, 0]]), torch.tensor([[1, 2, 3]])
    with torch.no_grad(), probe.trace(model, out=tmp_path / "s2s.safetensors") as t:
        model(src, tgt)
    cache = t.cache
    assert cache.stacks == ["encoder", "decoder"]
    assert cache.pattern("decoder", 1, "cross").shape == (1, 4, 3, 4)
    with pytest.raises(KeyError, match="not in this cache"):
        cache.pattern("encoder", 0, "cross")


def test_failed_capture_leaves_no_file(tmp_path):
    class Boom(ToyLM):
        def forward(self, ids):
            super().forward(ids)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        probe.capture(Boom().eval(), torch.randint(0, 40, (1, 5)), out=tmp_path / "b.safetensors")
    assert list(tmp_path.iterdir()) == []


# -- bad files ---------------------------------------------------------------------------------


def test_load_missing_file(tmp_path):
    with pytest.raises(ProbeError, match="no such file"):
        probe.load(tmp_path / "nope.safetensors")


def test_load_not_safetensors(tmp_path):
    p = tmp_path / "notes.safetensors"
    p.write_text("hello, this is not a cache at all")
    with pytest.raises(ProbeError, match="not a safetensors file"):
        probe.load(p)
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"abc")
    with pytest.raises(ProbeError, match="not a safetensors file"):
        probe.load(tiny)


def test_load_truncated(lm, ids, tmp_path):
    path = probe.capture(lm, ids).save(tmp_path / "full.safetensors")
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ProbeError, match="truncated"):
        probe.load(cut)
    (n,) = struct.unpack("<Q", data[:8])
    head_only = tmp_path / "head.safetensors"
    head_only.write_bytes(data[: 8 + n // 2])
    with pytest.raises(ProbeError, match="truncated"):
        probe.load(head_only)


def test_load_safetensors_that_is_not_a_cache(tmp_path):
    p = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, p)
    with pytest.raises(ProbeError, match="not a probe cache"):
        probe.load(p)


def test_load_newer_format_version(tmp_path):
    p = tmp_path / "future.safetensors"
    meta = {"format": "probe-cache", "format_version": str(FORMAT_VERSION + 1), "probe": "{}"}
    save_file({"decoder.blocks.0.resid_pre": torch.zeros(1, 1, 2)}, p, metadata=meta)
    with pytest.raises(ProbeError, match="newer than this probe reads"):
        probe.load(p)


def test_real_token_flags_handle_padded_and_unpadded_rows():
    from probe.cache.format import real_token_flags

    meta = {"attention_mask": [[0, 1, 1], [1, 1, 1]], "special_tokens_mask": [[1, 1, 0], [1, 0, 1]]}
    assert real_token_flags(meta, 0) == [1, 0]  # left padding dropped
    assert real_token_flags(meta, 1) == [1, 0, 1]
    old = {"attention_mask": [[1, 1, 0]], "special_tokens_mask": [[1, 0]]}  # unpadded rows (older caches)
    assert real_token_flags(old, 0) == [1, 0]
    tgt = {"target_attention_mask": [[1, 0]], "target_special_tokens_mask": [[1, 1]]}
    assert real_token_flags(tgt, 0, prefix="target_") == [1]


# -- the I/O thread of streamed captures ----------------------------------------------------------


class _InplaceBlock(torch.nn.Module):
    """``x += attn(ln(x))`` on its own input: the previous layer's output is overwritten in place."""

    def __init__(self, d: int, h: int):
        super().__init__()
        from toys import MLP, Attention

        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn, self.mlp = Attention(d, h, "sdpa_causal"), MLP(d)

    def forward(self, x):
        x += self.attn(self.ln1(x))
        x += self.mlp(self.ln2(x))
        return x


def _inplace_lm():
    torch.manual_seed(3)
    lm = ToyLM("sdpa_causal", n_layers=3).eval()
    lm.blocks = torch.nn.ModuleList(_InplaceBlock(32, 4) for _ in range(3))
    return lm


@pytest.mark.parametrize("kind", ["sdpa_causal", "F.softmax"])
def test_io_thread_writes_the_same_bytes(kind, ids, tmp_path, monkeypatch):
    from probe.cache.perf import OPTIONS

    torch.manual_seed(0)
    lm = ToyLM(kind, n_layers=4).eval()
    files = streamed_both_ways(lm, ids, tmp_path, monkeypatch, OPTIONS, "io_thread")
    assert files[True] == files[False]


def test_io_thread_copies_what_the_model_overwrites_later(ids, tmp_path, monkeypatch):
    # each block adds into its input in place, overwriting the previous block's output after it
    # was queued; a slow disk makes sure the write happens after the overwrite
    import time

    from probe.cache import writer

    lm = _inplace_lm()
    want = {}
    for i, b in enumerate(lm.blocks):
        b.register_forward_pre_hook(lambda m, a, i=i: want.__setitem__(("pre", i), a[0].clone()))
        b.register_forward_hook(lambda m, a, o, i=i: want.__setitem__(("post", i), o.clone()))
    write = writer.FileSink._write

    def slow_write(self, t):
        time.sleep(0.02)
        write(self, t)

    monkeypatch.setattr(writer.FileSink, "_write", slow_write)
    cache = probe.capture(lm, ids, out=tmp_path / "c.safetensors")
    for i in range(3):
        assert torch.equal(cache[f"decoder.blocks.{i}.resid_pre"], want["pre", i])
        assert torch.equal(cache[f"decoder.blocks.{i}.resid_post"], want["post", i])


@pytest.mark.parametrize("fail_at", ["first", "last"])
def test_an_error_on_the_io_thread_is_a_probe_error(fail_at, lm, ids, tmp_path, monkeypatch):
    import errno

    from probe.cache import writer

    n_writes = 4 * 4  # 4 layers: pattern, resid_pre, self_attn.delta, mlp.delta, resid_post
    n_writes += 4
    calls = []

    def failing_write(self, t):
        calls.append(1)
        if fail_at == "first" or len(calls) == n_writes:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer.FileSink, "_write", failing_write)
    out = tmp_path / "c.safetensors"
    with pytest.raises(ProbeError, match="No space left on device"):
        probe.capture(lm, ids, out=out)
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone, nothing at `out`
    assert fail_at == "first" or len(calls) == n_writes


def test_memory_capture_refuses_a_tensor_the_model_overwrote(ids, tmp_path):
    # kept without a copy in memory, the overwritten layer output would be silently wrong
    lm = _inplace_lm()
    with pytest.raises(ProbeError, match=r"overwrote decoder\.blocks\.0\.resid_post in place.*out="):
        probe.capture(lm, ids)


def test_streamed_pattern_buffers_switching_between_causal_and_full_attention(tmp_path):
    # the two reused buffers skip re-zeroing the unseen keys only after a causal fill: a buffer
    # last filled by full (unmasked) attention must be zeroed again
    import torch.nn.functional as F

    torch.manual_seed(6)
    lm = ToyLM("sdpa_causal", n_layers=4).eval()
    lm.pos = torch.nn.Embedding(200, 32)  # longer than one chunk of query rows (128)
    ids = torch.randint(0, 40, (1, 200))
    attn = lm.blocks[1].attn  # layer 1 fills the second buffer; layer 3 reuses it

    def full(x):  # no mask at all: every query sees every key
        q, k, v = attn.qkv(x)
        y = F.scaled_dot_product_attention(q, k, v)
        return attn.o(y.transpose(1, 2).reshape(x.shape))

    attn.forward = full
    streamed = probe.capture(lm, ids, out=tmp_path / "c.safetensors")
    memory = probe.capture(lm, ids)
    stack = streamed.stacks[0]  # not all causal: named an encoder
    for i in range(4):
        p = streamed.pattern(stack, i)
        assert torch.equal(p, memory.pattern(stack, i))
        torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[:-1]), atol=1e-5, rtol=0)
        if i != 1:  # causal layers see nothing ahead
            assert torch.count_nonzero(p.triu(1)) == 0, i
    assert torch.count_nonzero(streamed.pattern(stack, 1).triu(1)) > 0
