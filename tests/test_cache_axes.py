"""The cache's own queries (probe.cache.axes and the Cache methods over it): which layers hold a
pattern, which heads, which positions are real and which tokens label them.

Oracles: the tensors and metadata each test writes by hand (padding placed where the test puts it).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import probe
from probe.cache import Cache

SRC = [["ich", "mochte", "bier", "P"], ["ja", "nein"]]  # caches hold each text's real tokens
TGT = [["S", "i", "beer"], ["S", "yes"]]


def _encdec() -> Cache:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "encoder.blocks.0.self_attn.pattern": torch.rand(2, 2, 4, 4, generator=g),
        "decoder.blocks.0.self_attn.pattern": torch.rand(2, 2, 3, 3, generator=g),
        "decoder.blocks.0.cross_attn.pattern": torch.rand(2, 2, 3, 4, generator=g),
        "decoder.blocks.1.cross_attn.pattern": torch.rand(2, 2, 3, 4, generator=g),
        "decoder.blocks.0.resid_pre": torch.rand(2, 3, 8, generator=g),
    }
    meta = {
        "tokens": SRC,
        "attention_mask": [[1, 1, 1, 1], [1, 1, 0, 0]],
        "target_tokens": TGT,
        "target_attention_mask": [[1, 1, 1], [1, 1, 0]],
    }
    return Cache(tensors, meta)


def test_layers_stacks_heads_and_texts():
    c = _encdec()
    assert c.n_texts == 2
    assert c.pattern_layers("decoder", "cross") == [0, 1] and c.pattern_layers("decoder") == [0]
    assert c.pattern_layers("encoder", "cross") == []
    assert c.pattern_stack() == "decoder" and c.pattern_stack(kind="cross") == "decoder"
    assert c.pattern_stack("encoder") == "encoder"
    assert c.head_ids("encoder", 0) == [0, 1]
    sub = Cache({"decoder.blocks.3.self_attn.pattern": torch.rand(1, 2, 2, 2)}, {"heads_captured": [1, 5]})
    assert sub.head_ids("decoder", 3) == [1, 5]  # the model's head numbers, not the axis index
    assert Cache({"decoder.blocks.0.self_attn.pattern": torch.rand(3, 1, 2, 2)}).n_texts == 3


def test_axes_crop_padding_and_pick_the_right_side():
    c = _encdec()
    q, k = c.axes("decoder", "cross", batch=1)
    assert (q.side, q.positions, q.tokens) == ("target", [0, 1], ["S", "yes"])
    assert (k.side, k.positions, k.tokens) == ("source", [0, 1], ["ja", "nein"])
    q, k = c.axes("decoder", "self", batch=0)
    assert q.tokens == k.tokens == TGT[0] and k.positions == [0, 1, 2]
    q, k = c.axes("encoder", batch=1)
    assert q.tokens == ["ja", "nein"]
    assert c.stream_axis("decoder", 1).tokens == ["S", "yes"]
    # no token metadata: every position is real and labelled by its number
    bare = Cache({"decoder.blocks.0.self_attn.pattern": torch.rand(1, 1, 3, 3)})
    assert bare.axes("decoder")[1].tokens == ["0", "1", "2"]


def test_head_pattern_is_the_cached_slice_between_real_tokens():
    c = _encdec()
    w, q, k = c.head_pattern(1, 1, kind="cross", batch=1)
    want = c["decoder.blocks.1.cross_attn.pattern"][1, 1, :2, :2]
    assert torch.equal(w, want) and (q.tokens, k.tokens) == (["S", "yes"], ["ja", "nein"])
    sub = Cache({"decoder.blocks.0.self_attn.pattern": torch.rand(1, 2, 2, 2)}, {"heads_captured": [1, 5]})
    assert torch.equal(sub.head_pattern(0, 5)[0], sub["decoder.blocks.0.self_attn.pattern"][0, 1])


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda c: c.head_pattern(2, 0),
            r"layer 2 of the decoder stack is not in this cache; it has layers \[0\]",
        ),
        (
            lambda c: c.head_pattern(0, 7),
            r"head 7 is not in this cache's decoder layer 0; it has heads \[0, 1\]",
        ),
        (lambda c: c.head_pattern(0, 0, batch=2), r"batch 2 is out of range: the cache holds 2 text"),
        (lambda c: c.pattern_stack("nowhere"), r"stack 'nowhere' is not in this cache"),
        (lambda c: c.head_ids("encoder", 0, "cross"), r"no cross-attention \(it is not an encoder-decoder\)"),
        (lambda c: c.pattern_layers("decoder", "both"), r"kind must be 'self' or 'cross'"),
    ],
)
def test_bad_queries_are_one_line_errors(call, message):
    with pytest.raises(probe.ProbeError, match=message):
        call(_encdec())


def test_a_cache_without_patterns_says_so():
    c = Cache({"decoder.blocks.0.resid_pre": torch.rand(1, 2, 4)}, {"tokens": [["a", "b"]]})
    with pytest.raises(probe.ProbeError, match="holds no attention patterns"):
        c.pattern_stack()


def test_the_cache_package_imports_no_plotting_library():
    code = (
        "import sys, torch; from probe.cache import Cache; "
        "p = torch.rand(1, 1, 3, 3); "
        "c = Cache({'decoder.blocks.0.self_attn.pattern': p}, {'tokens': [list('abc')]}); "
        "assert 'data:image/png;base64,' in c._repr_html_(); "
        "assert not {m.split('.')[0] for m in sys.modules} & {'matplotlib', 'seaborn'}, 'plotting imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
