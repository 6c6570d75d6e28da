"""Direct I/O for streamed captures (probe.cache.perf.direct): the same bytes as through the page cache."""

from __future__ import annotations

import errno
import os
import random

import pytest
import torch
from safetensors.torch import load
from toys import ToyLM, streamed_both_ways

import probe
from probe.cache.perf import OPTIONS, direct
from probe.cache.perf.direct import ALIGN, DataWriter, aligned_empty


def _tensors(rng: random.Random) -> list[torch.Tensor]:
    """Tensors of odd and aligned sizes, at aligned and unaligned addresses, of several dtypes."""
    out = []
    for _ in range(rng.randint(1, 8)):
        n = rng.choice([1, 3, 100, 1024, 4096, 5000, 1 << 20, (1 << 20) + 7, 6 << 20])
        dtype = rng.choice([torch.float32, torch.uint8, torch.bfloat16, torch.int64])
        g = torch.Generator().manual_seed(rng.randint(0, 10**6))
        values = torch.randint(0, 100, (n + 3,), generator=g).to(dtype)
        where = rng.random()
        if where < 0.4:
            t = aligned_empty((n,), dtype, "cpu").copy_(values[:n])
        elif where < 0.7:
            t = values[3:].contiguous()
        else:
            t = values[:n].clone()
        out.append(t)
    return out


def _write(path, tensors, start=ALIGN):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, b"H" * start)
        w = DataWriter(path, start, fd)
        used = w.direct
        for t in tensors:
            w.write(t)
        w.close()
    finally:
        os.close(fd)
    return path.read_bytes(), used


def _expected(tensors, start=ALIGN):
    return b"H" * start + b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)


def test_aligned_empty_starts_on_a_block():
    for dtype in (torch.float32, torch.float16, torch.int64, torch.uint8):
        t = aligned_empty((3, 5, 7), dtype, "cpu")
        assert t.shape == (3, 5, 7) and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % ALIGN == 0


@pytest.mark.parametrize("seed", range(12))
def test_direct_writes_the_bytes_the_page_cache_writes(seed, tmp_path, monkeypatch):
    tensors = _tensors(random.Random(seed))
    data, used = _write(tmp_path / "direct.bin", tensors)
    if not used:
        pytest.skip("this file system refuses O_DIRECT: only the page-cache path runs here")
    monkeypatch.setattr(OPTIONS, "direct_io", False)
    buffered, used_b = _write(tmp_path / "buffered.bin", tensors)
    assert not used_b
    assert data == buffered == _expected(tensors)  # also: cut back to its true length


def test_aligned_tensors_go_to_the_device_without_a_copy(tmp_path, monkeypatch):
    # a tensor whose address and file position line up is written from its own memory: no
    # staging buffer is ever made
    tensors = [aligned_empty((ALIGN * 3,), torch.uint8, "cpu").fill_(i) for i in range(4)]
    made = []
    real = direct.mmap.mmap
    monkeypatch.setattr(direct.mmap, "mmap", lambda *a, **k: made.append(1) or real(*a, **k))
    data, used = _write(tmp_path / "a.bin", tensors)
    if not used:
        pytest.skip("this file system refuses O_DIRECT")
    assert data == _expected(tensors) and made == []


def test_a_file_system_that_refuses_direct_writes_gets_the_same_bytes(tmp_path, monkeypatch):
    # O_DIRECT accepted by open() but refused by write() (EINVAL, some network file systems):
    # the rest goes through the page cache
    tensors = _tensors(random.Random(99))
    real = os.pwrite
    refused = []

    def pwrite(fd, data, offset):
        if fd in opened:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    real_open = os.open
    opened: set[int] = set()

    def open_(path, flags, *a):
        fd = real_open(path, flags, *a)
        if flags & getattr(os, "O_DIRECT", 0):
            opened.add(fd)
        return fd

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "pwrite", pwrite)
    data, used = _write(tmp_path / "r.bin", tensors)
    if not used:
        pytest.skip("this file system refuses O_DIRECT at open")
    assert refused and data == _expected(tensors)


def test_streamed_capture_is_the_same_file_with_and_without_direct_io(tmp_path, monkeypatch):
    torch.manual_seed(0)
    lm = ToyLM("sdpa_causal", n_layers=3, d=64).eval()
    ids = torch.randint(0, 40, (2, 64))  # 2·4·64·64·4 = 128 KB patterns: whole blocks, written direct
    files = streamed_both_ways(lm, ids, tmp_path, monkeypatch, OPTIONS, "direct_io")
    assert files[True] == files[False]
    memory = probe.capture(lm, ids)
    loaded = load(files[True])
    assert loaded.keys() == set(memory.keys())
    for k in memory.keys():
        assert torch.equal(loaded[k], memory[k])
