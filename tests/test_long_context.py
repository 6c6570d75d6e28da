"""Long contexts in bounded memory: ``probe.head_stats(model, inputs)`` computes every statistic
row block by row block while the model runs; its oracle is the full-pattern path,
``probe.head_stats(probe.capture(model, inputs))`` (itself tested against hand computations in
test_focus.py), on causal and bidirectional, padded, GQA, sliding-window, ALiBi and
cross-attention models, at several lengths and block sizes."""

from __future__ import annotations

import math
import re

import hf_fixtures as H
import pytest
import torch
import toys
from toys import ToyLM

import probe
from probe.errors import ProbeError

TEXTS = ["attention lets tokens read context.", "the model is reading the tokens one by one, quickly."]
TARGETS = ["ich mochte ein bier.", "graph neural networks pass messages, said he"]


def assert_same(streamed, full):
    """Every row and column equal: means within 1e-6 (relative above 1), the sample std across
    texts within 1e-5 (a difference of two means near each other amplifies float32 rounding)."""
    a = {(r["stack"], r["layer"], r["head"], r["kind"]): r for r in streamed.table}
    b = {(r["stack"], r["layer"], r["head"], r["kind"]): r for r in full.table}
    assert a.keys() == b.keys()
    assert streamed.table.columns == full.table.columns
    for k, row in a.items():
        for c, v in row.items():
            w = b[k][c]
            if isinstance(v, float) and isinstance(w, float):
                if math.isnan(w):
                    assert math.isnan(v), (k, c, v, w)
                    continue
                tol = 1e-5 if c.endswith("_std") else 1e-6
                assert abs(v - w) <= tol * max(1.0, abs(w)), (k, c, v, w)
            else:
                assert v == w, (k, c, v, w)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return H.bpe_tokenizer(tmp_path_factory.mktemp("bpe"))


@pytest.mark.parametrize("kind", ["sdpa_causal", "F.softmax", "sdpa_float", "sdpa_gqa", "mha", "sdpa_bool"])
@pytest.mark.parametrize("T,block", [(9, 2), (50, 7), (61, 64)])
def test_toy_decoders_match_the_full_patterns(kind, T, block):
    torch.manual_seed(T)
    lm = ToyLM(kind, n_kv_heads=2 if kind == "sdpa_gqa" else None).eval()
    ids = torch.randint(0, 40, (2, T))
    streamed = probe.head_stats(lm, ids, block=block)
    full = probe.head_stats(probe.capture(lm, ids), progress=False)
    assert_same(streamed, full)
    assert all(r["causal"] for r in streamed.table)
    assert streamed.rollout is None and "rollout" in streamed.not_computed
    assert full.rollout is not None  # the full path computes it


def test_template_pairs_equal_the_masks_written_here():
    """The duplicate/induction pairs found by sorting equal the nonzeros of the template masks
    built here as [rows, keys] comparisons, in the same order, with padding and any key range."""
    from types import SimpleNamespace

    from probe.analysis.focus.backends.workspace import template_pairs

    g = torch.Generator().manual_seed(0)
    for trial in range(150):
        B, T = 3, int(torch.randint(2, 40, (), generator=g))
        real = torch.rand(B, T, generator=g) > 0.2
        ids = torch.where(real, torch.randint(0, 1 + trial % 5, (B, T), generator=g), -1)
        s = SimpleNamespace(real=real, ids=ids)
        q0 = int(torch.randint(0, T, (), generator=g))
        q1 = int(torch.randint(q0 + 1, T + 1, (), generator=g))
        kend = T if trial % 2 else int(torch.randint(q1, T + 1, (), generator=g))
        rows, kj = torch.arange(q0, q1)[:, None], torch.arange(kend)[None, :]
        pair_real = real[:, q0:q1, None] & real[:, None, :kend]
        same = (ids[:, q0:q1, None] == ids[:, None, :kend]) & pair_real
        after = torch.zeros_like(same)  # ids[i] == ids[j - 1], key j real
        after[:, :, 1:] = same[:, :, :-1] & real[:, None, 1:kend]
        got = template_pairs(s, s, q0, q1, kend)
        for name, D in (("dup", same & (kj < rows)), ("induction", after & (kj <= rows))):
            want = (*D.nonzero(as_tuple=True), D.any(-1))
            for x, y in zip(got[name], want, strict=True):
                assert torch.equal(x, y), (trial, name)


@pytest.mark.parametrize("memo", [True, False])
def test_repeated_tokens_templates_match(monkeypatch, memo):
    """A text of a few repeated tokens (many duplicate and induction pairs): the pairs gathered
    one by one, remembered across layers or (memo off) recomputed per layer, give the masked sums
    of the full path."""
    from probe.analysis.focus.backends import workspace as rowblock

    if not memo:
        monkeypatch.setattr(rowblock.Workspace, "MEMO_PAIRS", 0)
    torch.manual_seed(3)
    lm = ToyLM("sdpa_causal").eval()
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 3, 4] * 4, [5] * 40])
    streamed = probe.head_stats(lm, ids, block=6)
    full = probe.head_stats(probe.capture(lm, ids), progress=False)
    assert_same(streamed, full)
    assert streamed.table[0]["dup_matches"] > 0


def test_mask_that_is_causal_only_in_its_first_rows(monkeypatch):
    """A float mask that hides later keys from the first rows only: the first blocks look
    lower-triangular (distance from i·Σa − Σ j·a), later ones do not (Σ a |i − j| directly); the
    layer is not causal and every metric matches the full path."""
    torch.manual_seed(4)
    T = 24
    mask = torch.zeros(T, T)
    mask[:8] = torch.triu(torch.full((T, T), float("-inf")), 1)[:8]
    monkeypatch.setattr(toys, "alibi_bias", lambda h, t, s: mask)  # the mask the toy adds
    lm = ToyLM("sdpa_float").eval()
    ids = torch.randint(0, 40, (2, T))
    streamed = probe.head_stats(lm, ids, block=4)
    full = probe.head_stats(probe.capture(lm, ids), progress=False)
    assert_same(streamed, full)
    assert not any(r["causal"] for r in streamed.table)


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt2"])
def test_padded_hf_decoders_match(bpe, name):
    """Padded batches; Llama has grouped-query attention, Mistral a sliding window of 4 keys."""
    model = getattr(H, name)(len(bpe))
    streamed = probe.head_stats(model, TEXTS, tokenizer=bpe, block=3)
    full = probe.head_stats(probe.capture(model, TEXTS, tokenizer=bpe), progress=False)
    assert_same(streamed, full)
    if name == "llama":
        assert streamed.kv_groups == full.kv_groups and streamed.kv_groups


def test_bidirectional_padded_encoder_matches():
    model, tok, _ = H.minilm()
    streamed = probe.head_stats(model, TEXTS, tokenizer=tok, block=4)
    full = probe.head_stats(probe.capture(model, TEXTS, tokenizer=tok), progress=False)
    assert_same(streamed, full)
    assert not any(r["causal"] for r in streamed.table)


def test_cross_attention_matches(bpe):
    model = H.bart(len(bpe))
    streamed = probe.head_stats(model, TEXTS, tokenizer=bpe, target=TARGETS, block=3)
    full = probe.head_stats(probe.capture(model, TEXTS, tokenizer=bpe, target=TARGETS), progress=False)
    assert_same(streamed, full)
    assert {r["kind"] for r in streamed.table} == {"self", "cross"}


def test_layer_selection_and_bad_arguments():
    lm = ToyLM("sdpa_causal").eval()
    ids = torch.randint(0, 40, (1, 12))
    s = probe.head_stats(lm, ids, layers=[1])
    assert {r["layer"] for r in s.table} == {1}
    full = probe.head_stats(probe.capture(lm, ids), progress=False)
    want = [r for r in full.table if r["layer"] == 1]
    assert [r["entropy"] for r in s.table] == pytest.approx([r["entropy"] for r in want], abs=1e-6)
    with pytest.raises(ProbeError, match="block"):
        probe.head_stats(lm, ids, block=0)
    with pytest.raises(ProbeError, match="inputs"):
        probe.head_stats(lm)


def test_progress_counts_the_attentions_read(capsys):
    lm = ToyLM("sdpa_causal").eval()
    ids = torch.randint(0, 40, (1, 12))
    quiet = probe.head_stats(lm, ids, progress=False)
    assert "attentions read" not in capsys.readouterr().err
    shown = probe.head_stats(lm, ids, progress=True)
    err = capsys.readouterr().err
    assert re.search(r"attentions read: \d+ attentions \[", err), err  # a count and its unit, spaced
    for a, b in zip(shown.table, quiet.table, strict=True):  # the same numbers (NaN where NaN)
        assert a.keys() == b.keys()
        for k, v in a.items():
            assert v == b[k] or (isinstance(v, float) and math.isnan(v) and math.isnan(b[k])), k


def test_blocks_never_hold_a_whole_pattern(monkeypatch):
    """Every block handed to the statistics has at most ``block`` query rows."""
    from probe.analysis.focus.streamed import reader as streaming

    seen = []
    real = streaming.RowTerms.rows

    def spy(self, q0, q1, blk, fill=None):
        seen.append(tuple(blk.shape))
        return real(self, q0, q1, blk, fill)

    monkeypatch.setattr(streaming.RowTerms, "rows", spy)
    lm = ToyLM("sdpa_causal").eval()
    probe.head_stats(lm, torch.randint(0, 40, (1, 40)), block=8)
    assert seen and all(s[2] <= 8 for s in seen)
    # causal SDPA blocks read only the keys their rows can see
    assert min(s[3] for s in seen) == 8


def test_parts_read_in_thread_buffers_never_write_the_block(monkeypatch, bpe):
    """With the compiled row loop, each part of a block is computed into its thread's own
    buffer: the block handed to the statistics is never written (what is read of it afterwards,
    the weights near the diagonal and the first real query's row, comes from the loop), and the
    statistics still equal the full patterns'. Where the loop reports a negative weight (which a
    softmax never gives: forced here), the block is filled with its weights and sorted."""
    from probe.analysis.focus.backends.rowloop import rowfused
    from probe.analysis.focus.streamed import reader as streaming

    if not rowfused.available():
        pytest.skip("needs numba (the fast extra)")
    blocks, real_rows = [], streaming.RowTerms.rows

    def spy(self, q0, q1, blk, fill=None):
        blk.fill_(float("nan"))  # anything read from the block itself would poison the statistics
        blocks.append(fill is not None)
        return real_rows(self, q0, q1, blk, fill)

    monkeypatch.setattr(streaming.RowTerms, "rows", spy)
    lm = ToyLM("sdpa_causal").eval()
    ids = torch.randint(0, 40, (2, 30), generator=torch.Generator().manual_seed(1))
    full = probe.head_stats(probe.capture(lm, ids), progress=False)
    assert_same(probe.head_stats(lm, ids, block=7), full)
    assert blocks and all(blocks)

    real_tasks = rowfused._tasks

    def negative(*a):  # the loop's `neg` flag on every row it reads
        real_tasks(*a)
        (terms, _, oq, o0), tasks = a[14], a[3]  # (row a of head bh is terms[:, bh·oq + o0 + a])
        for bh, a0, a1 in tasks:
            terms[rowfused.NAMES.index("neg"), bh * oq + o0 + a0 : bh * oq + o0 + a1] = 1.0

    monkeypatch.setattr(rowfused, "_tasks", negative)
    assert_same(probe.head_stats(lm, ids, block=7), full)
    model = H.llama(len(bpe))  # padded texts: the weights on padding keys dropped as the loop drops them
    full = probe.head_stats(probe.capture(model, TEXTS, tokenizer=bpe), progress=False)
    assert_same(probe.head_stats(model, TEXTS, tokenizer=bpe, block=3), full)


def test_causal_parts_compute_and_read_only_the_keys_each_row_sees(monkeypatch, bpe):
    """Under ``is_causal`` each part computes only the keys its rows may see, and the row loop
    reads each row to its query and no further: here every thread buffer starts as NaN, so
    whatever the parts leave uncomputed stays NaN (and the keys between a row's query and its
    part's last row hold unmasked scores), yet every statistic (word masses, template pairs,
    the sink profile's first row, the weights near the diagonal included) equals the full
    patterns'."""
    import numpy as np

    from probe.analysis.focus.backends.rowloop import rowfused
    from probe.capture import patterns

    if not rowfused.available():
        pytest.skip("needs numba (the fast extra)")
    monkeypatch.setattr(rowfused, "part_buffer", lambda size: np.full(size, np.nan, np.float32))
    trims, real_fill = [], patterns._Scores.fill

    def spy(self, *a, **k):
        trims.append((self.causal, k.get("trim", False)))  # (the SDPA call's is_causal, trimmed)
        return real_fill(self, *a, **k)

    monkeypatch.setattr(patterns._Scores, "fill", spy)
    lm = ToyLM("sdpa_causal").eval()
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 3, 4] * 4, [5, 6] * 20])
    full = probe.head_stats(probe.capture(lm, ids), progress=False)
    assert_same(probe.head_stats(lm, ids, block=7), full)
    assert trims and all(causal and trim for causal, trim in trims)  # the toy hands SDPA is_causal
    trims.clear()
    # one text (words from the tokenizer): transformers hands SDPA is_causal or, in versions
    # that build the mask anyway, a mask; every is_causal part is trimmed, and only those
    model = H.llama(len(bpe))
    full = probe.head_stats(probe.capture(model, TEXTS[1], tokenizer=bpe), progress=False)
    assert_same(probe.head_stats(model, TEXTS[1], tokenizer=bpe, block=3), full)
    assert trims and all(causal == trim for causal, trim in trims)


def test_causal_parts_are_cut_short_near_the_diagonal():
    """Parts hold at most 1 MiB of weights (but 128 rows); trimmed parts at most a quarter as many
    rows as their block's last query sees (so a part computes at most about an eighth more keys
    than its rows see), never under 128 rows for that; the block's last task of each thread is
    cut in four (not under 32 rows), so the threads end together."""
    from probe.analysis.focus.backends.rowloop.rowparts import tasks_of

    rows = lambda t: [int(b - a) for _, a, b in t]  # noqa: E731
    assert rows(tasks_of(12, 1024, 1024, 1, True)) == [256] * 48  # 1 MiB parts; one thread: no tail
    assert rows(tasks_of(12, 1024, 1024, 2, True, causal_end=1024)) == [256] * 46 + [64] * 8
    assert rows(tasks_of(12, 1024, 64, 1, True, causal_end=1024)) == [256] * 48  # the trim's quarter
    assert rows(tasks_of(12, 300, 300, 2, True, causal_end=300)) == [150] * 22 + [37, 38, 37, 38] * 2
    assert rows(tasks_of(12, 256, 4096, 2, True, causal_end=4096)) == [128] * 22 + [32] * 8  # 2 MiB
    assert rows(tasks_of(12, 40, 4096, 2, True)) == [40] * 12  # not under 32 rows, tail included
    assert rows(tasks_of(2, 256, 16384, 2, True)) == [128] * 2 + [32] * 8  # 8 MiB: not under 128 rows


def test_tasks_cover_every_row_of_every_head_once():
    """However a block is cut (heads, rows, threads, parts, trim, tail), its tasks are the rows of
    each head in order, each once."""
    from probe.analysis.focus.backends.rowloop.rowparts import tasks_of

    for heads, r, n, k, filled, end in [
        (1, 7, 7, 2, False, 0), (1, 300, 300, 4, True, 300), (12, 256, 4096, 2, True, 4096),
        (3, 1000, 20000, 3, True, 0), (2, 33, 5, 8, False, 0), (24, 129, 1500, 2, True, 1500),
    ]:  # fmt: skip
        t = tasks_of(heads, r, n, k, filled, end).tolist()
        for bh in range(heads):
            own = [(a, b) for h, a, b in t if h == bh]
            assert own[0][0] == 0 and own[-1][1] == r and all(b > a for a, b in own)
            assert all(own[i][1] == own[i + 1][0] for i in range(len(own) - 1))


def test_row_loop_workers_run_torch_on_one_thread(monkeypatch):
    """The threads of the row loop compute their parts with torch single-threaded, as the
    calling thread does inside the loop: a fresh worker whose products started MKL's own
    threads (torch's count is per thread) put four threads on two cores. Counted in the
    process's threads: a fresh pool of one worker adds that worker and nothing else."""
    import os

    from probe.analysis.focus.backends.rowloop import rowfused, workers

    if not rowfused.available():
        pytest.skip("needs numba (the fast extra)")
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("counts the process's threads in /proc")
    from models.llama import VOCAB, build

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = build(n_layers=1, n_heads=2, d_model=128)  # 64-wide heads, parts of 256 rows: MKL
        ids = torch.randint(0, VOCAB, (1, 1024), generator=torch.Generator().manual_seed(0))  # threads them
        probe.head_stats(model, ids, progress=False)  # every other thread started
        monkeypatch.setattr(workers, "_POOL", None)  # a fresh pool (one worker, beside the calling thread)
        before = len(os.listdir("/proc/self/task"))
        probe.head_stats(model, ids, progress=False)
        assert len(os.listdir("/proc/self/task")) - before == 1
    finally:
        torch.set_num_threads(n)


def test_cpu_blocks_hold_enough_rows_of_every_head():
    """A CPU block is 16 MiB, or 256 query rows of every head where that is more (up to 256 MiB):
    at long T a 16 MiB block would hold a few rows a head; a block never written (lazy), 1,024."""
    from probe.capture.consumers.blocks import block_rows

    assert block_rows((1, 12, 1024, 1024), None, "cpu") == (1 << 24) // (4 * 12 * 1024)
    assert block_rows((1, 12, 4096, 4096), None, "cpu") == 256
    assert block_rows((1, 12, 16384, 16384), None, "cpu") == 256
    assert block_rows((4, 32, 16384, 16384), None, "cpu") == (1 << 28) // (4 * 4 * 32 * 16384)
    assert block_rows((1, 12, 16384, 16384), None, "cuda") == (1 << 27) // (4 * 12 * 16384)
    assert block_rows((1, 12, 16384, 16384), 21, "cpu") == 21
    # blocks the row loop computes part by part (never written): 1,024 rows, up to 1 GiB of address space
    assert block_rows((1, 12, 4096, 4096), None, "cpu", lazy=True) == 1024
    assert block_rows((1, 12, 16384, 16384), None, "cpu", lazy=True) == 1024
    assert block_rows((4, 32, 16384, 16384), None, "cpu", lazy=True) == (1 << 30) // (4 * 4 * 32 * 16384)
    assert block_rows((1, 12, 16384, 16384), None, "cuda", lazy=True) == (1 << 27) // (4 * 12 * 16384)
    assert block_rows((1, 12, 16384, 16384), 21, "cpu", lazy=True) == 21


def test_cpu_terms_are_reduced_when_each_attention_closes(monkeypatch):
    """On a CPU a forward holds one attention's per-query terms at a time: each reader reduces
    its terms when its attention closes and drops them, and the table is the same as from the
    captured patterns."""
    from probe.analysis.focus.streamed import reader as streaming

    made, holding = [], []
    init, rows = streaming.RowTerms.__init__, streaming.RowTerms.rows

    def spy_init(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    def spy_rows(self, *a, **k):
        holding.append(sum(r.t is not None for r in made))
        return rows(self, *a, **k)

    monkeypatch.setattr(streaming.RowTerms, "__init__", spy_init)
    monkeypatch.setattr(streaming.RowTerms, "rows", spy_rows)
    lm = ToyLM("sdpa_causal").eval()
    ids = torch.randint(0, 40, (2, 30), generator=torch.Generator().manual_seed(3))
    streamed = probe.head_stats(lm, ids, block=7)
    assert len(made) >= 2 and set(holding) == {1}
    assert all(r.t is None and r.recv is None for r in made)
    whole = probe.head_stats(probe.capture(lm, ids))
    cols = [c for c in whole.table.columns if c not in ("layer", "head", "stack", "kind", "rollout")]
    for c in cols:
        a, b = streamed.table.column(c), whole.table.column(c)
        for x, y in zip(a, b, strict=True):
            if isinstance(x, float) and not (math.isnan(x) and math.isnan(y)):
                assert abs(x - y) <= 1e-5 * max(1.0, abs(y)), c


def _random_pattern(B, H, T, causal, seed, pad=None):
    """Row-stochastic weights; ``pad[b]`` left-padded positions get none (and are no query)."""
    g = torch.Generator().manual_seed(seed)
    P = torch.rand(B, H, T, T, generator=g) ** 4
    if causal:
        P = P.tril()
    real = torch.ones(B, T, dtype=torch.bool)
    for b, n in enumerate(pad or []):
        real[b, :n] = False
    P = P * real[:, None, None, :]
    P = P / P.sum(-1, keepdim=True).clamp(min=1e-30)
    P = P * real[:, None, :, None]
    return P, real


def _oracle(P, real, causal, D_list=(16, 128, 1024)):
    """Per text and head: mean over counted queries of beyond_D, reach90; and the sink profile."""
    B, H, T, _ = P.shape
    out = {}
    for b in range(B):
        keys = [j for j in range(T) if real[b, j]]
        for h in range(H):
            rows = []
            for i in range(T):
                vis = [j for j in keys if (j <= i or not causal)]
                if not real[b, i] or len(vis) < 2:
                    continue
                rows.append(i)
            beyond = {D: [] for D in D_list}
            reach = []
            recv = torch.zeros(T, dtype=torch.float64)
            for i in rows:
                row = P[b, h, i].double()
                total = float(row.sum())
                for D in D_list:
                    beyond[D].append(sum(float(row[j]) for j in range(T) if abs(i - j) > D))
                d = 0
                while sum(float(row[j]) for j in range(T) if abs(i - j) <= d) < 0.9 * total - 1e-12:
                    d += 1
                reach.append(d)
                recv += row
            n = len(rows)
            out[b, h] = (
                {D: sum(v) / n for D, v in beyond.items()},
                sum(reach) / n,
                recv / n,
            )
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_long_context_metrics_by_hand(causal):
    """beyond_D, reach90 and the sink profile of a planted pattern, against loops written here;
    T = 150 so that beyond_16 and beyond_128 both bite."""
    from probe.analysis.focus import METRICS

    B, H, T = 2, 2, 150
    P, real = _random_pattern(B, H, T, causal, seed=1, pad=[0, 7])
    meta = {
        "tokens": [["t"] * int(real[b].sum()) for b in range(B)],
        "attention_mask": real.long().tolist(),
    }
    stats = probe.head_stats(probe.Cache({"decoder.blocks.0.self_attn.pattern": P}, meta), progress=False)
    assert {"beyond_16", "beyond_128", "beyond_1024", "reach90"} <= set(METRICS)
    want = _oracle(P, real, causal)
    prof = stats.received["decoder/0/self"]
    for b in range(B):
        for h in range(H):
            beyond, reach, recv = want[b, h]
            torch.testing.assert_close(prof[b, h], recv, atol=1e-6, rtol=0)
    for h in range(H):
        row = [r for r in stats.table if r["head"] == h][0]
        assert row["causal"] == causal
        for D in (16, 128, 1024):
            mean = sum(want[b, h][0][D] for b in range(B)) / B
            assert row[f"beyond_{D}"] == pytest.approx(mean, abs=1e-6)
        reach = sum(want[b, h][1] for b in range(B)) / B
        assert row["reach90"] == pytest.approx(reach, rel=1e-6, abs=1e-6)  # float32 mean of ~100
        assert row["beyond_1024"] == 0  # no key is that far
        want_prof = torch.stack([want[b, h][2] for b in range(B)]).mean(0).float()
        torch.testing.assert_close(stats.sink_profile(0)[h], want_prof, atol=1e-6, rtol=0)


def test_sink_profile_streamed_equals_full(bpe):
    model = H.llama(len(bpe))
    streamed = probe.head_stats(model, TEXTS, tokenizer=bpe, block=3)
    full = probe.head_stats(probe.capture(model, TEXTS, tokenizer=bpe), progress=False)
    assert streamed.received.keys() == full.received.keys()
    for k in full.received:
        torch.testing.assert_close(streamed.received[k], full.received[k], atol=1e-6, rtol=0, equal_nan=True)
    torch.testing.assert_close(streamed.sink_profile(1), full.sink_profile(1), atol=1e-6, rtol=0)


def test_llama_shaped_model_is_llama():
    """models.llama computes what transformers' LlamaForCausalLM computes with the same weights
    (the independent oracle for its rotary positions, RMSNorm, GQA and SwiGLU)."""
    import transformers as tf

    from models.llama import build

    lm = build(n_layers=2, n_heads=4, d_model=64, n_kv_heads=2, d_ff=96, seed=3)
    cfg = tf.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    hf = tf.LlamaForCausalLM(cfg).eval()
    sd = {
        ("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v for k, v in lm.state_dict().items()
    }
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    ids = torch.randint(0, 256, (2, 700))  # longer than any learnt position table would be
    with torch.no_grad():
        torch.testing.assert_close(lm(ids), hf(ids).logits, atol=2e-5, rtol=1e-4)
    assert lm.tokenizer.encode("ab") == [97, 98]


def test_llama_shaped_long_input_streams():
    """At T = 1040 (past beyond_1024) streamed statistics of the Llama-shaped model equal the full."""
    from models.llama import build

    lm = build(n_layers=2, n_heads=4, d_model=64, n_kv_heads=2, seed=1)
    ids = torch.randint(0, 256, (1, 1040))
    streamed = probe.head_stats(lm, ids, block=160)
    full = probe.head_stats(probe.capture(lm, ids), progress=False)
    assert_same(streamed, full)
    assert streamed.kv_groups == {0: [0, 1], 1: [2, 3]}
    assert streamed.table[0]["reach90"] > 100  # random weights read far


def test_retrieval_scores_against_hand_computed_weights():
    """The last row's mass on the needle, against weights computed by hand from the model's
    projections (the last condition run), and the needle text built as documented."""
    from models.llama import build, rotate
    from probe.analysis.focus.retrieval import needle_text
    from probe.forward import adapt_tokenizer

    model = build(n_layers=2, n_heads=4, d_model=64, seed=5)
    tok = adapt_tokenizer(model.tokenizer)
    ids, (s, e), (vs, ve) = needle_text(tok, 300, 0.5)
    assert len(ids) == 300 and model.tokenizer.decode(ids[vs:ve]) == " 7351"
    assert model.tokenizer.decode(ids[s:e]) == " The secret number of Ada is 7351."
    assert model.tokenizer.decode(ids).endswith("The secret number of Ada is")
    seen = {}
    hooks = [
        layer.self_attn.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, a[0]))
        for i, layer in enumerate(model.layers)
    ]
    table = probe.retrieval_scores(model, lengths=[200, 300], depths=[0.0, 0.5], block=37)
    for h in hooks:
        h.remove()
    assert len(table) == 2 * 2 * 2 * 4
    last = [r for r in table if r["length"] == 300 and r["depth"] == 0.5]
    T = 300
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            att, x = layer.self_attn, seen[i]
            q = rotate(att.q_proj(x).view(1, T, 4, 16).transpose(1, 2), att.base)
            k = rotate(att.k_proj(x).view(1, T, 4, 16).transpose(1, 2), att.base)
            w = ((q[:, :, -1:] @ k.transpose(-2, -1)) / 4.0).softmax(-1)[0, :, 0]  # the last row
            for r in [r for r in last if r["layer"] == i]:
                assert r["needle_start"] == s
                assert r["needle_mass"] == pytest.approx(float(w[r["head"], s:e].sum()), abs=1e-6)
                assert r["value_mass"] == pytest.approx(float(w[r["head"], vs:ve].sum()), abs=1e-6)
    with pytest.raises(ProbeError, match="too short"):
        probe.retrieval_scores(model, lengths=[20])
    with pytest.raises(ProbeError, match="depth"):
        probe.retrieval_scores(model, lengths=[200], depths=[1.5])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_streamed_on_cuda_matches_the_full_patterns_on_cpu(bpe):
    """The same code path on a GPU: blocks stay on the device, terms come back to the CPU."""
    model = H.llama(len(bpe))
    full = probe.head_stats(probe.capture(model, TEXTS, tokenizer=bpe), progress=False)
    streamed = probe.head_stats(model.to("cuda"), TEXTS, tokenizer=bpe, block=3)
    model.to("cpu")
    # GPU matrix products round differently from the CPU's: float32 rounding, not 1e-6
    a = {(r["layer"], r["head"]): r for r in streamed.table}
    for r in full.table:
        for c in ("entropy", "first", "distance", "span", "reach90", "beyond_16", "prev_score"):
            assert a[r["layer"], r["head"]][c] == pytest.approx(r[c], rel=1e-4, abs=1e-5), c


def test_signed_distance_keeps_its_digits_at_long_positions():
    """Queries near position 16,000 that read the previous token: Σ (j − i)·a is about −1. Taken
    as Σ j·a − i·Σ a in float32 it would lose three digits (the ulp of 16,000 is 1e-3); the
    streamed terms keep it to float32 rounding of the small numbers (float64 sums written here)."""
    from probe.analysis.focus.definitions.tokens import side
    from probe.analysis.focus.streamed.reader import RowTerms

    T, q0, q1 = 16008, 16000, 16008
    qs = side({}, "decoder", "own", 1, T)
    terms = RowTerms(qs, qs, (1, 2, T, T), self_attn=True)
    g = torch.Generator().manual_seed(0)
    blk = torch.rand(1, 2, q1 - q0, q1, generator=g) * 1e-9
    rows = torch.arange(q0, q1)
    blk[..., rows - q0, rows - 1] = 1.0
    blk = blk.masked_fill(torch.arange(q1)[None, :] > rows[:, None], 0)  # causal
    blk = blk / blk.sum(-1, keepdim=True)
    terms.rows(q0, q1, blk.clone())
    want = (blk.double() * (torch.arange(q1)[None, :] - rows[:, None]).double()).sum(-1)
    got = terms.t.signed[..., q0:q1].double()
    assert (got - want).abs().max() < 2e-5
    assert (terms.t.dist[..., q0:q1].double() + want).abs().max() < 2e-5
    old = (blk @ torch.arange(q1).float() - rows.float() * blk.sum(-1)).double()  # the cancelling form
    assert (old - want).abs().max() > 1e-4  # the test can tell the two apart
