"""A dropped cache frees its memory at once: no reference cycle keeps captured tensors alive."""

import gc
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe


class Attn(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h, self.qkv, self.o = h, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.ln, self.attn = nn.LayerNorm(d), Attn(d, h)

    def forward(self, x):
        return x + self.attn(self.ln(x))


class Model(nn.Module):
    def __init__(self, d: int = 48, h: int = 12, n: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_dropped_cache_tensors_die_without_gc():
    torch.manual_seed(0)
    model = Model().eval()
    x = torch.randn(1, 64, 48)
    gc.collect()
    gc.disable()
    try:
        cache = probe.capture(model, x)
        refs = [weakref.ref(cache[k]) for k in cache.keys()]
        assert refs
        del cache
        alive = [r for r in refs if r() is not None]
        assert not alive, f"{len(alive)} of {len(refs)} captured tensors outlive `del cache`"
    finally:
        gc.enable()


def test_rss_returns_after_del_cache_without_gc():
    # 2 layers x 12 heads x 1024^2 float32 = 96 MB of patterns, blocks of 48 MB (above glibc's
    # mmap threshold, so freed blocks go straight back to the system)
    torch.manual_seed(0)
    model = Model().eval()
    x = torch.randn(1, 1024, 48)
    probe.capture(model, x)  # warm-up: lazy imports, allocator state
    gc.collect()
    gc.disable()
    try:
        before = _rss()
        cache = probe.capture(model, x)
        assert cache.pattern("decoder", 1).shape == (1, 12, 1024, 1024)
        del cache
        grew = (_rss() - before) / 2**20
    finally:
        gc.enable()
    assert grew < 50, f"RSS is {grew:.0f} MB above its pre-capture value after del cache"


def test_hf_model_rss_returns_after_del_cache_without_gc():
    # A GPT-2 keeps each layer's residuals (3 MB each at T = 1024, d 768) in the C heap, between
    # the model's own temporaries: once freed, they and the holes around them stay resident unless
    # the heap is trimmed (measured +256-297 MB here without it). The heap is trimmed before the
    # measurement too, so the capture starts from the state of a fresh process, the hardest case.
    tf = pytest.importorskip("transformers")
    from probe.cache.perf import heap

    if not heap.trim():
        pytest.skip("the C library is not glibc: no malloc_trim")
    T = 1024
    cfg = tf.GPT2Config(n_layer=4, n_embd=768, n_head=12, vocab_size=1000, n_positions=T, use_cache=False)
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 1000, (1, T), generator=torch.Generator().manual_seed(0))
    probe.capture(model, ids)  # warm-up: lazy imports, allocator state
    gc.collect()
    gc.disable()
    try:
        heap.trim()
        before = _rss()
        cache = probe.capture(model, ids)
        assert cache.pattern("decoder", 3).shape == (1, 12, T, T)
        assert cache["decoder.blocks.3.mlp.delta"].shape == (1, T, 768)
        del cache
        grew = (_rss() - before) / 2**20
    finally:
        gc.enable()
    assert grew < 50, f"RSS is {grew:.0f} MB above its pre-capture value after del cache"


def _live_storages(*sizes: int) -> list[int]:
    """For each size: distinct storages of live tensors (not parameters) of at least that many elements."""
    seen: list[set[int]] = [set() for _ in sizes]
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and not isinstance(o, nn.Parameter):
            try:
                ptr = o.untyped_storage().data_ptr()
            except RuntimeError:  # a FakeTensor an earlier torch.compile left alive: no memory of its own
                continue
            n = o.numel()
            for s, size in zip(seen, sizes, strict=True):
                if n >= size:
                    s.add(ptr)
    return [len(s) for s in seen]


def _storage_ptrs(size: int) -> set[int]:
    """The storages of live tensors (not parameters) of at least ``size`` elements."""
    return {
        o.untyped_storage().data_ptr()
        for o in gc.get_objects()
        if isinstance(o, torch.Tensor) and not isinstance(o, nn.Parameter) and o.numel() >= size
    }


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True])
def test_streamed_capture_holds_a_bounded_number_of_layers(background, monkeypatch, tmp_path):
    # gc is off, so anything kept by a reference cycle stays visible; at every tensor the writer
    # receives, count what is still alive: patterns ([1, 12, T, T]) and stream-sized tensors
    # ([1, T, d]). A capture that kept each layer until the end would grow with the layer count.
    from probe.cache import writer
    from probe.cache.perf import OPTIONS

    n_layers, T, d = 6, 256, 48
    torch.manual_seed(0)
    model = Model(d=d, n=n_layers).eval()
    x = torch.randn(1, T, d)
    probe.capture(model, x, out=tmp_path / "warm.safetensors")
    counts: list[list[int]] = []
    put = writer.FileSink.put

    def counting_put(self, tensor, *args, **kwargs):
        counts.append(_live_storages(12 * T * T, T * d))
        return put(self, tensor, *args, **kwargs)

    monkeypatch.setattr(writer.FileSink, "put", counting_put)
    monkeypatch.setattr(OPTIONS, "io_thread", background)
    gc.collect()
    gc.disable()
    try:
        probe.capture(model, x, out=tmp_path / "c.safetensors")
    finally:
        gc.enable()
    assert len(counts) == n_layers * 4  # pattern, resid_pre, self_attn.delta, resid_post
    patterns = max(c[0] for c in counts)
    assert patterns <= 2, f"{patterns} pattern buffers alive at once while streaming (at most 2)"
    if background:
        return  # copies queued for the I/O thread come and go with its timing (bounded by bytes)
    # stream-sized tensors alive (the input, the layer's stream and its copies) must not grow
    # with the layers written: compare the last layer with the second
    per_layer = [max(c[1] for c in counts[i : i + 4]) for i in range(0, len(counts), 4)]
    assert per_layer[-1] <= per_layer[1], f"stream-sized tensors alive per layer grow: {per_layer}"


def test_streamed_pattern_buffers_are_let_go_after_the_last_layer(monkeypatch, tmp_path):
    # what runs after the layers (here a head; an LM head's logits are a forward's peak) must not
    # run beside probe's two reused pattern buffers
    from probe.cache.perf import OPTIONS

    T, d = 256, 48
    torch.manual_seed(0)
    model = Model(d=d, n=4).eval()
    head = nn.Linear(d, d)
    alive = []
    # only storages born during the capture count: a tensor an earlier test left alive (a module's
    # cache, a fixture) is not one of probe's pattern buffers
    gc.collect()
    before = _storage_ptrs(12 * T * T)
    head.register_forward_pre_hook(lambda m, a: alive.append(len(_storage_ptrs(12 * T * T) - before)))
    wrapped = nn.Sequential(model, head)
    monkeypatch.setattr(OPTIONS, "io_thread", False)  # written at once: nothing left in flight
    gc.disable()
    try:
        probe.capture(wrapped, torch.randn(1, T, d), out=tmp_path / "c.safetensors")
    finally:
        gc.enable()
    assert alive == [0], f"{alive[0]} pattern buffers still alive when the head runs"
