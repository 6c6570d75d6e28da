"""The per-text store of corpus runs: its rows against the merged statistics and against the patterns,
its queries against pandas over the same files, its examples against the patterns, damaged shards,
and a run interrupted inside its writes.

Oracles: numpy over the Parquet files read by pyarrow (not DuckDB), the statistics' definitions
computed in the test from captured patterns, and token ids compared in the test.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("duckdb")

import probe  # noqa: E402
from models import load as load_model  # noqa: E402
from probe.analysis.focus.definitions.roles import roles_of  # noqa: E402
from probe.analysis.focus.definitions.table import METRICS  # noqa: E402
from probe.errors import ProbeError  # noqa: E402

LETTERS = "acdefghiklmnoprstuw"  # inside minigpt's vocabulary
EXAMPLES = {"stats": ["induction_score", "first", "prev"], "k": 4, "positions": 3, "keys": 4}


def _texts(n: int, seed: int = 0) -> list[str]:
    """Short texts, half of them with a repeated word (induction has something to read)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [
            "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 4))) for _ in range(rng.randint(2, 4))
        ]
        if i % 2:
            words.append(words[0])
        out.append(" ".join(words)[:30])
    out[3] = "a bad text"  # 'b' is outside the vocabulary: recorded, not fatal
    out[7] = "t" * 40  # longer than minigpt's 32 positions
    return out


TEXTS = _texts(40)


@pytest.fixture(scope="module")
def gpt():
    return load_model("minigpt")


@pytest.fixture(scope="module")
def runs(gpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("store")
    out = {}
    for keep in ("stats", "all"):
        out[keep] = probe.run_corpus(
            gpt, TEXTS, d / keep, keep=keep, batch_size=4, shard_size=8, examples=EXAMPLES, progress=False
        )
    return out


def _heads(run) -> dict[str, np.ndarray]:
    files = sorted(run.path.glob("shards/*.heads.parquet"))
    t = __import__("pyarrow").concat_tables([pq.read_table(f) for f in files])
    return {c: t[c].to_numpy(zero_copy_only=False) for c in t.column_names}


@pytest.mark.parametrize(
    "keep", ["stats", "all"]
)  # statistics streamed while the model ran / from whole patterns
def test_per_text_rows_aggregate_to_the_merged_statistics(runs, keep):
    run = runs[keep]
    rows = _heads(run)
    merged = json.loads((run.path / "head_stats.json").read_text())["rows"]
    n_ok = run.manifest["n_ok"]
    assert n_ok == 38 and len(rows["text"]) == n_ok * len(merged)  # one row per captured text and head
    pairs = set(zip(rows["text"].tolist(), rows["layer"].tolist(), rows["head"].tolist(), strict=True))
    assert len(pairs) == len(rows["text"])  # no duplicate
    assert sorted(set(rows["text"].tolist())) == [i for i, e in enumerate(run.texts) if "error" not in e]
    for r in merged:
        sel = (rows["layer"] == r["layer"]) & (rows["head"] == r["head"])
        for m in METRICS:
            v = rows[m][sel].astype(np.float64)
            v = v[~np.isnan(v)]
            if m in ("dup_matches", "induction_matches"):  # totals over the texts
                want = v.sum() if len(v) else math.nan
            else:
                want = v.mean() if len(v) else math.nan
            assert _close(r[m], want), (r["layer"], r["head"], m, r[m], want)
            std = v.std(ddof=1) if len(v) > 1 else math.nan
            assert _close(r[f"{m}_std"], std), (r["layer"], r["head"], m)
        assert r["n_texts"] == int(sel.sum())


def _close(a, b, tol: float = 1e-9) -> bool:
    a = math.nan if a is None else a
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= tol * max(1.0, abs(b))


def test_a_text_s_row_is_its_statistics_by_definition(runs, gpt):
    """first, prev and the induction score of a text at each head, computed in the test from the
    pattern of that text captured alone (the definitions: mean over queries with two or more
    visible keys; previous token over queries that have one; induction mass over all mass)."""
    rows = _heads(runs["stats"])
    for i in (1, 9, 21):
        cache = probe.capture(gpt, TEXTS[i])
        ids = cache.metadata["ids"][0]
        T = len(ids)
        for layer in range(2):
            P = cache.pattern("decoder", layer)[0].double()  # [H, T, T]
            for h in range(P.shape[0]):
                sel = (rows["text"] == i) & (rows["layer"] == layer) & (rows["head"] == h)
                got = {m: float(rows[m][sel][0]) for m in ("first", "prev", "induction_score")}
                first = P[h, 1:, 0].mean().item()  # query 0 sees one key: not counted
                prev = torch.stack([P[h, q, q - 1] for q in range(1, T)]).mean().item()
                ind = (
                    sum(P[h, q, j].item() for q in range(T) for j in range(1, q + 1) if ids[j - 1] == ids[q])
                    / P[h].sum().item()
                )
                assert got["first"] == pytest.approx(first, abs=1e-5)
                assert got["prev"] == pytest.approx(prev, abs=1e-5)
                assert got["induction_score"] == pytest.approx(ind, abs=1e-5)


def test_each_row_s_role_is_the_role_rules_on_its_values(runs):
    rows = _heads(runs["all"])
    for n in range(len(rows["text"])):
        rs = roles_of({m: float(rows[m][n]) for m in METRICS})
        assert rows["role"][n] == (rs[0] if rs else "none")
        assert rows["roles"][n] == ",".join(rs)


def test_texts_hold_every_text_its_tokens_or_its_error(runs):
    run = runs["stats"]
    t = __import__("pyarrow").concat_tables(
        [pq.read_table(f) for f in sorted(run.path.glob("shards/*.texts.parquet"))]
    )
    d = t.to_pydict()
    assert d["text"] == list(range(40)) and d["source"] == TEXTS
    assert d["error"][3].startswith("minigpt tokenizer") and d["error"][7] and d["tokens"][3] == []
    cache = probe.capture(load_model("minigpt"), TEXTS[5])
    assert d["tokens"][5] == cache.metadata["tokens"][0] and d["ids"][5] == cache.metadata["ids"][0]
    assert d["n_tokens"][5] == len(TEXTS[5])  # minigpt reads characters


def test_top_bottom_and_where_equal_pandas_over_the_same_files(runs):
    pd = pytest.importorskip("pandas")
    run = runs["stats"]
    df = pd.DataFrame(_heads(run))
    for layer, head in ((0, 1), (1, 2)):
        one = df[(df.layer == layer) & (df["head"] == head) & df.induction_score.notna()]
        want = one.sort_values(["induction_score", "text"], ascending=[False, True]).head(5)
        got = run.top(layer, head, "induction_score", k=5)
        assert got.column("text") == want.text.tolist()
        assert got.column("source") == [TEXTS[i] for i in want.text]
        want = one.sort_values(["induction_score", "text"], ascending=[True, True]).head(3)
        assert run.bottom(layer, head, "induction_score", k=3).column("text") == want.text.tolist()
    got = run.where("first > 0.2 and layer = 1").to_pandas()
    want = df[(df["first"] > 0.2) & (df.layer == 1)].sort_values(["text", "layer", "head"])
    assert got.text.tolist() == want.text.tolist() and got["head"].tolist() == want["head"].tolist()
    n = run.query("select count(*) as n from heads where layer = ?", [1])
    assert n.rows == [{"n": int((df.layer == 1).sum())}]


def test_the_explorer_s_histogram_and_rankings_equal_numpy_over_the_same_files(runs):
    from probe.explore.data import BINS, Explorer

    run = runs["stats"]
    h = _heads(run)
    ex = Explorer(run.path)
    for layer, head, stat in ((0, 1, "induction_score"), (1, 2, "first"), (1, 0, "dup_prefix")):
        one = (h["layer"] == layer) & (h["head"] == head)
        v = h[stat][one].astype(np.float64)
        ok = v[~np.isnan(v)]
        d = ex.distribution("decoder", "self", layer, head, stat)
        assert (d["n"], d["missing"]) == (ok.size, v.size - ok.size)
        assert (d["lo"], d["hi"]) == (ok.min(), ok.max())
        want = [0] * BINS
        for x in ok:  # the bin of each value, by the documented rule, one at a time
            want[min(math.floor((x - ok.min()) / ((ok.max() - ok.min()) / BINS)), BINS - 1)] += 1
        assert d["bins"] == want and sum(want) == ok.size
        pairs = sorted(zip(ok, h["text"][one][~np.isnan(v)], strict=True), key=lambda p: (-p[0], p[1]))
        top = ex.ranked("decoder", "self", layer, head, stat, 5, True)
        assert [r["text"] for r in top] == [int(t) for _, t in pairs[:5]]
        assert [r[stat] for r in top] == [float(x) for x, _ in pairs[:5]]
        assert [r["source"] for r in top] == [TEXTS[r["text"]] for r in top]
        pairs.sort(key=lambda p: (p[0], p[1]))
        bottom = ex.ranked("decoder", "self", layer, head, stat, 3, False)
        assert [r["text"] for r in bottom] == [int(t) for _, t in pairs[:3]]
        # the same texts as the store's own ranking (a SQL order by), which the public API gives
        assert [r["text"] for r in top] == run.top(layer, head, stat, k=5).column("text")
    with pytest.raises(ProbeError, match="no decoder self-attention layer 9 head 0"):
        ex.ranked("decoder", "self", 9, 0, "first", 5, True)
    ex.close()


def test_examples_mark_the_positions_and_keys_of_the_patterns(runs, gpt):
    run = runs["stats"]
    ex = run.query("select * from examples where stat = 'induction_score' and direction = 'top'").rows
    heads = {(r["layer"], r["head"]) for r in ex}
    assert len(heads) == 8
    for layer, head in heads:  # the texts kept are the store's top texts, in order
        kept = sorted((r for r in ex if (r["layer"], r["head"]) == (layer, head)), key=lambda r: r["rank"])
        assert [r["text"] for r in kept] == run.top(layer, head, "induction_score", k=4).column("text")
    for r in ex[:12]:
        cache = probe.capture(gpt, TEXTS[r["text"]])
        ids = cache.metadata["ids"][0]
        P = cache.pattern("decoder", r["layer"])[0, r["head"]]
        for q, keys, weights, targets, term in zip(
            r["positions"], r["keys"], r["weights"], r["targets"], r["terms"], strict=True
        ):
            named = [j for j in range(1, q + 1) if ids[j - 1] == ids[q]]  # the induction template
            assert named and set(targets) <= set(named)
            assert term == pytest.approx(float(P[q, named].sum()), abs=1e-5)
            top = torch.topk(P[q], len(keys))
            assert keys == top.indices.tolist()
            np.testing.assert_allclose(weights, top.values.numpy(), atol=1e-5)
        # the chosen queries are those with the largest induction mass
        all_terms = sorted(
            (float(P[q, [j for j in range(1, q + 1) if ids[j - 1] == ids[q]]].sum()) for q in range(len(ids))
             if any(ids[j - 1] == ids[q] for j in range(1, q + 1))),
            reverse=True,
        )  # fmt: skip
        np.testing.assert_allclose(r["terms"], all_terms[: len(r["terms"])], atol=1e-5)


def test_the_examples_pass_captures_within_its_memory_budget():
    """The examples pass's captures: every (text, layer, head) it needs once, at most
    ``batch_size`` texts, and each capture's patterns (texts x longest² x heads x layers x 4
    bytes) within the budget unless it is one text and one layer."""
    from probe.corpus.showcase import captures

    rng = random.Random(1)
    order = list(range(30))
    lengths = {t: 10 + 40 * t for t in order}  # 10 to 1,170 tokens, by length already
    need = {
        t: {layer: set(rng.sample(range(9), rng.randint(1, 4))) for layer in rng.sample(range(6), 3)}
        for t in order
    }
    for budget in (10**5, 10**7, 10**9):
        plan = captures(order, need, lengths, 9, 8, budget)
        got = sorted(
            (t, layer, h) for batch, layers, heads in plan for t in batch for layer in layers
            for h in need[t].get(layer, ()) if h in heads
        )  # fmt: skip
        assert got == sorted((t, layer, h) for t in order for layer, hs in need[t].items() for h in hs)
        for batch, layers, heads in plan:
            assert 1 <= len(batch) <= 8 and layers and heads
            held = len(batch) * max(lengths[t] for t in batch) ** 2 * 4 * len(heads) * len(layers)
            assert held <= budget or (len(batch) == 1 and len(layers) == 1), (batch, layers, held)
    assert len(captures(order, need, lengths, 9, 8, 10**5)) > len(captures(order, need, lengths, 9, 8, 10**9))


def test_examples_are_the_same_whatever_the_budget(gpt, tmp_path, monkeypatch):
    """A run whose examples pass may hold almost nothing (a text and a layer at a time) keeps the
    same examples as one whose pass holds every layer of a batch."""
    import probe.corpus.showcase as showcase

    def run(name: str):
        kw = {"keep": "stats", "batch_size": 4, "shard_size": 8, "examples": EXAMPLES, "progress": False}
        return probe.run_corpus(gpt, TEXTS[:16], tmp_path / name, **kw)

    a = run("a")
    monkeypatch.setattr(showcase, "EXAMPLE_BYTES", 1)
    b = run("b")
    sql = "select * from examples order by text, stack, layer, head, stat, direction"
    ra, rb = a.query(sql).rows, b.query(sql).rows
    assert ra and len(ra) == len(rb)
    for x, y in zip(ra, rb, strict=True):  # another batch pads differently: the weights to rounding
        assert {k: v for k, v in x.items() if k not in ("terms", "weights")} == {
            k: v for k, v in y.items() if k not in ("terms", "weights")
        }
        assert np.allclose(x["terms"], y["terms"], atol=1e-5)
        assert all(np.allclose(u, w, atol=1e-5) for u, w in zip(x["weights"], y["weights"], strict=True))


def test_a_damaged_shard_is_one_line_naming_it(runs, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs["stats"].path, run)
    f = run / "shards" / "00002.heads.parquet"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # cut short
    corpus = probe.open_corpus(run)
    with pytest.raises(ProbeError) as e:
        corpus.top(1, 2, "first")
    msg = str(e.value)
    assert "\n" not in msg and str(f) in msg and "corrupt or half-written" in msg and "00002.json" in msg
    f.unlink()
    with pytest.raises(ProbeError, match="00002.heads.parquet is missing"):
        _ = probe.open_corpus(run).store


def test_a_run_killed_inside_its_writes_resumes_without_a_lost_or_doubled_row(
    gpt, runs, tmp_path, monkeypatch
):
    import probe.corpus.store as store

    real, calls = store.write_parquet, []

    def dying(path, tables, **kw):
        calls.append(path.name)
        if path.name == "00002.texts.parquet":  # shard 2's heads are written, its texts and record not
            raise KeyboardInterrupt
        return real(path, tables, **kw)

    monkeypatch.setattr(store, "write_parquet", dying)
    out = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        probe.run_corpus(
            gpt, TEXTS, out, keep="stats", batch_size=4, shard_size=8, examples=EXAMPLES, progress=False
        )
    assert (out / "shards" / "00002.heads.parquet").exists() and not (out / "shards" / "00002.json").exists()
    monkeypatch.setattr(store, "write_parquet", real)
    probe.run_corpus(
        gpt, TEXTS, out, keep="stats", batch_size=4, shard_size=8, examples=EXAMPLES, progress=False
    )
    ref = runs["stats"].path
    names = sorted(p.name for p in (ref / "shards").glob("*.parquet"))
    assert names == sorted(p.name for p in (out / "shards").glob("*.parquet"))
    for name in names:  # the same rows, in the same order (NaN where NaN)
        a, b = (pq.read_table(d / "shards" / name).to_pandas() for d in (out, ref))
        assert a.equals(b), name
    assert not list(out.rglob("*.tmp"))


def test_refusals(gpt, tmp_path):
    with pytest.raises(ProbeError, match="store=True keeps each text's statistics; it needs stats=True"):
        probe.run_corpus(gpt, TEXTS[:2], tmp_path / "a", keep="all", stats=False, store=True, progress=False)
    with pytest.raises(ProbeError, match="examples= are chosen from the per-text store"):
        probe.run_corpus(gpt, TEXTS[:2], tmp_path / "b", store=False, examples=True, progress=False)
    with pytest.raises(ProbeError, match="no statistic 'firs'"):
        probe.run_corpus(gpt, TEXTS[:2], tmp_path / "c", examples={"stats": ["firs"]}, progress=False)
    plain = probe.run_corpus(gpt, TEXTS[:2], tmp_path / "d", store=False, progress=False)
    with pytest.raises(ProbeError, match="was run without the per-text store"):
        plain.top(0, 0, "first")
