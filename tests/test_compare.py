"""probe.compare, `probe diff` and the side-by-side report.

Oracles: differences computed here from the raw cached tensors (``cache[key]``) and the attention
masks in the metadata, row by row in float64; models edited by hand (one head's query weights
perturbed in a copy), where every head before the edit must match exactly.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import probe
from probe.analysis.compare import pattern_difference
from probe.analysis.focus.definitions.terms import METRICS
from probe.errors import ProbeError

TEXT_A = "attention lets tokens read."
TEXT_B = "attention lets tokens reed."  # same length, one character changed


@pytest.fixture(scope="module")
def minigpt():
    import models

    return models.load("minigpt")


def _perturbed(model, layer=1, head=2, scale=0.5, seed=0):
    """A copy of minigpt with the query weights of one head perturbed (nothing else changes)."""
    twin = copy.deepcopy(model)
    q = twin.blocks[layer].attn.heads[head].query.weight
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        q.add_(scale * torch.randn(q.shape, generator=g))
    return twin


def _real(meta, t, n):
    mask = meta.get("attention_mask")
    return list(range(n)) if mask is None else [i for i, m in enumerate(mask[t]) if m]


def _oracle(a, b, key, ha, hb, texts):
    """(max_abs, mean_abs, tv, js) of head ``ha`` of A vs ``hb`` of B, by hand over ``texts``."""
    A, B = a[key].double(), b[key].double()
    maxes, means, tvs, jss = [], [], [], []
    for t in texts:
        ra, rb = _real(a.metadata, t, A.shape[2]), _real(b.metadata, t, B.shape[2])
        cells, rows_tv, rows_js, biggest = [], [], [], 0.0
        for qa, qb in zip(ra, rb, strict=True):
            tv = js = 0.0
            for ka, kb in zip(ra, rb, strict=True):
                p, q = A[t, ha, qa, ka].item(), B[t, hb, qb, kb].item()
                cells.append(abs(p - q))
                biggest = max(biggest, abs(p - q))
                tv += abs(p - q) / 2
                m = (p + q) / 2
                js += 0.5 * p * math.log(p / m) if p > 0 else 0.0
                js += 0.5 * q * math.log(q / m) if q > 0 else 0.0
            rows_tv.append(tv)
            rows_js.append(js)
        maxes.append(biggest)
        means.append(sum(cells) / len(cells))
        tvs.append(sum(rows_tv) / len(rows_tv))
        jss.append(sum(rows_js) / len(rows_js))
    n = len(texts)
    return max(maxes), sum(means) / n, sum(tvs) / n, sum(jss) / n


def _check_against_oracle(c, a, b, stack="decoder", texts=(0,)):
    for r in c.heads:
        key = f"{stack}.blocks.{r['layer']}.self_attn.pattern"
        want = _oracle(a, b, key, r["head"], r["head"], texts)
        got = (r["max_abs"], r["mean_abs"], r["tv"], r["js"])
        assert got == pytest.approx(want, abs=1e-9), (r["layer"], r["head"])


def test_pattern_difference_by_hand():
    p = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]])
    q = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])
    d = pattern_difference(p, q)
    assert d["max_abs"].tolist() == [1.0]
    assert d["mean_abs"].tolist() == [0.5]  # |Δ| = 1, 1, 0, 0
    assert d["tv"].tolist() == [0.5]  # row TVs 1 and 0
    assert d["js"].item() == pytest.approx(math.log(2) / 2)  # disjoint rows reach log 2
    with pytest.raises(ProbeError, match="cannot be compared"):
        pattern_difference(p, q[..., :1])


def test_two_prompts_of_the_same_length(minigpt):
    a, b = probe.capture(minigpt, TEXT_A), probe.capture(minigpt, TEXT_B)
    c = probe.compare(a, b)
    assert len(c.heads) == 8 and c.skipped == [] and not c.same_tokens
    assert all(r["n_texts"] == 1 for r in c.heads)
    _check_against_oracle(c, a, b)
    # the changed character is position 23: every query before it reads the same prefix
    for layer in (0, 1):
        P, Q = a.pattern("decoder", layer, batch=0), b.pattern("decoder", layer, batch=0)
        assert torch.equal(P[:, :23], Q[:, :23])
    top = c.top(3)
    tvs = sorted((r["tv"] for r in c.heads), reverse=True)
    assert [r["tv"] for r in top] == tvs[:3]


def test_a_perturbed_head_is_the_only_change_up_to_its_layer(minigpt):
    twin = _perturbed(minigpt, layer=1, head=2)
    a, b = probe.capture(minigpt, TEXT_A), probe.capture(twin, TEXT_A)
    c = probe.compare(a, b)
    assert c.same_tokens
    _check_against_oracle(c, a, b)
    for r in c.heads:
        changed = (r["layer"], r["head"]) == (1, 2)
        assert (r["max_abs"] > 0.01) if changed else (r["max_abs"] == 0.0), (r["layer"], r["head"])
        # statistics: identical patterns give identical statistics, exactly
        if not changed:
            assert all(r[f"d_{m}"] == 0.0 for m in ("entropy", "first", "prev"))
    (t,) = c.top(1)
    assert (t["layer"], t["head"]) == (1, 2)
    # the long statistics table: b - a, and a/b are each cache's own head_stats
    sa = probe.head_stats(a, progress=False).table
    sb = probe.head_stats(b, progress=False).table
    (ra,) = [r for r in sa if r["layer"] == 1 and r["head"] == 2]
    (rb,) = [r for r in sb if r["layer"] == 1 and r["head"] == 2]
    rows = {r["metric"]: r for r in c.stats if r["layer"] == 1 and r["head"] == 2}
    assert rows["entropy"]["a"] == ra["entropy"] and rows["entropy"]["b"] == rb["entropy"]
    assert rows["entropy"]["delta"] == rb["entropy"] - ra["entropy"]
    m = c.map("tv")
    assert m.shape == (2, 4) and m[1, 2] == t["tv"] and m[0].abs().sum() == 0


def test_hf_gpt2_batch_with_padding(tmp_path):
    import hf_fixtures as H

    tok = H.bpe_tokenizer(tmp_path / "bpe")
    model = H.gpt2(len(tok))
    twin = copy.deepcopy(model)
    with torch.no_grad():  # layer 1's c_attn: columns 0..63 are the queries, head 3 is 48..63
        twin.transformer.h[1].attn.c_attn.weight[:, 48:64] += 0.3
    texts = ["the model is reading", "attention lets tokens read context here."]
    a, b = probe.capture(model, texts, tokenizer=tok), probe.capture(twin, texts, tokenizer=tok)
    assert 0 in a.metadata["attention_mask"][0]  # the short text is padded
    a.save(tmp_path / "a.safetensors")
    b.save(tmp_path / "b.safetensors")
    c = probe.compare(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert c.labels == ("a.safetensors", "b.safetensors")
    assert len(c.heads) == 12 and all(r["n_texts"] == 2 for r in c.heads)
    _check_against_oracle(c, probe.load(tmp_path / "a.safetensors"), b, texts=(0, 1))
    for r in c.heads:
        assert (r["max_abs"] > 0) == ((r["layer"], r["head"]) == (1, 3) or r["layer"] == 2)


def test_what_does_not_match_is_listed(minigpt):
    full = probe.capture(minigpt, TEXT_A)
    part = probe.capture(minigpt, TEXT_A, layers=[1], heads=[0, 2])
    c = probe.compare(full, part)
    assert [(r["layer"], r["head"]) for r in c.heads] == [(1, 0), (1, 2)]
    assert "decoder self-attention layers 0 only in A" in c.skipped
    assert "decoder self-attention layer 1 heads 1, 3 only in A" in c.skipped
    assert all(r["max_abs"] == 0.0 for r in c.heads)
    # head_stats of a cache holding layer 1 only (it used to look for layer 0) equal the full one's
    assert all(r["delta"] == 0 or (math.isnan(r["a"]) and math.isnan(r["b"])) for r in c.stats)
    # different lengths: statistics compared, patterns not, and the reason is listed
    short = probe.capture(minigpt, "short text")
    c = probe.compare(full, short)
    assert not c.compared_patterns and all(math.isnan(r["tv"]) for r in c.heads)
    assert any("27×27" in s and "10×10" in s for s in c.skipped)
    with pytest.raises(ProbeError, match="no patterns were compared"):
        c.top(3)
    assert len(c.top(3, by="d_entropy")) == 3
    # different numbers of texts
    c = probe.compare(full, probe.capture(minigpt, [TEXT_A, TEXT_B]))
    assert any("A holds 1 text(s), B 2" in s for s in c.skipped) and not c.compared_patterns


def test_nothing_comparable_is_an_error(minigpt):
    a = probe.capture(minigpt, TEXT_A, layers=[0])
    b = probe.capture(minigpt, TEXT_A, layers=[1])
    with pytest.raises(ProbeError, match="nothing to compare.*layers 0 only in A"):
        probe.compare(a, b)
    with pytest.raises(ProbeError, match="two probe.Cache objects"):
        probe.compare(a, 3)
    with pytest.raises(ProbeError, match="no such file"):
        probe.compare(a, "missing.safetensors")


def test_exports(minigpt, tmp_path):
    pd = pytest.importorskip("pandas")
    a, b = probe.capture(minigpt, TEXT_A), probe.capture(_perturbed(minigpt), TEXT_A)
    c = probe.compare(a, b)
    d = json.loads(c.to_json(tmp_path / "c.json"))
    assert d["heads"]["rows"] == json.loads(c.heads.to_json())["rows"]
    assert json.loads((tmp_path / "c.json").read_text()) == d
    assert len(d["stats"]["rows"]) == 8 * len(METRICS) and d["labels"] == list(c.labels)
    text = c.to_csv()
    assert text.splitlines()[0].startswith("stack,layer,head,kind,n_texts,max_abs")
    assert len(text.splitlines()) == 9
    df = c.to_pandas()
    assert isinstance(df, pd.DataFrame) and df["tv"].tolist() == c.heads.column("tv")
    h = c._repr_html_()
    assert "<table>" in h and "<script" not in h
    with pytest.raises(ProbeError, match="cannot rank"):
        c.top(3, by="role_a")
    with pytest.raises(ProbeError, match="no numeric column"):
        c.map("bogus")


def _cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "probe", *args], capture_output=True, text=True)


def test_cli_diff(minigpt, tmp_path, capsys):
    from probe.cli import main

    a = probe.capture(minigpt, TEXT_A).save(tmp_path / "a.safetensors")
    b = probe.capture(_perturbed(minigpt), TEXT_A).save(tmp_path / "b.safetensors")
    r = _cli("diff", str(a), str(b), "--top", "2", "--csv", str(tmp_path / "d.csv"))
    assert r.returncode == 0, r.stderr
    want = probe.compare(a, b).top(2)
    lines = r.stdout.splitlines()
    assert lines[0] == "a.safetensors vs b.safetensors: 8 heads compared"
    table = lines[lines.index("") + 1 :]
    first = table[2].split()  # header, rule, then the heads in order
    assert first[:4] == ["decoder", "1", "2", "self"] and float(first[7]) == pytest.approx(
        want[0]["tv"], rel=1e-3
    )
    assert table[3].split()[:3] == ["decoder", str(want[1]["layer"]), str(want[1]["head"])]
    assert (tmp_path / "d.csv").read_text() == probe.compare(a, b).to_csv()
    assert main(["diff", str(a), str(b), "--json", str(tmp_path / "d.json")]) == 0
    d = json.loads((tmp_path / "d.json").read_text())
    assert len(d["heads"]["rows"]) == 8 and len(d["stats"]["rows"]) == 8 * len(METRICS)
    capsys.readouterr()
    for bad, msg in (
        (["diff", str(a), str(tmp_path / "none.safetensors")], "no such file"),
        (["diff", str(a), str(b), "--by", "nope"], "--by nope: choose one of"),
        (["diff", str(a), str(b), "--top", "0"], "--top 0"),
    ):
        assert main(bad) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    r = _cli("diff", "--help")
    assert r.returncode == 0 and "probe diff before.safetensors after.safetensors" in r.stdout
    r = _cli("diff", str(a))
    assert r.returncode == 2 and "Traceback" not in r.stderr


# -- the side-by-side report -----------------------------------------------------------------------
def _views(text):
    import re

    blocks = re.findall(
        r'<div class="probe-attn" data-view="([\w-]+)">\s*<script[^>]*>(.*?)</script>', text, re.S
    )
    return {name: json.loads(data) for name, data in blocks}


def _weights(view, si=0):
    import base64
    import zlib

    import numpy as np

    s = view["sets"][si]
    q = np.frombuffer(
        zlib.decompress(base64.b64decode(s["full"])), dtype="<u2" if view["bytes"] == 2 else "u1"
    )
    return q.reshape(s["nFull"], s["nq"], s["nk"]) / view["scale"]


@pytest.fixture(scope="module")
def pair_report(minigpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pair")
    a = probe.capture(minigpt, TEXT_A).save(tmp / "before.safetensors")
    b = probe.capture(_perturbed(minigpt), TEXT_A).save(tmp / "after.safetensors")
    return probe.load(a), probe.load(b), probe.report([a, b], tmp / "out", progress=False)


def test_report_of_two_caches_shows_them_side_by_side(pair_report):
    import re

    a, b, path = pair_report
    text = path.read_text(encoding="utf-8")
    anchors = re.findall(r'<section class="probe-section" id="sec-(\w+)"', text)
    assert "compare" in anchors and anchors.index("attention") < anchors.index("compare")
    section = text[text.index('id="sec-compare"') :]
    section = section[: section.index("</section>")]
    assert "before.safetensors" in section and "after.safetensors" in section
    assert section.count("<img") == 5  # the total-variation map and four statistic maps
    # the table of heads that changed most starts with the perturbed head
    first_row = re.search(r"<tbody><tr>(.*?)</tr>", section).group(1)
    assert re.findall(r"<td>(.*?)</td>", first_row)[:4] == ["decoder", "1", "2", "self"]
    # each side's explorer holds its own cache's weights, within half a quantisation step
    views = _views(section)
    assert set(views) == {"compare-a", "compare-b"}
    for name, cache in (("compare-a", a), ("compare-b", b)):
        v = views[name]
        got = _weights(v).reshape(2, 4, 27, 27)
        want = torch.stack([cache.pattern("decoder", layer, batch=0) for layer in (0, 1)]).numpy()
        assert abs(got - want).max() <= 0.5 / v["scale"] + 1e-9


def test_report_of_one_cache_has_no_comparison_and_uncomparable_pairs_say_why(minigpt, tmp_path):
    a = probe.capture(minigpt, TEXT_A, layers=[0])
    text = probe.report(a, tmp_path / "one", progress=False).read_text(encoding="utf-8")
    assert 'id="sec-compare"' not in text
    b = probe.capture(minigpt, TEXT_A, layers=[1])
    text = probe.report([a, b], tmp_path / "two", progress=False).read_text(encoding="utf-8")
    assert "This section could not be built: nothing to compare" in text


def test_cli_report_of_two_caches(pair_report, tmp_path):
    a, b, _ = pair_report
    r = _cli("report", str(a.path), str(b.path), "-o", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    assert 'id="sec-compare"' in (tmp_path / "r" / "index.html").read_text(encoding="utf-8")


def test_the_two_explorers_move_in_step_in_a_browser(pair_report):
    import re

    from probe.report.browser import browser, hover_cell, open_report

    a, b, path = pair_report
    with browser() as chromium:
        page, log = open_report(chromium, path)
        ia = page.evaluate("probe.views.findIndex(v => v.root.dataset.view === 'compare-a')")
        ib = page.evaluate("probe.views.findIndex(v => v.root.dataset.view === 'compare-b')")
        side = ".probe-pair-side[data-side={}] "
        # choose layer 1, head 2 in A: B shows the same head
        page.select_option(side.format("A") + ".sel-layer", "1")
        page.select_option(side.format("A") + ".sel-head", "2")
        assert page.evaluate(f"[probe.views[{ib}].li, probe.views[{ib}].hi]") == [1, 2]
        # hover a cell in A: B's readout is the same cell, with B's cached weight
        for q, k in [(25, 23), (26, 0), (10, 9)]:
            hover_cell(page, ia, q, k)
            ro_b = page.locator(side.format("B") + ".probe-readout").text_content()
            assert f"Layer 1, Head 2: query {q} " in ro_b and f"key {k} " in ro_b
            scale = page.evaluate(f"probe.views[{ib}].scale")
            wb = float(re.search(r"weight ([0-9.]+)", ro_b).group(1))
            assert abs(wb - b.pattern("decoder", 1, head=2, batch=0)[q, k].item()) <= 0.5 / scale + 1e-6
            delta = page.locator(".probe-pair-delta")
            wa_shown, wb_shown = float(delta.get_attribute("data-a")), float(delta.get_attribute("data-b"))
            assert abs(wa_shown - a.pattern("decoder", 1, head=2, batch=0)[q, k].item()) <= 0.5 / scale + 1e-6
            assert abs(wb_shown - wb) <= 1e-6
            assert f"query {q}, key {k}: A " in delta.text_content()
        # B drives A too: the keyboard in B's explorer changes the head and moves the cell
        page.locator(side.format("B") + ".probe-matrix").focus()
        page.keyboard.press("]")
        page.keyboard.press("ArrowUp")
        assert page.evaluate(f"[probe.views[{ia}].li, probe.views[{ia}].hi]") == [1, 3]
        assert page.evaluate(f"[probe.views[{ia}].q, probe.views[{ia}].k]") == [9, 9]
        page.select_option(side.format("B") + ".sel-layer", "0")
        assert page.evaluate(f"[probe.views[{ia}].li, probe.views[{ia}].hi]") == [0, 3]
        # the Attention section's own explorer is not paired
        assert page.evaluate("probe.views.find(v => v.root.dataset.view === 'attention').li") == 0
        assert log.errors == [] and [m for m in log.console if m[0] in ("error", "warning")] == []
        assert [u for u in log.requests if not u.startswith(("file:", "data:", "blob:"))] == []


def test_encoder_decoder_cross_attention_is_compared_between_real_tokens():
    import models

    model = models.load("aligner")
    twin = copy.deepcopy(model)
    n_heads = model.config.n_heads
    d = model.config.d_model // n_heads
    with torch.no_grad():  # the queries of decoder layer 1's cross-attention, head 2
        twin.decoder.layers[1].dec_enc_attn.W_Q.weight[2 * d : 3 * d] *= 3.0
    src = ["das kind ging nach hause", "er sah den hund"]  # the second source is padded
    tgt = ["S the child went home", "S he saw the dog"]
    a, b = probe.capture(model, src, target=tgt), probe.capture(twin, src, target=tgt)
    c = probe.compare(a, b)
    assert c.skipped == [] and {(r["stack"], r["kind"]) for r in c.heads} == {
        ("encoder", "self"),
        ("decoder", "self"),
        ("decoder", "cross"),
    }
    meta = a.metadata
    for r in c.heads:
        key = f"{r['stack']}.blocks.{r['layer']}.{r['kind']}_attn.pattern"
        q_mask = meta["target_attention_mask"] if r["stack"] == "decoder" else meta["attention_mask"]
        k_mask = meta["attention_mask"] if r["kind"] == "cross" or r["stack"] == "encoder" else q_mask
        P, Q = a[key].double(), b[key].double()
        tvs, maxes = [], []
        for t in range(2):
            qs = [i for i, m in enumerate(q_mask[t]) if m]
            ks = [j for j, m in enumerate(k_mask[t]) if m]
            D = (P[t, r["head"]][qs][:, ks] - Q[t, r["head"]][qs][:, ks]).abs()
            tvs.append(sum(0.5 * D[i].sum().item() for i in range(len(qs))) / len(qs))
            maxes.append(D.max().item())
        assert (r["tv"], r["max_abs"]) == pytest.approx((sum(tvs) / 2, max(maxes)), abs=1e-9), key
        changed = (r["stack"], r["layer"], r["kind"], r["head"]) == ("decoder", 1, "cross", 2)
        before_edit = r["stack"] == "encoder" or r["layer"] == 0 or (r["layer"] == 1 and not changed)
        assert (r["max_abs"] == 0.0) if before_edit else (r["max_abs"] > 0), key
    assert c.map("tv", "decoder", "cross")[1, 2] > 0
