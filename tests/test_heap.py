"""probe.cache.perf.heap: a dropped cache frees its tensors, then trims the heap when they were big."""

import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch

from probe.cache.perf import OPTIONS, heap, options


def test_heap_bytes_counts_each_small_cpu_storage_once():
    a = torch.zeros(1024, 256)  # 1 MiB
    big = torch.zeros(heap.MMAP_ALWAYS // 4)  # its own mmapped block: freed straight to the system
    # a view shares a's storage: counted once, as a's whole storage
    assert heap.heap_bytes([a, a[:10], big, 3, "x"]) == 1024 * 256 * 4


@pytest.mark.parametrize(("mib", "trims"), [(40, 1), (8, 0)])
def test_dropped_tensors_are_freed_before_the_trim(monkeypatch, mib, trims):
    calls = []
    refs: list[weakref.ref] = []

    def trim():
        # at the trim, the tensors it is meant to return are already gone
        calls.append([r() is None for r in refs])
        return True

    monkeypatch.setattr(heap, "trim", trim)
    d = heap.HeapTensors({f"t{i}": torch.zeros(1 << 18) for i in range(mib)})  # 1 MiB each
    refs.extend(weakref.ref(t) for t in d.values())
    gc.disable()  # no collection may help: the dict's own refcount ends it
    try:
        del d
    finally:
        gc.enable()
    assert len(calls) == trims
    assert all(r() is None for r in refs)
    if trims:
        assert all(calls[0])


def test_trim_is_glibc_malloc_trim_or_nothing(monkeypatch):
    named = "CS_GNU_LIBC_VERSION" in getattr(os, "confstr_names", {})
    glibc = named and (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    assert heap.trim() is glibc
    monkeypatch.setattr(OPTIONS, "heap_trim", False)
    assert heap.trim() is False


def test_a_trim_threshold_the_user_set_is_left_to_glibc():
    """MALLOC_TRIM_THRESHOLD_ (or the glibc.malloc.trim_threshold tunable) set: probe does not trim."""
    assert options._user_tuned({"MALLOC_TRIM_THRESHOLD_": "1000000000000"})
    assert options._user_tuned({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=9"})
    assert not options._user_tuned({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0", "PATH": "/bin"})
    code = "from probe.cache.perf import OPTIONS, heap; print(OPTIONS.heap_trim, heap.trim())"
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "1000000000000"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.stdout.split() == ["False", "False"], r.stderr
