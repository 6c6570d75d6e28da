"""probe.word_timestamps: hand-made cross-attention with known monotone alignments, DTW against a
plain loop, the head choice with and without gold, the boundary metrics, bad inputs; and a
Whisper-shaped model's cache read end to end (probe.align no longer refused)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import probe
from probe.analysis.alignment.dtw import dtw, median_filter, standardise

HOP = 0.02
S = 60  # encoder positions (frames)


def _loop_dtw(x: np.ndarray) -> list[tuple[int, int]]:
    """Dynamic time warping written as the plain double loop (whisper's dtw_cpu tie rules)."""
    N, M = x.shape
    cost = np.full((N + 1, M + 1), np.inf)
    cost[0, 0] = 0.0
    trace = -np.ones((N + 1, M + 1), dtype=int)
    for j in range(1, M + 1):
        for i in range(1, N + 1):
            c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
            if c0 < c1 and c0 < c2:
                c, t = c0, 0
            elif c1 < c0 and c1 < c2:
                c, t = c1, 1
            else:
                c, t = c2, 2
            cost[i, j] = x[i - 1, j - 1] + c
            trace[i, j] = t
    trace[0, :] = 2
    trace[:, 0] = 1
    i, j, path = N, M, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        t = trace[i, j]
        i, j = (i - 1, j - 1) if t == 0 else (i - 1, j) if t == 1 else (i, j - 1)
    return path[::-1]


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (6, 1), (5, 40), (13, 17), (30, 8)])
def test_dtw_matches_a_plain_loop(shape):
    rng = np.random.default_rng(sum(shape))
    x = rng.normal(size=shape)
    rows, cols = dtw(x)
    assert list(zip(rows.tolist(), cols.tolist(), strict=True)) == _loop_dtw(x)


def test_dtw_ties_follow_the_loop():
    x = np.round(np.random.default_rng(3).normal(size=(9, 14)))  # integer costs: many ties
    rows, cols = dtw(x)
    assert list(zip(rows.tolist(), cols.tolist(), strict=True)) == _loop_dtw(x)


def test_standardise_and_median_filter_by_hand():
    w = torch.rand(2, 4, 9, dtype=torch.float64)
    z = standardise(w)
    for h in range(2):
        for f in range(9):
            col = w[h, :, f]
            mean, std = col.mean(), col.std(unbiased=False)
            assert torch.allclose(z[h, :, f], (col - mean) / std)
    x = torch.tensor([[5.0, 1.0, 9.0, 2.0, 7.0, 3.0, 8.0, 4.0]])
    got = median_filter(x, 3)[0].tolist()
    padded = [1.0, *x[0].tolist(), 8.0]  # reflect: x[1] before, x[-2] after
    assert got == [sorted(padded[i : i + 3])[1] for i in range(8)]


def _cache(alignments: dict[tuple[int, int], list[list[int]]], tokens, B=1, L=2, H=3, seed=0, audio=None):
    """A cache whose decoder cross-attention [B, H, T, S] is noise except the given heads, where row
    ``r`` of input ``b`` attends to frames ``alignments[(layer, head)][b][r]`` (a frame range's
    start; the row covers frames start..next start). Tokens: ``[<s>, words..., </s>]``."""
    g = torch.Generator().manual_seed(seed)
    T = len(tokens[0])
    tensors = {}
    for layer in range(L):
        p = torch.rand(B, H, T, S, generator=g) + 0.5
        for (lay, h), per_b in alignments.items():
            if lay != layer:
                continue
            for b, starts in enumerate(per_b):
                p[b, h] = 0.05 * torch.rand(T, S, generator=g)
                for r in range(len(starts)):
                    a, e = starts[r], starts[r + 1] if r + 1 < len(starts) else S
                    p[b, h, r, a:e] = 1.0
        tensors[f"decoder.blocks.{layer}.cross_attn.pattern"] = p / p.sum(-1, keepdim=True)
    special = [[int(t in ("<s>", "</s>", "<pad>")) for t in row] for row in tokens]
    frames = {"hop": HOP, "offset": 0.0, "count": S, "stride": 2, "audio": audio or [S] * B}
    meta = {
        "target_tokens": tokens,
        "target_special_tokens_mask": special,
        "target_attention_mask": [[int(t != "<pad>") for t in row] for row in tokens],
        "stacks": {
            "encoder": {"layers": 1, "chain": True, "positions": {"kinds": ["frame"] * S, "frames": frames}},
            "decoder": {"layers": L, "chain": True},
        },
    }
    return probe.Cache(tensors, meta)


TOKENS = [["<s>", " the", " cat", "s", " sat", " down", "</s>"]]
# rows 0..5 predict " the", " cat", "s", " sat", " down", "</s>": each row's first frame (the
# path of dynamic time warping starts at frame 0, so row 0 does)
STARTS = [[0, 10, 18, 24, 37, 50]]


def test_known_alignment_recovered_to_the_frame():
    c = _cache({(1, 2): STARTS}, TOKENS)
    wt = probe.word_timestamps(c, heads=[(1, 2)])
    assert wt.choice == "given" and wt.chosen == [(1, 2)]
    assert wt.words.column("word") == ["the", "cats", "sat", "down"]
    s = STARTS[0]
    want = [(s[0], s[1]), (s[1], s[3]), (s[3], s[4]), (s[4], s[5])]
    got = list(zip(wt.words.column("start"), wt.words.column("end"), strict=True))
    assert got == [(round(a * HOP, 6), round(e * HOP, 6)) for a, e in want]
    assert wt.tokens.column("start") == [round(f * HOP, 6) for f in s[:5]]
    assert wt.tokens.column("position") == [1, 2, 3, 4, 5]


def test_heads_chosen_without_gold_are_the_monotone_ones():
    c = _cache({(0, 1): STARTS, (1, 2): STARTS}, TOKENS, seed=4)
    wt = probe.word_timestamps(c)
    assert wt.choice == "monotone"
    assert sorted(wt.chosen) == [(0, 1), (1, 2)]
    chosen = {(r["layer"], r["head"]) for r in wt.heads if r["chosen"]}
    assert chosen == {(0, 1), (1, 2)}
    good = [r for r in wt.heads if (r["layer"], r["head"]) == (1, 2)][0]
    assert good["monotonicity"] == pytest.approx(1.0)
    others = [r for r in wt.heads if not r["chosen"]]
    assert all(r["monotonicity"] < 0.9 or r["diagonality"] < 0.75 for r in others)
    assert wt.words.column("start")[1] == round(STARTS[0][1] * HOP, 6)


def test_heads_chosen_with_gold_fit_it_and_metrics_are_counted():
    # head (0, 0) is monotone but 4 frames late from the second row on; head (1, 1) is exact
    off = [[0, 14, 22, 28, 41, 50]]
    c = _cache({(0, 0): off, (1, 1): STARTS}, TOKENS, seed=2)
    s = [f * HOP for f in STARTS[0]]
    gold = [("the", s[0], s[1]), ("cats", s[1], s[3]), ("sat", s[3], s[4]), ("down", s[4], s[5])]
    wt = probe.word_timestamps(c, gold=gold)
    assert wt.choice == "gold" and wt.chosen == [(1, 1)]
    assert wt.metrics["mean_error_ms"] == pytest.approx(0.0, abs=1e-6)
    assert wt.metrics["within_20ms"] == 1.0 and wt.metrics["boundaries"] == 8
    row = [r for r in wt.heads if (r["layer"], r["head"]) == (0, 0)][0]
    # 80 ms (4 frames) late at every boundary but the first start and the last end
    errs = [0, 80, 80, 80, 80, 80, 80, 0]
    assert row["mean_error_ms"] == pytest.approx(sum(errs) / 8)
    assert row["within_50ms"] == pytest.approx(2 / 8)
    assert row["within_100ms"] == 1.0
    assert wt.words.column("start_error_ms") == pytest.approx([0.0] * 4, abs=1e-6)


def test_gold_off_by_known_amounts_measured():
    c = _cache({(1, 2): STARTS}, TOKENS)
    s = [f * HOP for f in STARTS[0]]
    gold = [(s[0] + 0.015, s[1]), (s[1], s[3] - 0.04), (s[3], s[4]), (s[4] + 0.2, s[5])]
    wt = probe.word_timestamps(c, heads=[(1, 2)], gold=gold)
    errs = [15, 0, 0, 40, 0, 0, 200, 0]
    assert wt.metrics["mean_error_ms"] == pytest.approx(sum(errs) / 8)
    assert wt.metrics["within_20ms"] == pytest.approx(6 / 8)
    assert wt.metrics["within_50ms"] == pytest.approx(7 / 8)
    assert wt.metrics["within_100ms"] == pytest.approx(7 / 8)


def test_words_given_group_the_tokens():
    c = _cache({(1, 2): STARTS}, TOKENS)
    wt = probe.word_timestamps(c, heads=[(1, 2)], words=["The", "cats", "sat down"])
    assert wt.words.column("word") == ["The", "cats", "sat down"]
    assert wt.words.column("tokens") == [" the", " cat|s", " sat| down"]
    assert wt.words.column("end")[2] == round(STARTS[0][5] * HOP, 6)
    with pytest.raises(probe.ProbeError, match="do not spell"):
        probe.word_timestamps(c, heads=[(1, 2)], words=["the", "dogs", "sat", "down"])
    with pytest.raises(probe.ProbeError, match="'ts' starts inside a token"):
        probe.word_timestamps(c, heads=[(1, 2)], words=["the", "ca", "ts", "sat", "down"])


def test_batch_with_padding_and_audio_frames():
    tokens = [TOKENS[0], ["<s>", " hi", " there", "</s>", "<pad>", "<pad>", "<pad>"]]
    starts = [STARTS[0], [0, 9, 20]]
    c = _cache({(0, 2): starts}, tokens, B=2, audio=[S, 30])
    wt = probe.word_timestamps(c, heads=[(0, 2)])
    second = [r for r in wt.words if r["item"] == 1]
    assert [(r["word"], r["start"], r["end"]) for r in second] == [
        ("hi", 0.0, round(9 * HOP, 6)),
        ("there", round(9 * HOP, 6), round(20 * HOP, 6)),
    ]


def test_exports():
    c = _cache({(1, 2): STARTS}, TOKENS)
    wt = probe.word_timestamps(c, heads=[(1, 2)])
    d = json.loads(wt.to_json())
    assert d["chosen"] == [[1, 2]] and len(d["words"]["rows"]) == 4
    assert "heads (given): 1.2" in wt.to_text()
    assert "<table" in wt._repr_html_()
    assert list(wt.to_pandas()["word"]) == ["the", "cats", "sat", "down"]


def test_bad_inputs():
    c = _cache({(1, 2): STARTS}, TOKENS)
    with pytest.raises(probe.ProbeError, match="not in the cache"):
        probe.word_timestamps(c, heads=[(5, 0)])
    with pytest.raises(probe.ProbeError, match="pairs"):
        probe.word_timestamps(c, heads=[3])
    with pytest.raises(probe.ProbeError, match="3 words but the transcript has 4"):
        probe.word_timestamps(c, gold=[(0, 0.1), (0.1, 0.2), (0.2, 0.3)])
    with pytest.raises(probe.ProbeError, match="not a time span"):
        probe.word_timestamps(c, gold=[(0, 0.1), (0.1, 0.2), (0.2, 0.3), (0.5, 0.4)])
    with pytest.raises(probe.ProbeError, match="odd"):
        probe.word_timestamps(c, width=4)
    meta = dict(c.metadata)
    meta["stacks"] = {"decoder": {"layers": 2, "chain": True}}
    with pytest.raises(probe.ProbeError, match="does not say what time"):
        probe.word_timestamps(probe.Cache(dict(c.items()), meta))
    meta["stacks"] = c.metadata["stacks"]
    meta.pop("target_tokens")
    with pytest.raises(probe.ProbeError, match="no target tokens"):
        probe.word_timestamps(probe.Cache(dict(c.items()), meta))
