"""IOI on a real LLM: the circuit of SmolLM2-135M that docs/circuits.md shows, checked by running
the model by hand.

Oracle: :func:`llama_edges.edges_forward`, SmolLM2's forward written in the test from its weights
(checked here against the model's own logits), in which every target reads the node outputs it is
given: the circuit's edges from the clean run, every other edge from the corrupted run. What the
docs claim is measured there, not by probe's own evaluation: the logit difference each circuit
keeps, and where the circuit's top heads look and what they write at the last token.

Task: ``ioi_prompts(64, tokenizer, seed=0)``; corrupted: the two names swapped; metric: logit(IO)
minus logit(S) at the last token. Slow: probe's EAP-IG on the 70,651 edges takes minutes on a CPU.
"""

from __future__ import annotations

import pytest
import torch
from llama_edges import by_length, circuit_logit_diffs, edges_forward

import models
import probe
from probe.intervene.circuit import ioi_prompts

pytestmark = pytest.mark.slow

# what docs/circuits.md shows: the mean logit differences, and the share of the clean one that the
# greedy EAP-IG circuit of each size keeps with every other edge corrupted
CLEAN, CORRUPTED = 4.503, -3.982
KEPT = {300: 0.88, 1000: 0.93, 3532: 0.76}
# the heads of the 300-edge circuit with the largest |score| on their edge to the logits
TOP_HEADS = [(23, 3), (29, 1), (29, 0), (24, 4), (23, 0), (23, 2), (23, 1), (24, 5)]


@pytest.fixture(scope="module")
def smol():
    return models.load("smollm2")


@pytest.fixture(scope="module")
def ioi(smol):
    return ioi_prompts(64, smol.tokenizer, seed=0)


@pytest.fixture(scope="module")
def scored(smol, ioi):
    return probe.circuit(smol, ioi.clean, ioi.corrupted, answers=ioi.answers, method="eap-ig")


def test_the_oracle_is_the_model(smol, ioi):
    """The hand-written forward gives the model's own logits (every edge from its own run)."""
    idx = next(iter(by_length(smol.tokenizer, ioi.clean).values()))
    ids = torch.tensor([smol.tokenizer.encode(ioi.clean[i]) for i in idx])
    with torch.no_grad():
        want = smol(ids).logits
        got = edges_forward(smol, ids)[0]
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


def test_circuits_keep_the_share_the_docs_state(smol, ioi, scored):
    """The greedy circuits of 300, 1000 and 3,532 edges (5%) keep the shares the docs state (within
    0.05 of the clean logit difference), the model run by hand with every other edge corrupted; a
    circuit of at most 5% of the edges keeps at least 80%."""
    assert scored.graph.n_edges == 70651
    sizes = sorted(KEPT)
    got = circuit_logit_diffs(smol, ioi, [scored.greedy(n).table.column("edge") for n in sizes])
    assert got["clean"] == pytest.approx(CLEAN, abs=0.01)
    assert got["corrupted"] == pytest.approx(CORRUPTED, abs=0.01)
    kept = {n: value / got["clean"] for n, value in zip(sizes, got["circuits"], strict=True)}
    for n in sizes:
        assert kept[n] == pytest.approx(KEPT[n], abs=0.05), (n, kept)
    assert max(kept[n] for n in sizes if n <= 0.05 * scored.graph.n_edges) >= 0.8, kept


def _top_heads(scored, n_edges=300, k=8):
    rows = [r for r in scored.greedy(n_edges).table.rows if r["target"] == "logits" and ".H" in r["source"]]
    return [tuple(int(x[1:]) for x in r["source"].split(".")) for r in rows[:k]]


def test_top_heads_read_and_write_the_names_as_the_docs_say(smol, ioi, scored):
    """The circuit's top heads are the docs' list; at the last token (the model's own weights,
    computed by hand): the name movers put most of their weight on the indirect object and raise
    its logit more than the subject's, a negative name mover reads the IO and lowers its logit,
    L23.H3 reads the subject and lowers the subject's logit, L29.H1 and L29.H0 read the last token
    itself and raise and lower the IO's logit, L24.H5 rests on the first token."""
    assert _top_heads(scored) == TOP_HEADS
    tok = smol.tokenizer
    U, g, eps = smol.lm_head.weight, smol.model.norm.weight, smol.config.rms_norm_eps
    stats = {h: torch.zeros(6) for h in TOP_HEADS}  # IO, S, first, itself, d logit(IO), d logit(S)
    for idx in by_length(tok, ioi.clean).values():
        ids = torch.tensor([tok.encode(ioi.clean[i]) for i in idx])
        with torch.no_grad():
            _, out, patterns, final = edges_forward(smol, ids)
        for b, i in enumerate(idx):
            io, s = (tok.encode(" " + ioi.info[i][name])[0] for name in ("io", "s"))
            scale = g / final[b, -1].pow(2).mean().add(eps).sqrt()  # the final norm at this stream
            for layer, head in TOP_HEADS:
                w = patterns[(layer, head)][b, -1]
                write = out[f"L{layer}.H{head}"][b, -1] * scale
                stats[(layer, head)] += torch.stack(
                    [w[ids[b] == io].sum(), w[ids[b] == s].sum(), w[0], w[-1], write @ U[io], write @ U[s]]
                )
    m = {h: (v / len(ioi.clean)).tolist() for h, v in stats.items()}
    for head in [(23, 0), (23, 1), (24, 4)]:  # reading the IO
        io, s, first, _, d_io, d_s = m[head]
        assert io > 0.5 and io > s + 0.1 and io > first, (head, m[head])
        assert abs(d_io) > abs(d_s) + 0.2, (head, m[head])
    assert m[(23, 0)][4] > 0.8 and m[(23, 1)][4] > 0.5 and m[(24, 4)][4] < -0.8  # up, up, down
    io, s, _, _, d_io, d_s = m[(23, 3)]
    assert s > 0.6 and io < 0.1 and d_s < -2 and abs(d_io) < 0.2, m[(23, 3)]
    io, s, _, _, d_io, d_s = m[(23, 2)]  # reads the IO more than the subject, raises it more
    assert io > s + 0.1 and d_io > d_s + 0.2, m[(23, 2)]
    for head, sign in (((29, 1), 1), ((29, 0), -1)):  # read the last token itself, write the IO up / down
        io, s, _, itself, d_io, _ = m[head]
        assert itself > 0.4 and io + s < 0.1 and sign * d_io > 1, (head, m[head])
    assert m[(24, 5)][2] > 0.5, m[(24, 5)]  # rests on the first token
