"""probe.cache.perf: one options object switches the performance machinery; values never change."""

from __future__ import annotations

import pytest
import torch
from toys import ToyLM

import probe
from probe.cache.perf import OPTIONS, using


def test_options_change_for_a_block_and_come_back():
    before = (OPTIONS.direct_io, OPTIONS.io_thread, OPTIONS.heap_trim, OPTIONS.sync_every)
    with using(direct_io=False, io_thread=False, sync_every=1) as o:
        assert o is OPTIONS and (o.direct_io, o.io_thread, o.sync_every) == (False, False, 1)
    assert (OPTIONS.direct_io, OPTIONS.io_thread, OPTIONS.heap_trim, OPTIONS.sync_every) == before
    with pytest.raises(TypeError, match="unknown performance option 'arena'"):
        with using(arena=True):
            pass


def test_every_switch_off_stores_the_same_bytes(tmp_path):
    # the oracle is the in-memory capture with everything on; flushed to disk after every byte too
    torch.manual_seed(0)
    lm = ToyLM("sdpa_causal", n_layers=2).eval()
    ids = torch.randint(0, 40, (2, 10))
    memory = probe.capture(lm, ids)
    with using(direct_io=False, io_thread=False, heap_trim=False):
        plain = probe.capture(lm, ids, out=tmp_path / "plain.safetensors")
    with using(sync_every=1):
        synced = probe.capture(lm, ids, out=tmp_path / "synced.safetensors")
    assert (tmp_path / "plain.safetensors").read_bytes() == (tmp_path / "synced.safetensors").read_bytes()
    for k in memory.keys():
        assert torch.equal(plain[k], memory[k]) and torch.equal(synced[k], memory[k])
