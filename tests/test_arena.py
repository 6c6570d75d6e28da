"""probe.capture.arena: zero-filled huge-page pattern storage that dies with its tensors."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from probe.capture import arena

linux = pytest.mark.skipif(not arena.AVAILABLE, reason="no MADV_HUGEPAGE on this platform")


@pytest.fixture(autouse=True)
def _on(monkeypatch):
    monkeypatch.setattr(arena, "ENABLED", True)  # opt-in (see arena.ENABLED): test it switched on


def _mapped(address: int) -> bool:
    """Whether ``address`` lies in one of this process's mappings (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= address < hi:
            return True
    return False


@linux
def test_zero_filled_and_unmapped_when_the_last_tensor_dies():
    shape = (1, 3, 1024, 1024)  # 12 MB
    gc.disable()  # the map must go with the tensors, not with a later garbage collection
    try:
        t = arena.zeroed(shape, torch.float32, "cpu")
        assert t is not None and t.shape == shape and t.is_contiguous()
        assert torch.count_nonzero(t) == 0  # a fresh map is zero-filled, as the recompute assumes
        t[0, 1].fill_(2.0)
        view = t[0, 1, 5]
        address = t.data_ptr()
        del t
        assert _mapped(address) and view.sum() == 2.0 * 1024  # a view keeps the storage alive
        del view
        assert not _mapped(address)
    finally:
        gc.enable()


def test_falls_back_where_it_does_not_pay_or_cannot_work(monkeypatch):
    assert arena.zeroed((4, 4), torch.float32, "cpu") is None  # small: the heap serves it anyway
    assert arena.zeroed((1, 4, 1024, 1024), torch.float32, "meta") is None  # not CPU memory
    monkeypatch.setattr(arena, "AVAILABLE", False)  # no MADV_HUGEPAGE (macOS, Windows)
    assert arena.zeroed((1, 4, 1024, 1024), torch.float32, "cpu") is None
    monkeypatch.setattr(arena, "AVAILABLE", True)
    monkeypatch.setattr(arena, "ENABLED", False)  # the default: the C allocator
    assert arena.zeroed((1, 4, 1024, 1024), torch.float32, "cpu") is None
