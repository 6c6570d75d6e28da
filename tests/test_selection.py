"""probe.cache.selection: one Selection for capture's layers=/heads= and a corpus run's keep=."""

from __future__ import annotations

import pytest
import torch

from probe import Cache, ProbeError
from probe.cache.selection import Selection


def _cache(n_layers: int = 3, n_heads: int = 4) -> Cache:
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(n_layers):
        tensors[f"decoder.blocks.{i}.self_attn.pattern"] = torch.rand(2, n_heads, 5, 5, generator=g)
        tensors[f"decoder.blocks.{i}.resid_pre"] = torch.rand(2, 5, 8, generator=g)
    return Cache(tensors, {"layers_captured": None})


@pytest.mark.parametrize(
    ("layers", "heads", "message"),
    [
        ([], None, r"^layers=\[\] selects no layer; give indices like \[0, 2\], or None for all$"),
        (None, [1, 1], r"^heads=\[1, 1\] names a head twice; give each index once$"),
        ("0", None, r"^layers must be a list of layer indices like \[0, 2\], not '0'$"),
        ([True], None, r"^layers must be non-negative layer indices like \[0, 2\]; True is not one$"),
        (None, [-2], r"^heads must be non-negative head indices like \[0, 2\]; -2 is not one$"),
    ],
)
def test_parse_refuses_what_capture_refuses(layers, heads, message):
    with pytest.raises(ProbeError, match=message):
        Selection.parse(layers, heads)


def test_parse_takes_one_index_and_any_iterable():
    assert Selection.parse(2, range(3)) == Selection([2], [0, 1, 2])
    assert Selection.parse() == Selection(None, None)


def test_keep_is_sorted_once_and_named_as_keep():
    sel = Selection.from_keep({"layers": [2, 0, 2]})
    assert sel.layers == [0, 2] and sel.heads is None and sel.keep
    with pytest.raises(
        ProbeError, match=r"^keep\['heads'\] should be a list of non-negative integers, not 3$"
    ):
        Selection.from_keep({"heads": 3})
    with pytest.raises(ProbeError, match=r"^keep\['layers'\]=\[\] selects no layer; give indices"):
        Selection.from_keep({"layers": []})


def test_checks_against_counts_name_the_selection_as_given():
    with pytest.raises(
        ProbeError, match=r"^heads=\[5\]: this model's attention has 4 heads; choose indices from 0-3$"
    ):
        Selection.parse(heads=[5]).check_heads(4)
    Selection.parse(heads=[3]).check_heads(4)
    with pytest.raises(
        ProbeError,
        match=r"^layers=\[0, 6\] names layers \[6\] that do not exist \(the model has 6 and 2 layers\); "
        r"choose indices from 0-5$",
    ):
        Selection.parse(layers=[0, 6]).check_layers([6, 2])
    with pytest.raises(ProbeError, match=r"^layers=\[1\] selects no layer \(the model has 3 layers\)"):
        Selection.parse(layers=[1]).check_layers([3], found=False)
    with pytest.raises(ProbeError, match=r"^keep layers \[3\] names layers \[3\] that do not exist"):
        Selection.from_keep({"layers": [3]}).check_cache(_cache())
    with pytest.raises(ProbeError, match=r"^keep heads \[4\]: this model's attention has 4 heads"):
        Selection.from_keep({"heads": [4]}).check_cache(_cache())


def test_patterns_cuts_layers_and_heads_from_a_cache():
    # keep's heads are sorted: [3, 1] keeps heads 1 and 3 in that order
    cache = _cache()
    part = Selection.from_keep({"layers": [0, 2], "heads": [3, 1]}).patterns(cache)
    assert part.keys() == ["decoder.blocks.0.self_attn.pattern", "decoder.blocks.2.self_attn.pattern"]
    for i in (0, 2):
        full = cache[f"decoder.blocks.{i}.self_attn.pattern"]
        kept = part[f"decoder.blocks.{i}.self_attn.pattern"]
        assert torch.equal(kept, torch.stack([full[:, 1], full[:, 3]], 1))
    assert part.metadata["layers_captured"] == [0, 2] and part.metadata["heads_captured"] == [1, 3]


def test_head_stats_read_the_layers_a_cache_holds_by_their_index():
    # a cache of some layers keeps the model's layer numbers; head statistics must read exactly
    # those layers (not 0..n-1, which dropped layer 2 here) with the numbers the full cache gives
    import causal_gallery as G

    import probe

    model = G.TinyLM(["ok", "ok", "ok"])
    full = probe.head_stats(probe.capture(model, G.IDS), progress=False).table
    part = probe.head_stats(probe.capture(model, G.IDS, layers=[1, 2]), progress=False).table
    assert sorted({r["layer"] for r in part}) == [1, 2] and len(part) == 2 * G.H
    want = {(r["layer"], r["head"]): r for r in full if r["layer"] in (1, 2)}
    for r in part:
        for c in ("entropy", "prev", "self", "first"):
            assert r[c] == pytest.approx(want[(r["layer"], r["head"])][c], abs=1e-6), (
                r["layer"],
                r["head"],
                c,
            )
