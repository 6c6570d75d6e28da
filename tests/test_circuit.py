"""Circuits against independent oracles, on tiny models.

Oracles: the model's own forward on the clean and the corrupted inputs (a circuit of every edge,
and of none); :meth:`tests.circuit_fixtures.Tiny.edges_forward`, a forward written in the test
that assembles every target's input edge by edge from explicit weight slices (exact patching,
partial circuits, path patching); and a model whose metric is linear in its embedding, where
EAP-IG must equal the exact effect for any number of steps.
"""

from __future__ import annotations

import pytest
import torch
from circuit_fixtures import Tiny, ids_pair, logit_diff
from torch import nn

from probe import circuit
from probe.errors import ProbeError
from probe.intervene.circuit.evaluate import circuit_logits

CONFIGS = {
    "attention-only": {},
    "pre-norm with MLPs": {"norm": True, "mlp": True},
    "grouped-query": {"heads": 4, "kv_heads": 2, "norm": True, "mlp": True},
}
ANSWERS = torch.tensor([[1, 2]] * 4)


def _close(a, b, rel=1e-5):
    return float((a - b).abs().max()) <= rel * (1 + float(b.abs().max()))


@pytest.mark.parametrize("cfg", CONFIGS, ids=list(CONFIGS))
def test_full_and_empty_circuits_are_the_clean_and_corrupted_runs(cfg):
    m = Tiny(**CONFIGS[cfg]).eval()
    clean, corrupt = ids_pair()
    c = circuit(m, clean, corrupt, answers=(1, 2), method="eap", batch_size=3)
    task, g = c.attached(), c.graph
    with torch.no_grad():
        assert _close(circuit_logits(task, g.mask(), 1), m(clean[3:]))
        assert _close(circuit_logits(task, torch.zeros_like(g.mask()), 0), m(corrupt[:3]))
    full, empty = c.top(g.n_edges).evaluate(), c.top(0).evaluate()
    assert abs(full["faithfulness"] - 1) < 1e-4 and abs(empty["faithfulness"]) < 1e-4


def test_hf_models_full_and_empty():
    from hf_fixtures import gpt2, llama

    clean, corrupt = ids_pair(B=2, T=6, vocab=50)
    for model in (gpt2(50), llama(50)):  # fused Conv1D q/k/v with biases; GQA with RMSNorm and rotary
        c = circuit(model, clean, corrupt, answers=(3, 4), method="eap")
        task, g = c.attached(), c.graph
        with torch.no_grad():
            assert _close(circuit_logits(task, g.mask()), model(clean).logits)
            assert _close(circuit_logits(task, torch.zeros_like(g.mask())), model(corrupt).logits)


def test_pictures_full_and_empty():
    import models
    from models import shapes

    vit = models.load("vit_zoo")
    a, b = ([shapes.to_pil(x) for x in shapes.generate(3, seed=s).images] for s in (2, 3))
    c = circuit(vit, a, b, metric="kl", method="eap-ig", steps=2, processor=vit.processor)
    task, g = c.attached(), c.graph
    with torch.no_grad():
        for pics, edges in ((a, g.mask()), (b, torch.zeros_like(g.mask()))):
            want = vit(**vit.processor(images=pics, return_tensors="pt"))
            want = getattr(want, "logits", want)
            assert _close(circuit_logits(task, edges), want)


def _oracle_effects(m, clean, corrupt, g):
    """``{(node, target): M(clean) - M(that edge corrupted)}`` from the hand-assembled forward."""
    rec = {}
    with torch.no_grad():
        m.edges_forward(corrupt, record=rec)
        base = logit_diff(m.edges_forward(clean), ANSWERS)
        out = {}
        for i, n in enumerate(g.nodes):
            for j, t in enumerate(g.targets):
                if n.order < t.order:
                    v = logit_diff(m.edges_forward(clean, {(n.name, t.name): rec[n.name]}), ANSWERS)
                    out[(i, j)] = float(base - v)
    return out, rec


@pytest.mark.parametrize("cfg", CONFIGS, ids=list(CONFIGS))
def test_exact_patching_equals_the_hand_assembled_oracle(cfg):
    m = Tiny(**CONFIGS[cfg]).eval()
    clean, corrupt = ids_pair()
    c = circuit(m, clean, corrupt, answers=(1, 2), method="patching", batch_size=3)
    want, _ = _oracle_effects(m, clean, corrupt, c.graph)
    assert len(want) == c.graph.n_edges == len(c.table)
    scale = max(abs(v) for v in want.values())
    for (i, j), v in want.items():
        assert abs(float(c.scores[i, j]) - v) <= 1e-5 * (1 + scale), c.graph.edge_name(i, j)


def test_partial_circuits_and_a_path_equal_the_oracle():
    m = Tiny(**CONFIGS["grouped-query"]).eval()
    clean, corrupt = ids_pair()
    c = circuit(m, clean, corrupt, answers=(1, 2), method="eap")
    g = c.graph
    rec = {}
    with torch.no_grad():
        m.edges_forward(corrupt, record=rec)
        clean_rec = {}
        m.edges_forward(clean, record=clean_rec)
        for n in (3, 10, 40):
            sel = c.greedy(n)
            given = {
                (g.nodes[i].name, g.targets[j].name): rec[g.nodes[i].name]
                for i, j in (g.mask() & ~sel.edges).nonzero().tolist()
            }
            want = float(logit_diff(m.edges_forward(clean, given), ANSWERS))
            assert abs(sel.evaluate()["metric"] - want) <= 1e-5 * (1 + abs(want))
        # path L0.H1 -> L1.KV0.v -> L1.H1 -> logits: H1's change reaches only the logits, and
        # L1.H0, which shares key/value head 0, passes nothing on
        path = ["L0.H1", "L1.KV0.v", "L1.H1", "logits"]
        given = {("L0.H1", "L1.KV0.v"): rec["L0.H1"]}
        given |= {
            ("L1.H1", t.name): clean_rec["L1.H1"] for t in g.targets if t.order > 3 and t.name != "logits"
        }
        given |= {("L1.H0", t.name): clean_rec["L1.H0"] for t in g.targets if t.order > 3}
        want = float(logit_diff(m.edges_forward(clean, given), ANSWERS))
    got = c.path(" -> ".join(path))
    assert abs(got["metric"] - want) <= 1e-5 * (1 + abs(want))
    assert abs(got["effect"] - (c.references["clean"] - want)) <= 1e-4


def _oracle_eap(m, clean, corrupt, g, steps):
    """EAP-IG by definition, on the hand-assembled forward: the input embedding interpolated in
    ``steps`` steps; at each, a zero of its own added to every edge's value and one backward (the
    gradient with respect to each zero); the gradients averaged and multiplied by the node's
    clean-minus-corrupted output."""
    rc, rk = {}, {}
    with torch.no_grad():
        m.edges_forward(clean, record=rc)
        m.edges_forward(corrupt, record=rk)
    edges = [(i, j) for i, n in enumerate(g.nodes) for j, t in enumerate(g.targets) if n.order < t.order]
    out = torch.zeros(len(g.nodes), len(g.targets))
    for k in range(1, steps + 1):
        emb = rk["input"] + k / steps * (rc["input"] - rk["input"])
        leaves = {
            (g.nodes[i].name, g.targets[j].name): torch.zeros_like(emb, requires_grad=True) for i, j in edges
        }
        metric = logit_diff(m.edges_forward(clean, embed=emb, added=leaves), ANSWERS)
        grads = torch.autograd.grad(metric, list(leaves.values()))
        for (i, j), gr in zip(edges, grads, strict=True):
            u = g.nodes[i].name
            out[i, j] += float(((rc[u] - rk[u]) * gr).sum()) / steps
    return out


@pytest.mark.parametrize("cfg", ["pre-norm with MLPs", "grouped-query"])
def test_eap_and_eap_ig_equal_their_definition_on_the_oracle(cfg):
    m = Tiny(**CONFIGS[cfg]).eval()
    clean, corrupt = ids_pair()
    for method, steps in (("eap", 1), ("eap-ig", 3)):
        got = circuit(m, clean, corrupt, answers=(1, 2), method=method, steps=steps, batch_size=3)
        want = _oracle_eap(m, clean, corrupt, got.graph, steps)
        mask = got.graph.mask()
        scale = float(want[mask].abs().max())
        assert float((got.scores[mask] - want[mask]).abs().max()) <= 1e-5 * (1 + scale), method


def test_eap_against_exact_patching():
    """EAP is a first-order estimate. On this small pre-norm model with MLPs and grouped-query
    attention (weights of std 0.2) EAP's scores correlate 0.95 with the exact effects and are off
    by 44% of their norm; EAP-IG with 10 steps: 0.995 and 10% (as measured; asserted: above 0.9
    and below 50%, above 0.98 and below 20%)."""
    m = Tiny(**CONFIGS["grouped-query"]).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(2 / 3)
    clean, corrupt = ids_pair(B=8)
    exact = circuit(m, clean, corrupt, answers=(1, 2), method="patching")
    mask = exact.graph.mask()
    p = exact.scores[mask]
    for method, steps, corr, err in (("eap", 1, 0.9, 0.5), ("eap-ig", 10, 0.98, 0.2)):
        e = circuit(m, clean, corrupt, answers=(1, 2), method=method, steps=steps).scores[mask]
        assert float(torch.corrcoef(torch.stack([p, e]))[0, 1]) > corr, method
        assert float((e - p).norm() / p.norm()) < err, method


def test_eap_ig_is_exact_when_the_metric_is_linear_in_the_embedding():
    """Tokens in dimensions 0-7, positions in 8-15; queries and keys read only 8-15 and heads write
    only 0-7: every pattern depends on positions alone, the same in every run, so (no norm, no MLP)
    the logits are linear in the embedding and EAP-IG with any number of steps is the exact effect."""
    m = Tiny(**CONFIGS["attention-only"]).eval()
    with torch.no_grad():
        m.tok.weight[:, 8:] = 0
        m.pos.weight[:, :8] = 0
        for blk in m.blocks:
            blk.attn.q.weight[:, :8] = 0
            blk.attn.k.weight[:, :8] = 0
            blk.attn.o.weight[8:] = 0
            blk.attn.o.bias[8:] = 0
    clean, corrupt = ids_pair()
    exact = circuit(m, clean, corrupt, answers=(1, 2), method="patching")
    mask = exact.graph.mask()
    scale = float(exact.scores[mask].abs().max())
    for steps in (1, 2, 5):
        ig = circuit(m, clean, corrupt, answers=(1, 2), method="eap-ig", steps=steps)
        assert float((ig.scores[mask] - exact.scores[mask]).abs().max()) <= 1e-5 * (1 + scale)


class _MHABlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        return x + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]


class _MHA(nn.Module):
    """A causal LM on nn.MultiheadAttention: its output projection runs inside a fused kernel."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 16)
        self.blocks = nn.ModuleList(_MHABlock() for _ in range(2))
        self.lm_head = nn.Linear(16, 11)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(x)


def test_refusals():
    clean, corrupt = ids_pair()
    m = Tiny().eval()
    with pytest.raises(ProbeError, match="same number of tokens|padded differently"):
        circuit(m, clean, corrupt[:, :-1], answers=(1, 2))
    with pytest.raises(ProbeError, match="one corrupted input per clean one"):
        circuit(m, clean, corrupt[:2], answers=(1, 2))
    with pytest.raises(ProbeError, match="zero gradient"):
        circuit(m, clean, corrupt, metric="kl", method="eap")
    with pytest.raises(ProbeError, match="output-projection"):
        circuit(_MHA().eval(), clean, corrupt, answers=(1, 2))
    import transformers as tf

    cfg = tf.BertConfig(
        vocab_size=11, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
    )
    torch.manual_seed(0)
    bert = tf.BertForMaskedLM(cfg).eval()
    with pytest.raises(ProbeError, match="post-norm"):
        circuit(bert, clean, corrupt, answers=(1, 2))


def test_norm_vjp_against_autograd():
    """The analytic vector-Jacobian products of LayerNorm and RMSNorm (from their affine form, as
    the anatomy finds it) against torch's autograd through the modules themselves."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from probe.analysis.residual.head import freeze
    from probe.intervene.circuit.grads import norm_vjp

    torch.manual_seed(0)
    x, gy = torch.randn(2, 5, 16), torch.randn(3, 2, 5, 16)
    for norm in (nn.LayerNorm(16), LlamaRMSNorm(16, eps=1e-6)):
        with torch.no_grad():
            norm.weight.normal_()
        form = freeze(norm, x, norm(x))
        assert form is not None and form.kind in ("layernorm", "rmsnorm")
        xs = x.clone().requires_grad_(True)
        want = torch.stack([torch.autograd.grad(norm(xs), xs, g)[0] for g in gy])
        assert torch.allclose(norm_vjp(norm, x, gy, form), want, atol=1e-5)
        assert torch.allclose(norm_vjp(norm, x, gy, None), want, atol=1e-5)


def test_each_target_s_gradient_is_autograd_through_its_own_block_and_norm():
    """Every q/k/v target's gradient (the fused path under LayerNorm and RMSNorm: GPT-2's fused
    Conv1D with biases, a grouped-query Llama) against autograd through the norm module and that
    target's columns of the projection weight, at the run's own stream and output gradient."""
    from hf_fixtures import gpt2, llama

    from probe.intervene.circuit.grads import target_grads
    from probe.intervene.circuit.wiring import Run

    clean, corrupt = ids_pair(B=2, T=6, vocab=50)
    for model in (gpt2(50), llama(50)):
        c = circuit(model, clean, corrupt, answers=(3, 4), method="eap")
        task = c.attached()
        w = task.wiring
        chunk, _ = next(iter(task.pairs()))
        run = Run(w, grads=True)
        logits = task.forward(run, chunk)
        got = torch.autograd.grad(task.rows(logits, chunk, 0).sum(), run.slots, allow_unused=True)
        x0 = run.streams[0]
        out = torch.zeros(len(w.graph.targets), *x0.shape)
        target_grads(w, run, dict(enumerate(got)), out)
        checked = 0
        for gi, g in enumerate(w.groups):
            if g.kind != "attn":
                continue
            assert g.norm is not None and g.form.kind in ("layernorm", "rmsnorm")
            x = run.streams[gi].detach().clone().requires_grad_(True)
            for pi, p in enumerate(g.projs):
                gp = got[run.slot_index[(gi, pi)]]
                for b in p.blocks:
                    y = g.norm(x) @ b.W + (b.b if b.b is not None else 0.0)
                    (want,) = torch.autograd.grad(y, x, gp[..., b.cols])
                    assert _close(out[b.target], want, rel=1e-5), (type(model).__name__, b.target)
                    checked += 1
        assert checked == len([t for g in w.groups if g.kind == "attn" for t in g.targets])


def test_padding_is_left_out():
    """Two prompts of 6 and 4 tokens in one right-padded batch score every edge as the mean of
    their scores alone (EAP and the exact effects), and the metric reads each one's last token."""
    from hf_fixtures import llama

    model = llama(50)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(3, 50, (2, 6), generator=g), torch.randint(3, 50, (2, 4), generator=g)

    def batch(x, y):
        ids = torch.zeros(2, 6, dtype=torch.long)
        ids[0], ids[1, :4] = x, y
        return {"input_ids": ids, "attention_mask": (torch.arange(6) < torch.tensor([[6], [4]])).long()}

    both = {
        m: circuit(model, batch(a[0], b[0]), batch(a[1], b[1]), answers=(5, 6), method=m)
        for m in ("eap", "patching")
    }
    for m, c in both.items():
        alone = [
            circuit(model, x[None], y[None], answers=(5, 6), method=m).scores
            for x, y in ((a[0], a[1]), (b[0], b[1]))
        ]
        mask = c.graph.mask()
        want = (alone[0] + alone[1])[mask] / 2
        assert torch.allclose(c.scores[mask], want, atol=1e-5 * (1 + float(want.abs().max()))), m


def test_a_length_mismatch_names_the_input_it_is_in():
    """Padding to different lengths must not blame input 0 (its lengths agree)."""
    import models

    m = models.load("minigpt")
    with pytest.raises(ProbeError, match="clean input 1 has 9 tokens but its corrupted input has 10"):
        circuit(m, ["the cat", "a mat sat"], ["the rat", "a mat sat."], answers=(" ", "s"))
