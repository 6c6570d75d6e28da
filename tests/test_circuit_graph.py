"""The circuit graph, choosing circuits, the metrics and the prompt sets, against hand computations.

Oracles: edge counts and greedy choices worked out by hand for small graphs; metric values
computed here from the logits with explicit indexing; prompt sets checked token by token with
the tokenizer itself.
"""

from __future__ import annotations

import pytest
import torch

from probe.errors import ProbeError
from probe.intervene.circuit.graph import Graph, LayerSpec, connected, greedy_edges, top_edges
from probe.intervene.circuit.metrics import last_positions, make_metric
from probe.intervene.circuit.prompts import induction_prompts, ioi_prompts


def _llama_like():
    return Graph([LayerSpec(0, 4, 2, (0, 0, 1, 1)), LayerSpec(1, 4, 2, (0, 0, 1, 1))])


def test_counts_by_hand():
    g = _llama_like()
    # nodes: input + 2 x (4 heads + MLP); targets: 2 x (4 q + 2 k + 2 v + MLP) + logits
    assert (len(g.nodes), len(g.targets)) == (11, 19)
    # L0 attention 8 targets x 1, L0 MLP x 5, L1 attention 8 x 6, L1 MLP x 10, logits x 11
    assert g.n_edges == 8 + 5 + 48 + 10 + 11
    assert g.targets[g.target("L1.KV1.k")].heads == (2, 3)
    assert [g.targets[j].name for j in g.readers(g.node("L1.H3"))] == ["L1.H3.q", "L1.KV1.k", "L1.KV1.v"]
    mha = Graph([LayerSpec(0, 2, mlp=False), LayerSpec(1, 2, mlp=False)])
    assert [t.name for t in mha.targets[:6]] == [
        "L0.H0.q",
        "L0.H1.q",
        "L0.H0.k",
        "L0.H0.v",
        "L0.H1.k",
        "L0.H1.v",
    ]
    assert mha.n_edges == 6 * 1 + 6 * 3 + 5


def test_parallel_blocks_heads_do_not_feed_their_mlp():
    g = Graph([LayerSpec(0, 2, parallel=True), LayerSpec(1, 2, parallel=True)])
    m = g.mask()
    assert not m[g.node("L0.H1"), g.target("L0.MLP")]
    assert m[g.node("L0.MLP"), g.target("L1.H0.q")]
    assert m[g.node("L0.H1"), g.target("L1.MLP")]
    with pytest.raises(ProbeError, match="not an edge"):
        g.edge("L0.H0 -> L0.MLP")


def test_json_round_trip():
    g = _llama_like()
    back = Graph.from_json(g.to_json())
    assert back.to_dict() == g.to_dict()
    assert torch.equal(back.mask(), g.mask())
    bad = g.to_dict()
    bad["nodes"] = bad["nodes"][:-1]
    with pytest.raises(ProbeError, match="node list"):
        Graph.from_dict(bad)


def _tiny_scores():
    """One layer, two heads, no MLP: 9 edges, scores chosen by hand."""
    g = Graph([LayerSpec(0, 2, mlp=False)])
    s = torch.full((len(g.nodes), len(g.targets)), float("nan"))
    for name, v in {
        "input -> logits": 0.5,
        "L0.H0 -> logits": -3.0,
        "L0.H1 -> logits": 0.1,
        "input -> L0.H0.q": 0.2,
        "input -> L0.H0.k": 2.0,
        "input -> L0.H0.v": -0.3,
        "input -> L0.H1.q": 5.0,  # large, but H1 -> logits is small: greedy reaches it late
        "input -> L0.H1.k": 0.0,
        "input -> L0.H1.v": 0.05,
    }.items():
        s[g.edge(name)] = v
    return g, s


def _names(g, chosen):
    return sorted(g.edge_name(i, j) for i, j in chosen.nonzero().tolist())


def test_top_and_greedy_by_hand():
    g, s = _tiny_scores()
    assert _names(g, top_edges(g, s, 2)) == ["L0.H0 -> logits", "input -> L0.H1.q"]
    # greedy: logits edges first (|-3| wins), then H0's inputs join the candidates (2.0 wins),
    # then input -> logits (0.5) beats H0's other inputs (0.3, 0.2) and H1 -> logits (0.1)
    assert _names(g, greedy_edges(g, s, 3)) == ["L0.H0 -> logits", "input -> L0.H0.k", "input -> logits"]
    # then H0's other inputs (0.3, 0.2), then H1 -> logits (0.1), which brings H1's inputs in
    six = _names(g, greedy_edges(g, s, 6))
    assert "L0.H1 -> logits" in six and "input -> L0.H1.q" not in six
    assert "input -> L0.H1.q" in _names(g, greedy_edges(g, s, 7))
    with pytest.raises(ProbeError, match="cannot choose"):
        top_edges(g, s, 10)


def test_connected_drops_dangling_edges():
    g, s = _tiny_scores()
    chosen = torch.zeros_like(g.mask())
    for e in ["input -> L0.H1.q", "L0.H0 -> logits"]:  # H1 reaches nothing; H0 reads nothing chosen
        chosen[g.edge(e)] = True
    assert _names(g, connected(g, chosen)) == []
    chosen[g.edge("input -> L0.H0.v")] = True
    assert _names(g, connected(g, chosen)) == ["L0.H0 -> logits", "input -> L0.H0.v"]


def test_metrics_by_hand_with_padding():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # right, left, none
    last = last_positions(mask, 5, 3)
    assert last.tolist() == [2, 4, 4]
    ex = torch.tensor([0, 1, 2])
    ld = make_metric("logit-diff", [(1, 2), (3, 4), (5, 6)], 3)
    want = [
        logits[0, 2, 1] - logits[0, 2, 2],
        logits[1, 4, 3] - logits[1, 4, 4],
        logits[2, 4, 5] - logits[2, 4, 6],
    ]
    assert torch.allclose(ld.rows(logits, last, ex), torch.stack(want))
    pr = make_metric("prob", [1, 3, 5], 3)
    p = [logits[0, 2].softmax(-1)[1], logits[1, 4].softmax(-1)[3], logits[2, 4].softmax(-1)[5]]
    assert torch.allclose(pr.rows(logits, last, ex), torch.stack(p))
    kl = make_metric("kl", None, 3)
    other = torch.randn(3, 5, 7)
    clean = torch.stack([logits[b, last[b]] for b in range(3)]).log_softmax(-1)
    run = torch.stack([other[b, last[b]] for b in range(3)]).log_softmax(-1)
    want = (clean.exp() * (clean - run)).sum(-1)
    assert torch.allclose(kl.rows(other, last, ex, clean), want)
    assert torch.allclose(kl.rows(logits, last, ex, clean), torch.zeros(3), atol=1e-6)


def test_metric_refusals():
    with pytest.raises(ProbeError, match="needs answers"):
        make_metric("logit-diff", None, 2)
    with pytest.raises(ProbeError, match="wrong token"):
        make_metric("logit-diff", [1, 2, 3], 3)
    with pytest.raises(ProbeError, match="one per example"):
        make_metric("prob", [1, 2, 3], 2)
    with pytest.raises(ProbeError, match="metric="):
        make_metric("accuracy", (1, 2), 2)


def test_ioi_prompts_names_swapped_and_single_tokens():
    import transformers
    from hf_fixtures import minilm_dir

    from probe.capture.inputs.tokenizers import adapt

    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir())
    ps = ioi_prompts(12, tok, seed=3)
    t = adapt(tok)
    assert len(ps) == 12
    for c, k, (io, s), info in zip(ps.clean, ps.corrupted, ps.answers, ps.info, strict=True):
        assert c.count(io.strip()) == 1 and c.count(s.strip()) == 2
        assert k.count(s.strip()) == 1 and k.count(io.strip()) == 2  # the names swapped everywhere
        assert len(t.encode(c).ids) == len(t.encode(k).ids)
        assert sum(not x for x in t.encode(io).special) == 1
        assert info["io"] == io.strip()
    assert len({i["template"] for i in ps.info}) > 4


def test_induction_prompts_structure():
    ps = induction_prompts(20, "ABCDEFGHIJKLMNOPQRSTUVWXYZ", half=10, shown=4, seed=1)
    for c, k, (right, wrong) in zip(ps.clean, ps.corrupted, ps.answers, strict=True):
        assert len(c) == len(k) == 1 + 10 + 4 and c[0] == k[0] == "^"
        first, other, second = c[1:11], k[1:11], c[11:]
        assert second == first[:4] == k[11:]  # the same second half: the first four repeated
        cur = second[-1]
        assert first.count(cur) == 1 and first[first.index(cur) + 1] == right
        assert other.count(cur) == 1 and other[other.index(cur) + 1] == wrong != right
    ids = induction_prompts(3, list(range(1, 30)), half=6, shown=3, bos=0)
    assert ids.clean.shape == ids.corrupted.shape == (3, 10)


def test_circuit_result_exports_round_trip():
    import csv
    import io
    import json

    from probe.intervene.circuit import Circuit

    g, s = _tiny_scores()
    c = Circuit(g, s, method="eap", metric="m<b>", references={"clean": 2.0, "corrupted": -1.0})
    assert [r["edge"] for r in c.table.rows[:3]] == [
        "input -> L0.H1.q",
        "L0.H0 -> logits",
        "input -> L0.H0.k",
    ]
    assert c.rank("L0.H0->logits") == 2 and c.score("input -> L0.H0.v") == pytest.approx(-0.3)
    back = Circuit.from_json(c.to_json())
    assert back.table.rows == c.table.rows and back.references == c.references
    rows = list(csv.DictReader(io.StringIO(c.to_csv())))
    assert [r["edge"] for r in rows] == c.table.column("edge") and float(rows[1]["score"]) == -3.0
    assert json.loads(c.to_json())["graph"] == g.to_dict()
    html = c._repr_html_()
    assert "m&lt;b&gt;" in html and "input -&gt; L0.H1.q" in html and "m<b>" not in html
    sel = c.greedy(3)
    assert len(sel) == 3 and sel.nodes == ["input", "L0.H0"]
    with pytest.raises(ProbeError, match="no model attached"):
        back.greedy(3).evaluate()
