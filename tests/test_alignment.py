"""probe.align: word grouping, gold files, AER/precision/recall, soft matrices, the aligner's
held-out AER and the CLI, each against numbers written out by hand or recomputed independently."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import probe
from probe.analysis.alignment import (
    Gold,
    group_words,
    kendall_tau_b,
    parse_gold,
    read_gold,
    scores,
    shape_stats,
    symmetrize,
)
from probe.cache import Cache

# -- gold files ------------------------------------------------------------------------------------


def test_gold_parser_sure_possible_zero_and_one_indexed(tmp_path):
    text = "0-0 1p1 2-1\n\n3p0\n"
    g = parse_gold(text)
    assert len(g) == 3
    assert g[0].sure == {(0, 0), (2, 1)} and g[0].possible == {(0, 0), (2, 1), (1, 1)}  # S ⊆ P
    assert g[1].sure == set() and g[1].possible == set()
    assert g[2].sure == set() and g[2].possible == {(3, 0)}
    path = tmp_path / "gold.talp"
    path.write_text("1-1 2p2 3-2\n")
    one = read_gold(path, one_indexed=True)
    assert one[0].sure == {(0, 0), (2, 1)} and one[0].possible == {(0, 0), (1, 1), (2, 1)}


@pytest.mark.parametrize("bad", ["0-x", "1_2", "a-b"])
def test_gold_parser_rejects_malformed_links(bad):
    with pytest.raises(probe.ProbeError, match="not a link"):
        parse_gold(f"0-0 {bad}")


def test_gold_zero_in_a_one_indexed_file_is_an_error():
    with pytest.raises(probe.ProbeError, match="1-indexed"):
        parse_gold("0-1", one_indexed=True)


# -- metrics, hand-computed ------------------------------------------------------------------------


def test_aer_precision_recall_by_hand():
    # pair 1: S = {0-0, 1-1}, P = S + {2-1}; A = {0-0, 2-1, 1-2}: |A∩S| = 1, |A∩P| = 2, |A| = 3, |S| = 2
    # pair 2: S = {0-0}, P = S + {1-0};       A = {1-0}:           |A∩S| = 0, |A∩P| = 1, |A| = 1, |S| = 1
    gold = [Gold({(0, 0), (1, 1)}, {(2, 1)}), Gold({(0, 0)}, {(1, 0)})]
    A = [{(0, 0), (2, 1), (1, 2)}, {(1, 0)}]
    one = scores(A[:1], gold[:1])
    assert one["aer"] == pytest.approx(1 - (1 + 2) / (3 + 2))  # 0.4
    assert one["precision"] == pytest.approx(2 / 3) and one["recall"] == pytest.approx(1 / 2)
    both = scores(A, gold)  # corpus level: counts summed first
    assert both["aer"] == pytest.approx(1 - (1 + 3) / (4 + 3))
    assert both["precision"] == pytest.approx(3 / 4) and both["recall"] == pytest.approx(1 / 3)
    perfect = scores([{(0, 0), (1, 1)}], gold[:1])
    assert perfect == {"aer": 0.0, "precision": 1.0, "recall": 1.0}


def test_kendall_tau_b_by_hand():
    assert kendall_tau_b([0, 1, 2, 3], [0, 1, 2, 3]) == pytest.approx(1.0)
    assert kendall_tau_b([0, 1, 2], [2, 1, 0]) == pytest.approx(-1.0)
    # pairs: (0,1) concordant, (0,2) concordant, (1,2) tied in y: tau-b = 2 / sqrt(3 * 2)
    assert kendall_tau_b([0, 1, 2], [0, 1, 1]) == pytest.approx(2 / math.sqrt(6))
    assert math.isnan(kendall_tau_b([0, 1], [1, 1]))


def test_shape_stats_by_hand():
    M = torch.tensor([[0.7, 0.2, 0.0], [0.1, 0.05, 0.8]])  # 2 target words x 3 source words
    st = shape_stats([{(0, 0), (2, 1)}], [M], little=0.3)
    # diagonality: link 0-0: 1 - |0.5/3 - 0.5/2|; link 2-1: 1 - |2.5/3 - 1.5/2|
    assert st["diagonality"] == pytest.approx((1 - abs(1 / 6 - 1 / 4) + 1 - abs(5 / 6 - 3 / 4)) / 2)
    assert st["monotonicity"] == pytest.approx(1.0)
    assert st["coverage"] == pytest.approx(2 / 3)
    assert st["low_mass"] == pytest.approx(1 / 3)  # column sums 0.8, 0.25, 0.8
    p1 = torch.tensor([0.7, 0.2, 0.0]) / 0.9
    p2 = torch.tensor([0.1, 0.05, 0.8]) / 0.95
    h = [-(p[p > 0] * p[p > 0].log()).sum().item() for p in (p1, p2)]
    assert st["entropy"] == pytest.approx(sum(h) / 2)
    assert st["jumps"] == pytest.approx(abs(2 - 0 - 1))


def test_symmetrization_by_hand():
    fwd = {(0, 0), (1, 1), (3, 2)}
    bwd = {(0, 0), (1, 1), (2, 2)}
    assert symmetrize(fwd, bwd, "intersect") == {(0, 0), (1, 1)}
    assert symmetrize(fwd, bwd, "union") == fwd | bwd
    # grow-diag: (2,2) neighbours (1,1) diagonally and source 2 is unaligned -> added; then (3,2)
    # is not a neighbour of an intersection link... but it is of (2,2) and source 3 is free -> added
    assert symmetrize(fwd, bwd, "grow-diag-final") == {(0, 0), (1, 1), (2, 2), (3, 2)}
    # final: a link whose words are both aligned already stays out
    assert symmetrize({(0, 0), (1, 1), (0, 1)}, {(0, 0), (1, 1)}, "grow-diag-final") == {(0, 0), (1, 1)}


# -- words -----------------------------------------------------------------------------------------


def test_word_grouping_of_the_three_piece_styles():
    wp = group_words(["[CLS]", "die", "kinder", "##garten", "##s", "[SEP]"], [1, 0, 0, 0, 0, 1])
    assert wp.words == ["die", "kindergartens"] and wp.pieces == [[1], [2, 3, 4]]
    # byte-level BPE / SentencePiece as probe shows them: a leading space starts a word
    bpe = group_words(["<s>", "un", "believ", "able", " news", ".", "</s>"], [1, 0, 0, 0, 0, 0, 1])
    assert bpe.words == ["unbelievable", "news."] and bpe.pieces == [[1, 2, 3], [4, 5]]
    sp = group_words(["<pad>", "\u2581the", "\u2581", "w", "an", "t"], [1, 0, 0, 0, 0, 0])
    assert sp.words == ["the", "want"] and sp.pieces == [[1], [2, 3, 4, 5]]
    plain = group_words(["ich", "mochte", "P"], [0, 0, 1])
    assert plain.words == ["ich", "mochte"] and plain.pieces == [[0], [1]]


def _cache(P, src_tokens, tgt_tokens, src_special, tgt_special, name="hand"):
    """A hand-built cache: one decoder layer's cross-attention P [B, H, T, S] and its tokens."""
    meta = {
        "tokens": src_tokens,
        "target_tokens": tgt_tokens,
        "special_tokens_mask": src_special,
        "target_special_tokens_mask": tgt_special,
        "attention_mask": [[1] * len(t) for t in src_tokens],
        "target_attention_mask": [[1] * len(t) for t in tgt_tokens],
        "model": {"name": name},
    }
    return Cache({"decoder.blocks.0.cross_attn.pattern": P}, meta)


def test_subword_merging_sums_source_pieces_and_averages_target_pieces():
    # source: <s> ' kinder' 'garten' ' spielt' </s>  -> words kindergarten (pieces 1, 2), spielt (3)
    # target: </s> ' kinder' 'garten' ' plays'       -> decoder input; words kindergarten (1, 2), plays (3)
    P = torch.tensor(
        [
            [0.50, 0.20, 0.10, 0.10, 0.10],  # row 0: the start token, predicts ' kinder'
            [0.10, 0.40, 0.30, 0.10, 0.10],  # row 1: ' kinder' is the input
            [0.00, 0.20, 0.60, 0.10, 0.10],  # row 2: 'garten'
            [0.10, 0.10, 0.00, 0.70, 0.10],  # row 3: ' plays'
        ]
    )[None, None]
    src = [["<s>", " kinder", "garten", " spielt", "</s>"]]
    tgt = [["</s>", " kinder", "garten", " plays"]]
    c = _cache(P, src, tgt, [[1, 0, 0, 0, 1]], [[1, 0, 0, 0]])
    al = probe.align(c, layer=0, head=0)
    assert [w.words for w in al.source] == [["kindergarten", "spielt"]]
    assert [w.words for w in al.target] == [["kindergarten", "plays"]]
    # input convention: kindergarten = mean(rows 1, 2), plays = row 3; columns (1+2), 3
    expect_in = torch.tensor([[(0.7 + 0.8) / 2, (0.1 + 0.1) / 2], [0.1 + 0.0, 0.7]])
    torch.testing.assert_close(al.matrix(0, convention="input"), expect_in)
    # output convention: kindergarten = mean(rows 0, 1), plays = row 2
    expect_out = torch.tensor([[(0.3 + 0.7) / 2, (0.1 + 0.1) / 2], [0.8, 0.1]])
    torch.testing.assert_close(al.matrix(0, convention="output"), expect_out)
    assert al.links == [{(0, 0), (1, 1)}]
    out = probe.align(c, layer=0, head=0, convention="output")
    assert out.links == [{(0, 0), (0, 1)}]
    assert al.pharaoh() == "0-0 1-1\n" and al.pharaoh(one_indexed=True) == "1-1 2-2\n"


def test_gold_scores_every_head_and_picks_the_best():
    # two heads: head 0 diagonal, head 1 anti-diagonal; words are single tokens of the zoo
    # translator, whose S/E/P symbols are special
    diag = torch.tensor([[0.9, 0.1], [0.1, 0.9], [0.2, 0.8]])
    anti = torch.tensor([[0.1, 0.9], [0.9, 0.1], [0.8, 0.2]])
    P = torch.stack([torch.cat([diag, torch.zeros(3, 1)], 1), torch.cat([anti, torch.zeros(3, 1)], 1)])[None]
    c = _cache(P, [["ich", "bier", "P"]], [["S", "i", "beer"]], [[0, 0, 0]], [[0, 0, 0]], name="translator")
    al = probe.align(c, gold="0-0 1-1\n")
    rows = {(r["convention"], r["layer"], r["head"]): r for r in al.scores}
    # input convention, head 0: 'i' reads row 1 -> bier (1-0), 'beer' row 2 -> bier (1-1): one hit
    assert rows[("input", 0, 0)]["aer"] == pytest.approx(1 - (1 + 1) / (2 + 2))
    assert rows[("output", 0, 0)]["aer"] == pytest.approx(0.0)  # rows 0, 1: the diagonal
    assert rows[("output", 0, 1)]["aer"] == pytest.approx(1.0)  # rows 0, 1 of head 1: crossed
    # mean over heads, output: rows [0.5, 0.5] twice -> argmax takes the first: 0-0, 0-1
    assert rows[("output", 0, "mean")]["aer"] == pytest.approx(1 - (1 + 1) / (2 + 2))
    assert al.best["convention"] == "output" and al.best["head"] == 0 and al.best["aer"] == 0.0


def test_a_cache_of_some_heads_is_refused_unless_its_heads_are_the_first():
    # the hand-built cache of the test above; its two head entries are said to be model heads 1, 3:
    # an alignment would name them 0 and 1, so it refuses (heads 0, 1 are named right: accepted)
    diag = torch.tensor([[0.9, 0.1], [0.1, 0.9], [0.2, 0.8]])
    anti = torch.tensor([[0.1, 0.9], [0.9, 0.1], [0.8, 0.2]])
    P = torch.stack([torch.cat([diag, torch.zeros(3, 1)], 1), torch.cat([anti, torch.zeros(3, 1)], 1)])[None]
    c = _cache(P, [["ich", "bier", "P"]], [["S", "i", "beer"]], [[0, 0, 0]], [[0, 0, 0]], name="translator")
    c.metadata["heads_captured"] = [1, 3]
    with pytest.raises(probe.ProbeError, match=r"holds heads \[1, 3\] only"):
        probe.align(c)
    c.metadata["heads_captured"] = [0, 1]
    assert probe.align(c, gold="0-0 1-1\n").best["head"] == 0


def test_errors_name_the_problem():
    c = Cache({"decoder.blocks.0.self_attn.pattern": torch.ones(1, 1, 2, 2)}, {"tokens": [["a", "b"]]})
    with pytest.raises(probe.ProbeError, match="no cross-attention"):
        probe.align(c)
    P = torch.full((1, 1, 2, 2), 0.5)
    h = _cache(P, [["a", "b"]], [["x", "y"]], [[0, 0]], [[0, 0]])
    with pytest.raises(probe.ProbeError, match="2 source x 2 target"):
        probe.align(h, gold="5-0\n")
    with pytest.raises(probe.ProbeError, match="gold has 2 lines"):
        probe.align(h, gold="0-0\n1-1\n")
    with pytest.raises(probe.ProbeError, match="needs reverse"):
        probe.align(h, method="grow-diag-final")
    with pytest.raises(probe.ProbeError, match="not in the cache"):
        probe.align(h, layer=3)


# -- the zoo ----------------------------------------------------------------------------------------


def test_translator_alignment_reads_the_cache_it_was_given():
    import models

    m = models.load("translator")
    c = probe.capture(m, "ich mochte ein bier", target="S i want a beer")
    al = probe.align(c, gold="0-0 1-1 2-2 3-3\n")
    assert al.source[0].words == ["ich", "mochte", "ein", "bier"]
    assert al.target[0].words == ["i", "want", "a", "beer"]  # S is left out
    # oracle: the attention the model itself returns, summed by hand for the best selection
    with torch.no_grad():
        *_, cross = m(torch.tensor([[1, 2, 3, 4]]), torch.tensor([[5, 1, 2, 3, 4]]))
    b = al.best
    layer = cross[b["layer"]][0]
    att = layer.mean(0) if b["head"] == "mean" else layer[b["head"]]
    rows = [1, 2, 3, 4] if b["convention"] == "input" else [0, 1, 2, 3]
    links = {(int(att[r].argmax()), j) for j, r in enumerate(rows)}
    assert al.best["aer"] == pytest.approx(scores([links], [Gold({(0, 0), (1, 1), (2, 2), (3, 3)})])["aer"])


def test_aligner_held_out_aer_from_the_shipped_checkpoint():
    import models
    from models import aligner, aligner_data

    _, held = aligner_data.split()
    held = held[:200]
    model = models.load("aligner")
    caches = [
        probe.capture(
            model,
            [" ".join(p.source) for p in held[k : k + 100]],
            target=["S " + " ".join(p.target) for p in held[k : k + 100]],
        )
        for k in range(0, len(held), 100)
    ]
    gold = [Gold(p.sure, p.possible) for p in held]
    al = probe.align(caches, gold=gold)
    assert al.best["aer"] <= 0.15
    # oracle: the model's own returned cross-attention, pieces merged by the training code's map
    enc, dec, _, _ = aligner.encode_pairs(model.tokenizer, held)
    with torch.no_grad():
        *_, cross = model(enc, dec)
    b = al.best
    layer_att = cross[b["layer"]]
    links = []
    for k, p in enumerate(held):
        att = layer_att[k].mean(0) if b["head"] == "mean" else layer_att[k, b["head"]]
        pieces = []
        for pos, piece in enumerate(model.tokenizer.tokenize(" ".join(p.source))):
            (pieces[-1].append(pos) if piece.startswith("##") else pieces.append([pos]))
        A = set()
        for j in range(len(p.target)):
            r = 1 + j if b["convention"] == "input" else j
            mass = torch.stack([att[r, ps].sum() for ps in pieces])
            A.add((int(mass.argmax()), j))
        links.append(A)
    assert b["aer"] == pytest.approx(scores(links, gold)["aer"])


# -- CLI ---------------------------------------------------------------------------------------------


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "probe", *args], capture_output=True, text=True)


def test_cli_align_prints_links_scores_and_pharaoh(tmp_path):
    P = torch.tensor([[[0.9, 0.1], [0.2, 0.8]]])[None]
    c = _cache(P, [["a", "b"]], [["x", "y"]], [[0, 0]], [[0, 0]])
    path = c.save(tmp_path / "run.safetensors")
    gold = tmp_path / "g.talp"
    gold.write_text("1-1 2p2\n")
    r = _cli("align", str(path), "--gold", str(gold), "--one-indexed", "--layer", "0", "--head", "0")
    assert r.returncode == 0, r.stderr
    assert "x<-a  y<-b" in r.stdout and "AER 0.000" in r.stdout
    r = _cli("align", str(path), "--pharaoh", "--one-indexed")
    assert r.returncode == 0 and r.stdout == "1-1 2-2\n"
    r = _cli("align", str(path), "--gold", str(gold))  # 0-indexed reading: index 2 is out of range
    assert r.returncode == 2 and "outside" in r.stderr and "Traceback" not in r.stderr


def test_without_gold_the_heuristic_is_named_and_diagonal_heads_offered(tmp_path):
    # three decoder layers of two heads: layer 0 head 1 reads the source in order (the oracle);
    # the others read it back to front, so the gold-free default (layer 1, mean) is wrong here
    rev = torch.eye(3).flip(-1)[None].expand(2, 3, 3).clone()
    P = torch.stack([rev, rev, rev])  # [layer, head, target row, source]
    P[0, 1] = torch.eye(3)
    meta_cache = _cache(P[0][None], [["a", "b", "c"]], [["x", "y", "z"]], [[0, 0, 0]], [[0, 0, 0]])
    tensors = {f"decoder.blocks.{i}.cross_attn.pattern": P[i][None] for i in range(3)}
    c = Cache(tensors, meta_cache.metadata)
    al = probe.align(c)
    assert (al.layer, al.head) == (1, "mean") and al.links[0] == {(2, 0), (1, 1), (0, 2)}
    (best, *rest) = probe.analysis.alignment.candidates(al)
    assert (best["convention"], best["layer"], best["head"]) == ("input", 0, 1)
    assert best["diagonality"] == 1.0 and best["text"] == "a→x, b→y, c→z" and not best["chosen"]
    assert all(r["diagonality"] <= best["diagonality"] for r in rest)
    r = _cli("align", str(c.save(tmp_path / "run.safetensors")))
    assert r.returncode == 0, r.stderr
    assert "without gold links this layer and head are a heuristic" in r.stdout
    assert "input  layer 0 head 1: diagonality 1.000, monotonicity 1.000: a→x, b→y, c→z" in r.stdout
    r = _cli("align", str(tmp_path / "run.safetensors"), "--layer", "0", "--head", "1")
    assert "heuristic" not in r.stdout  # a chosen head is not a guess


# -- Hugging Face encoder-decoders -------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    H = pytest.importorskip("hf_fixtures")
    root = tmp_path_factory.mktemp("align_tok")
    bpe, sp = H.bpe_tokenizer(root / "bpe"), H.sentencepiece_tokenizer(root / "sp")
    return {"bart": (H.bart(len(bpe)), bpe), "t5": (H.t5(len(sp)), sp), "marian": (H.marian(len(sp)), sp)}


@pytest.mark.parametrize("name", ["bart", "t5", "marian"])
def test_hf_encoder_decoders_merge_pieces_and_drop_specials(hf_models, name):
    model, tok = hf_models[name]
    texts, targets = (
        ["the model is reading", "attention lets tokens read"],
        ["i want a beer", "ich mochte ein bier"],
    )
    c = probe.capture(model, texts, tokenizer=tok, target=targets)
    al = probe.align(c, layer=0, head=1)
    assert [s.words for s in al.source] == [t.split() for t in texts]
    # the decoder reads the labels shifted right: T5/Marian's tokenizer ends them with </s>, which is
    # what falls off; the test BPE adds no end token, so BART's last word is not a decoder input
    expect = [t.split()[:-1] if name == "bart" else t.split() for t in targets]
    assert [t.words for t in al.target] == expect
    meta = c.metadata
    for b in range(2):
        # oracle: the captured pattern merged by hand (sum over source pieces, mean over target rows)
        pieces_src = al.source[b].pieces
        pieces_tgt = al.target[b].pieces
        specials = [i for i, s in enumerate(meta["special_tokens_mask"][b]) if s]
        assert not any(p in specials for ps in pieces_src for p in ps)
        P = c.pattern("decoder", 0, "cross", head=1, batch=b).float()
        expect = torch.stack(
            [torch.stack([P[ps_t][:, ps_s].sum(-1).mean() for ps_s in pieces_src]) for ps_t in pieces_tgt]
        )
        torch.testing.assert_close(al.matrix(b), expect)
        tgt_specials = [i for i, s in enumerate(meta["target_special_tokens_mask"][b]) if s]
        assert tgt_specials and not any(p in tgt_specials for ps in pieces_tgt for p in ps)


# -- report section ----------------------------------------------------------------------------------


def test_report_section_builds_for_cross_attention_only(tmp_path):
    import types

    from probe.report.sections import alignment as section

    figures = []

    def figure(fig, alt=""):
        figures.append(fig.axes[0].get_xlabel())
        return "data:image/png;base64,"

    P = torch.tensor([[[0.9, 0.1], [0.2, 0.8]]])[None]
    c = _cache(P, [["a", "b"]], [["x", "y"]], [[0, 0]], [[0, 0]])
    ctx = types.SimpleNamespace(
        caches=[c],
        cache=c,
        results={"alignment_gold": "0-0 1p1\n"},
        figure=figure,
        json=lambda o: "",
        progress=lambda t: None,
    )
    s = section.build(ctx)
    assert s["best"]["aer"] == pytest.approx(0.0) and s["map_label"] == "AER"
    assert figures == ["source words", "", "head"]  # heatmap, links, layer x head map
    assert ctx.results["alignment"].links == [{(0, 0), (1, 1)}]
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(Path(probe.__file__).parent / "report" / "templates")),
        autoescape=True,
    )
    html = env.get_template("sections/alignment.html.j2").render(s=s, ctx=ctx)
    assert "AER 0.000" in html and "http" not in html
    self_only = Cache(
        {"decoder.blocks.0.self_attn.pattern": torch.ones(1, 1, 2, 2)}, {"tokens": [["a", "b"]]}
    )
    assert section.build(types.SimpleNamespace(cache=self_only, caches=[self_only], results={})) is None


@pytest.mark.slow
def test_probe_report_renders_the_alignment_section(tmp_path):
    import models

    c = probe.capture(
        models.load("aligner"),
        "gestern sah der junge das hundehaus",
        target="S yesterday the boy saw the dog house",
    )
    html = probe.report(c, tmp_path / "r", progress=False).read_text()
    assert "Cross-attention alignment" in html and "diagonality" in html
    assert "<i>gestern sah der junge das hundehaus</i>" in html  # compound merged back into one word
    assert "shifted decoder input and links by" in html  # words are not glued by the template's tags
    assert html.count('class="probe-download"') >= 3  # each figure downloads as PNG
    # gold links given to the report: marked on the heatmap, AER per layer x head
    gold = "0-0 1-3 2-1 3-2 4p4 5-5 5-6\n"  # yesterday the boy saw the dog house; one possible link
    html = probe.report(c, tmp_path / "g", progress=False, gold=gold).read_text()
    assert "red squares gold sure links, orange circles gold possible links" in html
    assert "AER per decoder layer" in html
    with pytest.raises(probe.ProbeError, match="no such file"):
        probe.report(c, tmp_path / "x", progress=False, gold=tmp_path / "missing.talp")
    assert not (tmp_path / "x").exists()  # refused before anything is written
    # the same from the command line: probe report CACHE --gold FILE (1-indexed here)
    c.save(tmp_path / "run.safetensors")
    (tmp_path / "g1.talp").write_text("1-1 2-4 3-2 4-3 5p5 6-6 6-7\n")
    r = _cli(
        "report",
        str(tmp_path / "run.safetensors"),
        "--gold",
        str(tmp_path / "g1.talp"),
        "--one-indexed",
        "-o",
        str(tmp_path / "cli"),
    )
    assert r.returncode == 0, r.stderr
    assert "AER per decoder layer" in (tmp_path / "cli" / "index.html").read_text()
    r = _cli(
        "report",
        str(tmp_path / "run.safetensors"),
        "--gold",
        str(tmp_path / "no.talp"),
        "-o",
        str(tmp_path / "c2"),
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and not (tmp_path / "c2").exists()
    minigpt = probe.capture(models.load("minigpt"), "attention")
    assert (
        "Cross-attention alignment" not in probe.report(minigpt, tmp_path / "m", progress=False).read_text()
    )


def test_threshold_and_two_direction_symmetrization_from_caches():
    from probe.analysis.alignment import hard_links

    M = torch.tensor([[0.7, 0.2], [0.05, 0.9]])
    assert hard_links(M, "threshold", 0.15) == {(0, 0), (1, 0), (1, 1)}
    # forward a b -> x y: both target words read 'a'; reverse x y -> a b: a reads x, b reads y
    fwd = _cache(
        torch.tensor([[[0.8, 0.2], [0.6, 0.4]]])[None], [["a", "b"]], [["x", "y"]], [[0, 0]], [[0, 0]]
    )
    rev = _cache(
        torch.tensor([[[0.9, 0.1], [0.3, 0.7]]])[None], [["x", "y"]], [["a", "b"]], [[0, 0]], [[0, 0]]
    )
    got = {
        m: probe.align(fwd, reverse=rev, method=m, layer=0, head=0).links[0]
        for m in ("intersect", "union", "grow-diag-final")
    }
    assert got["intersect"] == {(0, 0)}
    assert got["union"] == {(0, 0), (0, 1), (1, 1)}
    assert got["grow-diag-final"] == {(0, 0), (0, 1), (1, 1)}  # both neighbours align a free word
    with pytest.raises(probe.ProbeError, match="other way round"):
        probe.align(fwd, reverse=fwd, method="union")


def test_exports_and_cli_symmetrization_from_two_cache_files(tmp_path):
    import json

    fwd = _cache(
        torch.tensor([[[0.8, 0.2], [0.6, 0.4]]])[None], [["a", "b<"]], [["x", "y"]], [[0, 0]], [[0, 0]]
    )
    rev = _cache(
        torch.tensor([[[0.9, 0.1], [0.3, 0.7]]])[None], [["x", "y"]], [["a", "b<"]], [[0, 0]], [[0, 0]]
    )
    al = probe.align(fwd, reverse=rev, method="grow-diag-final", layer=0, head=0)
    d = json.loads(json.dumps(al.to_dict()))  # plain data
    assert d["selection"] == {"convention": "input", "layer": 0, "head": 0, "method": "grow-diag-final"}
    # the links worked out by hand in the test above: a-x, a-y, b-y
    assert d["pairs"] == [
        {
            "source": ["a", "b<"],
            "target": ["x", "y"],
            "links": [[0, 0], [0, 1], [1, 1]],
            "pharaoh": "0-0 0-1 1-1",
        }
    ]
    page = al._repr_html_()
    assert "a→x" in page and "b&lt;→y" in page and "b<" not in page  # escaped
    f, r = fwd.save(tmp_path / "fwd.safetensors"), rev.save(tmp_path / "rev.safetensors")
    out = _cli("align", str(f), "--reverse", str(r), "--method", "grow-diag-final", "--layer", "0",
               "--head", "0", "--pharaoh", "--json", str(tmp_path / "al.json"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout == "0-0 0-1 1-1\n"
    assert json.loads((tmp_path / "al.json").read_text())["pairs"][0]["links"] == [[0, 0], [0, 1], [1, 1]]
    bad = _cli("align", str(f), "--method", "union")
    assert bad.returncode == 2 and "reverse" in bad.stderr and "Traceback" not in bad.stderr
