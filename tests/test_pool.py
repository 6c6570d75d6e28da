"""The pool of mapped memory that a dropped planned capture hands on to the next one
(probe/cache/perf/pool.py): what comes back, what is kept, for how long, and what is unmapped."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from probe.cache.perf import heap, pool
from probe.cache.perf.options import using

MB = 1 << 20

pytestmark = pytest.mark.skipif(not pool.available(), reason="no anonymous memory mappings here")


@pytest.fixture(autouse=True)
def empty_pool():
    gc.collect()  # tensors of earlier tests give their mappings back first
    pool.release()
    yield
    pool.release()


def test_a_fresh_mapping_is_zeroed_and_a_kept_one_comes_back_as_it_was_left():
    t, zeroed = pool.take(3 * MB)
    assert zeroed and t.dtype == torch.uint8 and t.numel() == 3 * MB
    assert torch.count_nonzero(t) == 0
    address = t.data_ptr()
    assert pool.lends(address)
    t[:5] = 7
    del t
    assert not pool.lends(address) and pool.kept_bytes() == 3 * MB
    again, zeroed = pool.take(3 * MB)
    assert not zeroed and again.data_ptr() == address  # the same pages, not cleared
    assert again[:5].tolist() == [7] * 5
    assert pool.kept_bytes() == 0


def test_a_view_keeps_its_mapping_lent():
    t, _ = pool.take(2 * MB)
    address = t.data_ptr()
    part = t[MB:].view(torch.float32)
    del t
    gc.collect()
    assert pool.lends(address) and pool.kept_bytes() == 0
    del part
    assert not pool.lends(address) and pool.kept_bytes() == 2 * MB


def test_only_a_size_that_fits_is_taken_again():
    t, _ = pool.take(4 * MB)
    del t
    _, zeroed = pool.take(16 * MB)  # far larger: a fresh mapping
    assert zeroed and pool.kept_bytes() == 4 * MB
    small, zeroed = pool.take(4 * MB - 4096)  # a little smaller: the kept one serves it
    assert not zeroed and small.numel() == 4 * MB - 4096 and pool.kept_bytes() == 0


def test_what_is_kept_is_bounded_by_bytes_and_by_time():
    with using(pool_bytes=3 * MB):
        a, _ = pool.take(2 * MB)
        b, _ = pool.take(2 * MB)
        del a, b
        assert pool.kept_bytes() == 2 * MB  # the second did not fit under the bound: unmapped
    with using(pool_seconds=0):
        c, _ = pool.take(8 * MB)  # too large for the kept one: a fresh mapping
        del c
        assert pool.kept_bytes() == 2 * MB  # nothing kept at all
    with using(pool_seconds=30):
        assert pool.purge() == 1  # not yet due
        assert pool.purge(now=time.monotonic() + 31) == 0
    assert pool.kept_bytes() == 0


def test_the_timer_unmaps_what_waited_too_long():
    with using(pool_seconds=0.05):
        t, _ = pool.take(MB)
        del t
        assert pool.kept_bytes() == MB
        deadline = time.monotonic() + 10
        while pool.kept_bytes() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.kept_bytes() == 0


def test_release_unmaps_everything_kept():
    ts = [pool.take(MB)[0] for _ in range(3)]
    del ts
    assert pool.release() == 3 * MB and pool.kept_bytes() == 0


def test_a_dropped_cache_does_not_trim_the_heap_for_pool_memory():
    t, _ = pool.take(8 * MB)
    assert heap.heap_bytes([t]) == 0  # a mapping of its own: never in the C heap
    assert heap.heap_bytes([torch.empty(MB)]) == 4 * MB
