"""Focus statistics on planted heads whose values are computed by hand, a TransformerLens
cross-check of the template scores, the streaming merge, real models, the CLI and the section."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import types

import pytest
import torch

import probe
from probe.analysis.focus import FocusAccumulator, RunningStats, head_stats, repeated_sequences
from probe.analysis.focus.definitions.tokens import word_starts

K0 = "decoder.blocks.0.self_attn.pattern"


def _meta(tokens, ids=None, special=None, mask=None, config=None):
    """Metadata as a capture writes it: unpadded token lists, padded masks."""
    T = max(len(t) for t in tokens)
    meta = {
        "tokens": tokens,
        "ids": ids or [list(range(1, len(t) + 1)) for t in tokens],
        "special_tokens_mask": special or [[0] * len(t) for t in tokens],
        "attention_mask": mask or [[1] * len(t) + [0] * (T - len(t)) for t in tokens],
    }
    if config is not None:
        meta["model"] = {"name": "planted", "config": config}
    return meta


def _row(stats, layer, head, kind="self"):
    (r,) = [r for r in stats.table if r["layer"] == layer and r["head"] == head and r["kind"] == kind]
    return r


def _planted_causal(T=5):
    """Four causal heads: previous-token, self, first-token, uniform."""
    prev = torch.zeros(T, T)
    prev[0, 0] = 1
    prev[torch.arange(1, T), torch.arange(T - 1)] = 1
    first = torch.zeros(T, T)
    first[:, 0] = 1
    uniform = torch.tril(torch.ones(T, T))
    uniform = uniform / uniform.sum(-1, keepdim=True)
    return torch.stack([prev, torch.eye(T), first, uniform])[None]


def test_planted_causal_heads_by_hand():
    P = _planted_causal()
    cache = probe.Cache({K0: P}, _meta([list("abcde")]))
    s = head_stats(cache, progress=False)
    prev, self_, first, uni = (_row(s, 0, h) for h in range(4))
    assert all(r["causal"] for r in (prev, self_, first, uni))
    # counted queries are i = 1..4 (query 0 has one visible key)
    assert prev["prev"] == 1 and prev["self"] == 0 and prev["first"] == pytest.approx(1 / 4)
    assert prev["entropy"] == 0 and prev["confidence"] == 1 and prev["span"] == 1
    assert prev["distance"] == 1 and prev["signed_distance"] == -1
    assert prev["pos_offset"] == -1 and prev["pos_frac"] == 1 and prev["local"] == 1
    assert prev["prev_score"] == pytest.approx(4 / 5)  # Σ(A⊙D)/ΣA: 4 hits over 5 rows
    assert math.isnan(prev["next"])  # no visible next key in a causal layer
    assert prev["role"] == "previous-token"
    assert self_["self"] == 1 and self_["prev"] == 0 and self_["first"] == 0 and self_["distance"] == 0
    assert self_["pos_offset"] == 0 and self_["role"] == "self" and self_["prev_score"] == 0
    assert first["first"] == 1 and first["prev"] == pytest.approx(1 / 4)
    assert first["distance"] == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert first["pos_frac"] == pytest.approx(1 / 4) and first["role"] == "sink"
    ent = (math.log(2) + math.log(3) + math.log(4) + math.log(5)) / 4
    assert uni["entropy"] == pytest.approx(ent, rel=1e-6)
    assert uni["norm_entropy"] == pytest.approx(1, rel=1e-6)
    assert uni["confidence"] == pytest.approx((1 / 2 + 1 / 3 + 1 / 4 + 1 / 5) / 4, rel=1e-6)
    assert uni["first"] == pytest.approx((1 / 2 + 1 / 3 + 1 / 4 + 1 / 5) / 4, rel=1e-6)
    assert uni["span"] == pytest.approx((2 + 3 + 4 + 5) / 4)  # every key is needed for 90%
    assert uni["distance"] == pytest.approx((0.5 + 1 + 1.5 + 2) / 4, rel=1e-6)
    # uniform also clears the sink threshold (first ≈ 0.32 > 0.3): priority gives broad/uniform
    assert uni["local"] == pytest.approx((1 + 1 + 3 / 4 + 3 / 5) / 4, rel=1e-6)  # |i-j| <= 2
    assert uni["role"] == "broad/uniform" and uni["roles"] == "broad/uniform,sink,local"
    assert s.sink_rate == {"decoder/self": 0.5}  # first-token head and uniform head
    # rollout through one layer: 0.5·mean_h W + 0.5·I
    assert torch.allclose(s.rollout["decoder"][0], 0.5 * P[0].mean(0) + 0.5 * torch.eye(5))


def _planted_bert():
    """Two texts (one padded), bidirectional: a next-token head and a [CLS] head."""
    tokens = [["[CLS]", "un", "##like", "[SEP]"], ["[CLS]", "hi", "[SEP]"]]
    special = [[1, 0, 0, 1], [1, 0, 1]]
    nxt = torch.zeros(2, 4, 4)
    for i in range(3):
        nxt[0, i, i + 1] = 1
    nxt[0, 3, 0] = 1
    nxt[1, 0, 1], nxt[1, 1, 2], nxt[1, 2, 0] = 1, 1, 1
    nxt[1, 3] = 0.25  # a padded query: whatever it holds must not count
    cls = torch.zeros(2, 4, 4)
    cls[:, :, 0] = 1
    P = torch.stack([cls, nxt], 1)  # the [CLS] head first: it alone looks causal
    return P, _meta(tokens, special=special)


def test_planted_bidirectional_with_padding_specials_and_words():
    P, meta = _planted_bert()
    s = head_stats(probe.Cache({"encoder.blocks.0.self_attn.pattern": P}, meta), progress=False)
    cls, nxt = _row(s, 0, 0), _row(s, 0, 1)
    assert not nxt["causal"] and nxt["n_texts"] == 2
    assert nxt["next"] == 1 and nxt["next_std"] == 0 and nxt["role"] == "next-token"
    # special mass: text 1 rows -> un, ##like, [SEP], [CLS] = 0,0,1,1; text 2 -> hi, [SEP], [CLS]
    assert nxt["special"] == pytest.approx((0.5 + 2 / 3) / 2, rel=1e-6)
    assert nxt["special_std"] == pytest.approx(abs(0.5 - 2 / 3) / math.sqrt(2), rel=1e-5)
    assert nxt["confidence"] == 1  # the [SEP] query (the end token) is left out
    # words: [CLS] | un ##like | [SEP]; from a word averaged, to a word summed
    # text 1 next-word: [CLS]->word1 = 1, (un->##like, ##like->[SEP]) -> [SEP] = 0.5; text 2: 1, 1
    assert nxt["word_next"] == pytest.approx((0.75 + 1) / 2)
    assert nxt["word_self"] == pytest.approx((0.5 / 3 + 0) / 2)
    assert cls["first"] == 1 and cls["special"] == 1 and cls["content"] == 0
    assert cls["signed_distance"] == pytest.approx(-((0 + 1 + 2 + 3) / 4 + (0 + 1 + 2) / 3) / 2)
    assert s.sink_rate == {"encoder/self": 0.5}


def test_many_caches_stream_to_the_same_numbers_as_one_batch():
    P, meta = _planted_bert()
    one = head_stats(probe.Cache({"encoder.blocks.0.self_attn.pattern": P}, meta), progress=False)
    parts = []
    for b in range(2):
        m = {k: [v[b]] for k, v in meta.items()}
        T = sum(m["attention_mask"][0])
        m["attention_mask"] = [m["attention_mask"][0][:T]]
        parts.append(probe.Cache({"encoder.blocks.0.self_attn.pattern": P[b : b + 1, :, :T, :T]}, m))
    many = head_stats(parts, progress=False)
    for a, b in zip(one.table, many.table, strict=True):
        for c in ("special", "special_std", "word_next", "next", "first"):
            assert a[c] == pytest.approx(b[c], rel=1e-9)


def test_induction_head_on_a_repeated_sequence_by_hand():
    ids = [[9, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5]]  # [BOS] r r, |r| = 5
    T, L = 11, 5
    ind = torch.zeros(T, T)
    ind[: L + 1, 0] = 1  # BOS, and the first copy (nothing to copy yet) on BOS
    for i in range(L + 1, T):
        ind[i, i - L + 1] = 1  # the token after the earlier occurrence of token i
    dup = torch.zeros(T, T)
    dup[: L + 1, 0] = 1
    for i in range(L + 1, T):
        dup[i, i - L] = 1  # the earlier occurrence itself
    meta = _meta([["<s>"] + list("abcdeabcde")], ids=ids, special=[[1] + [0] * 10])
    s = head_stats(probe.Cache({K0: torch.stack([ind, dup])[None]}, meta), progress=False)
    i, d = _row(s, 0, 0), _row(s, 0, 1)
    assert i["induction_prefix"] == 1 and i["induction_score"] == pytest.approx(5 / 11)
    assert i["dup_prefix"] == 0 and i["induction_matches"] == 5 and i["role"] == "induction"
    assert d["dup_prefix"] == 1 and d["dup_score"] == pytest.approx(5 / 11) and d["induction_prefix"] == 0
    assert d["role"] == "duplicate-token"
    assert i["special"] == pytest.approx(5 / 10)  # rows 1..5 of 10 counted rows sit on BOS
    # four matches are not enough evidence for a role
    short = [[9, 1, 2, 3, 4, 1, 2, 3, 4]]
    m4 = _meta([["<s>"] + list("abcdabcd")], ids=short, special=[[1] + [0] * 8])
    ind4 = torch.zeros(9, 9)
    ind4[:5, 0] = 1
    ind4[torch.arange(5, 9), torch.arange(2, 6)] = 1
    r4 = _row(head_stats(probe.Cache({K0: ind4[None, None]}, m4), progress=False), 0, 0)
    assert r4["induction_prefix"] == 1 and r4["induction_matches"] == 4 and r4["role"] != "induction"


def test_grouped_query_pair_from_the_recorded_config():
    P = _planted_causal()
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2}
    s = head_stats(probe.Cache({K0: P}, _meta([list("abcde")], config=cfg)), progress=False)
    assert [r["kv_head"] for r in s.table] == [0, 0, 1, 1]
    assert s.kv_groups == {0: [0, 1], 1: [2, 3]}
    # only heads 1 and 3 captured: rows carry the model's head numbers and their KV heads
    meta = _meta([list("abcde")], config=cfg)
    meta["heads_captured"] = [1, 3]
    s = head_stats(probe.Cache({K0: P[:, [1, 3]]}, meta), progress=False)
    assert [(r["head"], r["kv_head"], r["role"]) for r in s.table] == [
        (1, 0, "self"),
        (3, 1, "broad/uniform"),
    ]
    assert s.rollout == {}  # rollout needs every head of a layer


def test_grouped_query_llama_capture_records_its_groups(tmp_path):
    import hf_fixtures as H

    tok = H.bpe_tokenizer(tmp_path / "bpe")
    model = H.llama(len(tok))
    s = head_stats(probe.capture(model, "attention lets tokens read context.", tokenizer=tok), progress=False)
    assert s.kv_groups == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert all(r["causal"] for r in s.table)


class _TLModel:
    """What detect_head reads from a model: cfg, to_tokens; the patterns come from ``cache``."""

    def __init__(self, ids, n_layers, n_heads):
        self._ids = torch.tensor([ids])
        self.cfg = types.SimpleNamespace(
            device="cpu", n_ctx=1000, n_layers=n_layers, n_heads=n_heads, dtype=torch.float32
        )

    def to_tokens(self, seq):
        return self._ids


def test_template_scores_match_transformer_lens_detect_head():
    pytest.importorskip("transformer_lens")
    from transformer_lens.head_detector import detect_head

    g = torch.Generator().manual_seed(0)
    ids = [5, 1, 2, 3, 1, 2, 3, 4, 1, 2, 5, 3]
    T, H = len(ids), 6
    scores = torch.randn(2, H, T, T, generator=g) * 3
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    P = scores.softmax(-1)
    P[0, 0] = torch.roll(torch.eye(T), -1, 1).tril()  # a planted previous-token head (row 0 empty)
    P[0, 0, 0, 0] = 1
    keys = {f"decoder.blocks.{layer}.self_attn.pattern": P[layer : layer + 1] for layer in range(2)}
    s = head_stats(probe.Cache(keys, _meta([[str(i) for i in ids]], ids=[ids])), progress=False)
    tl_cache = {("pattern", layer, "attn"): P[layer] for layer in range(2)}
    model = _TLModel(ids, 2, H)
    for name, col in (
        ("previous_token_head", "prev_score"),
        ("duplicate_token_head", "dup_score"),
        ("induction_head", "induction_score"),
    ):
        tl = detect_head(model, "x", name, cache=tl_cache)
        ours = torch.tensor([[_row(s, layer, h)[col] for h in range(H)] for layer in range(2)])
        assert torch.allclose(ours, tl.float(), atol=1e-6), name


def test_running_stats_merge_exactly_in_any_order():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, 3, 4, generator=g, dtype=torch.float64) * 10 + 1e6
    x[7, 0, 0] = float("nan")  # missing observations are skipped element by element
    whole = RunningStats().update(x)
    a, b, c = RunningStats().update(x[:5]), RunningStats().update(x[5:31]), RunningStats().update(x[31:])
    merged = (
        RunningStats().merge(c).merge(a).merge(RunningStats.from_dict(json.loads(json.dumps(b.to_dict()))))
    )
    ok = ~torch.isnan(x)
    n = ok.sum(0)
    mean = torch.where(ok, x, 0).sum(0) / n
    var = torch.where(ok, (x - mean) ** 2, 0).sum(0) / (n - 1)
    for r in (whole, merged):
        assert torch.equal(r.count, n.double())
        assert torch.allclose(r.mean, mean, rtol=0, atol=1e-9)
        assert torch.allclose(r.var, var, rtol=1e-9)
    one = RunningStats().update(x[:1])
    assert torch.isnan(one.std).all()


def test_accumulator_round_trips_and_merges():
    P, meta = _planted_bert()
    parts = []
    for b in range(2):
        m = {k: [v[b]] for k, v in meta.items()}
        T = sum(m["attention_mask"][0])
        m["attention_mask"] = [m["attention_mask"][0][:T]]
        acc = FocusAccumulator().add(
            probe.Cache({"encoder.blocks.0.self_attn.pattern": P[b : b + 1, :, :T, :T]}, m)
        )
        parts.append(FocusAccumulator.from_dict(json.loads(json.dumps(acc.to_dict()))))
    merged = parts[0].merge(parts[1]).result()
    assert _row(merged, 0, 1)["special"] == pytest.approx((0.5 + 2 / 3) / 2)
    assert merged.n_texts == 2


def test_word_boundaries_from_display_tokens():
    assert word_starts(["[CLS]", "un", "##like", "it", "[SEP]"], [1, 0, 0, 0, 1]) == [1, 1, 0, 1, 1]
    assert word_starts(["The", " cat", "s", " sat", "."], [0] * 5) == [1, 1, 0, 1, 0]
    assert word_starts(["a", "b", " ", "c"], [0] * 4) == [1, 0, 1, 1]  # characters, spaces as tokens
    assert word_starts(["the", "cat"], [0, 0]) == [1, 1]  # word tokens


def test_minigpt_real_run_matches_a_direct_computation():
    import models

    m = models.load("minigpt")
    cache = probe.capture(m, "attention lets tokens read.")
    s = head_stats(cache, progress=False)
    assert len(s.table) == 8
    A = cache.pattern("decoder", 1, head=2, batch=0).double()
    rows = range(1, A.shape[0])
    ent = sum(-(A[i, : i + 1] * A[i, : i + 1].log()).sum().item() for i in rows) / len(rows)
    prev = sum(A[i, i - 1].item() for i in rows) / len(rows)
    r = _row(s, 1, 2)
    assert r["entropy"] == pytest.approx(ent, rel=1e-5) and r["prev"] == pytest.approx(prev, rel=1e-5)


def test_minilm_real_run_matches_a_direct_computation():
    from hf_fixtures import minilm

    model, tok, _ = minilm()
    cache = probe.capture(model, ["the unbelievable tokenization works.", "hi"], tokenizer=tok)
    s = head_stats(cache, progress=False)
    assert len(s.table) == 72 and all(not r["causal"] for r in s.table)
    A = cache.pattern("encoder", 3, head=5).double()  # [2, T, T]
    special = []
    for b, n in ((0, int(sum(cache.metadata["attention_mask"][0]))), (1, 3)):
        # rows are padded like attention_mask (BERT pads on the right): the first n are real
        sp = torch.tensor(cache.metadata["special_tokens_mask"][b][:n], dtype=torch.bool)
        special.append(A[b, :n, :n][:, sp].sum(-1).mean().item())
    r = _row(s, 3, 5)
    assert r["special"] == pytest.approx(sum(special) / 2, rel=1e-5)
    assert r["special_std"] == pytest.approx(abs(special[0] - special[1]) / math.sqrt(2), rel=1e-4)


def test_induction_scores_on_minigpt():
    import models

    ids = repeated_sequences(22, 5, 3, bos=None, exclude={0})
    assert ids.shape == (3, 10) and torch.equal(ids[:, :5], ids[:, 5:])
    assert all(len(set(r[:5].tolist())) == 5 and 0 not in r.tolist() for r in ids)
    t = probe.induction_scores(models.load("minigpt"), seeds=3, progress=False)
    assert len(t) == 8 and "induction_prefix_std" in t.columns
    assert all(0 <= r["induction_prefix"] <= 1 for r in t)


def test_induction_scores_vocab_size_is_used_and_checked():
    import causal_gallery as G

    import models

    seen = []

    def record(model):
        model.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(args[0] if args else kwargs["ids"]), with_kwargs=True
        )
        return model

    # a model that tells no vocabulary: vocab_size= is what makes it work (it used to be refused)
    t = probe.induction_scores(
        record(G.TinyLM(["ok", "ok"])), vocab_size=G.V, length=8, seeds=2, progress=False
    )
    assert len(t) == 2 * G.H
    ids = seen[-1]
    assert ids.shape == (2, 16) and torch.equal(ids[:, :8], ids[:, 8:]) and int(ids.max()) < G.V
    # a smaller vocabulary than the model's: only ids below it are drawn
    seen.clear()
    probe.induction_scores(record(models.load("minigpt")), vocab_size=6, length=5, seeds=3, progress=False)
    assert 0 < int(seen[-1].max()) < 6
    # a larger one than the model has, or no vocabulary, is refused in one line
    for bad, match in (
        (23, "exceeds the model's vocabulary of 22"),
        (1, "at least 2"),
        (True, "at least 2"),
        ("9", "at least 2"),
    ):
        with pytest.raises(probe.ProbeError, match=match):
            probe.induction_scores(models.load("minigpt"), vocab_size=bad, progress=False)
    with pytest.raises(probe.ProbeError, match="pass vocab_size="):
        probe.induction_scores(G.TinyLM(["ok", "ok"]), length=8, progress=False)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "probe", *args], capture_output=True, text=True)


def test_cli_stats(tmp_path, capsys):
    from probe.cli import main

    P = _planted_causal()
    path = probe.Cache({K0: P}, _meta([list("abcde")])).save(tmp_path / "run.safetensors")
    r = _cli("stats", str(path), "--sort", "prev", "--csv", str(tmp_path / "h.csv"))
    assert r.returncode == 0, r.stderr
    assert "previous-token" in r.stdout and (tmp_path / "h.csv").read_text().startswith("stack,layer")
    assert main(["stats", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["sink_rate"] == {"decoder/self": 0.5} and len(d["rows"]) == 4
    assert main(["stats", str(path), "--sort", "nope"]) == 2
    assert "not a metric" in capsys.readouterr().err
    assert main(["stats", str(tmp_path / "missing.safetensors")]) == 2
    assert "no such file" in capsys.readouterr().err
    texts = tmp_path / "texts.txt"
    texts.write_text("attention lets tokens read.\n\ngraph neural networks pass.\n")
    assert main(["stats", "--model", "minigpt", "--texts", str(texts), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 8 and all(r["n_texts"] == 2 for r in rows) and "prev_std" in rows[0]


def test_exports():
    P = _planted_causal()
    s = head_stats(probe.Cache({K0: P}, _meta([list("abcde")])), progress=False)
    assert s.top("prev", 1)[0]["head"] == 0
    assert s.map("self").shape == (1, 4) and s.map("self")[0, 1] == 1
    assert "<table>" in s._repr_html_() and "sink rate" in s._repr_html_()
    assert json.loads(s.to_json())["rows"][0]["next"] is None  # NaN -> null
    with pytest.raises(probe.ProbeError, match="no metric"):
        s.map("nope")


def _stand_in_ctx(caches):
    import base64
    import io

    import matplotlib.pyplot as plt

    def figure(fig, alt=""):
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        plt.close(fig)
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    return types.SimpleNamespace(
        caches=caches,
        cache=caches[0],
        model=None,
        tokenizer=None,
        results={},
        figure=figure,
        json=json.dumps,
        progress=lambda text: None,
    )


def test_report_section_builds_and_renders():
    from pathlib import Path

    import jinja2

    from probe.report.sections import focus as section

    P = _planted_causal()
    ctx = _stand_in_ctx(
        [
            probe.Cache(
                {K0: P}, _meta([list("abcde")], config={"num_attention_heads": 4, "num_key_value_heads": 2})
            )
        ]
    )
    s = section.build(ctx)
    (g,) = s["groups"]
    assert [c["role"] for c in g["grid"][0]["cells"]] == ["previous-token", "self", "sink", "broad/uniform"]
    assert g["sink_rate"] == 0.5 and "kv_head" in g["columns"] and len(g["maps"]) >= 10
    assert ctx.results["head_roles"]["decoder/self/0/0"] == "previous-token"
    folder = Path(section.__file__).parents[1] / "templates" / "sections"
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(folder), autoescape=True)
    html = env.get_template("focus.html.j2").render(s=s, ctx=ctx)
    assert html.count("<img") == len(g["maps"]) and "http" not in html.replace("http-equiv", "")
    assert "KV 0 ← heads 0, 1" in html
    assert section.build(_stand_in_ctx([probe.Cache({}, {})])) is None


def test_probe_report_renders_the_focus_section(tmp_path):
    P = _planted_causal()
    cache = probe.Cache({K0: P}, _meta([list("abcde")]))
    html = probe.report(cache, tmp_path / "r", progress=False).read_text()
    assert "Heads: focus statistics and roles" in html
    assert "probe-focus-select" in html and "previous-token" in html


def test_words_split_in_one_text_of_a_batch_only():
    # text 0 has no split word and as many tokens as text 1 has pieces: words must still be used
    tokens = [["[CLS]", "a", "b", "c", "[SEP]"], ["[CLS]", "un", "##like", "c", "[SEP]"]]
    P = torch.zeros(2, 1, 5, 5)
    P[:, 0, torch.arange(5), torch.tensor([1, 2, 3, 4, 0])] = 1  # next-token head
    s = head_stats(
        probe.Cache({"encoder.blocks.0.self_attn.pattern": P}, _meta(tokens, special=[[1, 0, 0, 0, 1]] * 2)),
        progress=False,
    )
    # text 1 words: [CLS] | un ##like | c | [SEP]; word_next per word: 1, (0 + 1) / 2, 1 -> mean 5/6
    assert _row(s, 0, 0)["word_next"] == pytest.approx((1 + 5 / 6) / 2)


def test_long_causal_rows_match_a_direct_computation_row_by_row():
    # T = 300 spans several row bands and the blocked lower-triangular rollout: every banded
    # quantity is computed here row by row on the visible keys only, in float64
    T, H, L = 300, 3, 3
    g = torch.Generator().manual_seed(0)
    mask = torch.full((T, T), float("-inf")).triu(1)
    P = torch.stack([(torch.randn(H, T, T, generator=g) * s + mask).softmax(-1) for s in (0.5, 3, 8)])
    P[1, 0] = torch.eye(T)  # a head with exact ties nowhere but many zero weights
    words = [(" " if i % 3 == 0 else "") + "x" for i in range(T)]  # 3-piece words
    words[7] = "."
    tensors = {f"decoder.blocks.{i}.self_attn.pattern": P[i][None] for i in range(L)}
    s = head_stats(probe.Cache(tensors, _meta([words])), progress=False)
    R = torch.eye(T, dtype=torch.float64)
    for layer in range(L):
        for h in range(H):
            A = P[layer, h].double()
            rows = range(1, T)
            ent = [-(A[i, : i + 1] * A[i, : i + 1].clamp_min(1e-300).log()).sum() for i in rows]
            top = [A[i, : i + 1].max() for i in rows]
            dist = [(A[i, : i + 1] * (i - torch.arange(i + 1))).sum() for i in rows]
            span = []
            for i in rows:
                v = A[i, : i + 1].sort(descending=True).values.cumsum(0)
                span.append(int((v < 0.9 * v[-1]).sum()) + 1)
            r = _row(s, layer, h)
            assert r["causal"]
            assert r["entropy"] == pytest.approx(float(sum(ent) / len(ent)), rel=1e-5, abs=1e-6)
            # no special end token here: every counted query counts for confidence
            assert r["confidence"] == pytest.approx(float(sum(top) / len(top)), rel=1e-5)
            assert r["distance"] == pytest.approx(float(sum(dist) / len(dist)), rel=1e-5)
            assert r["span"] == pytest.approx(sum(span) / len(span), rel=1e-5)
            assert r["punct"] == pytest.approx(float(A[7:, 7].sum() / (T - 1)), rel=1e-4, abs=1e-7)
            # word_self: mass on the query's own word (pieces summed), averaged over the word's
            # pieces, then over the words after the first (a causal first word sees only itself)
            own = [
                sum(A[i, 3 * w : i + 1].sum() for i in range(3 * w, 3 * w + 3)) / 3 for w in range(1, T // 3)
            ]
            assert r["word_self"] == pytest.approx(float(sum(own) / len(own)), rel=1e-5)
        W = 0.5 * P[layer].double().mean(0) + 0.5 * torch.eye(T, dtype=torch.float64)
        R = W @ R
    torch.testing.assert_close(s.rollout["decoder"][0].double(), R, atol=1e-5, rtol=1e-4)
