"""An oracle for circuits in a Llama model (SmolLM2): its forward written by hand, edge by edge.

:func:`edges_forward` computes a Hugging Face ``LlamaForCausalLM`` from its weights (RMSNorm,
rotary embeddings, grouped-query attention head by head, the SwiGLU MLP, the tied unembedding),
where every target reads a sum of node outputs assembled here: each head's query, each key/value
head's key and value, each MLP's input and the logits read the embeddings, every head's output
(its slice of ``o_proj``) and every MLP's output before them. Given another run's node outputs
and a set of kept edges, a target reads the kept edges' sources from this run and every other
source from the other run: the model with every edge outside a circuit corrupted. Nothing in it
comes from probe but the names of the edges (``"L23.H3 -> logits"``, ``"L0.MLP -> L23.KV1.v"``).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.nn import functional as F


def _rms(norm, x):
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def edges_forward(lm, ids, kept=None, other=None):
    """``(logits [B, T, vocab], outputs, patterns, final)`` of ``lm`` on ``ids`` ``[B, T]`` (no
    padding): ``outputs`` every node's output ``{name: [B, T, d]}``, ``patterns`` every head's
    weights ``{(layer, head): [B, T, T]}``, ``final`` the stream the final norm reads. With
    ``other`` (another run's ``outputs``), target ``t`` reads node ``u`` of this run only where
    ``u`` is in ``kept[t]`` (``{target: {node, ...}}``), else ``other[u]``."""
    cfg = lm.config
    H, G = cfg.num_attention_heads, cfg.num_key_value_heads
    dh = cfg.hidden_size // H
    B, T = ids.shape
    emb = lm.model.embed_tokens(ids)
    out, patterns = {}, {}
    total = [torch.zeros_like(emb)]  # the sum of the node outputs so far (this run's, or other's)
    cos, sin = lm.model.rotary_emb(emb, torch.arange(T)[None].expand(B, T))
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def add(name, o):
        out[name] = o
        total[0] = total[0] + (o if other is None else other[name])

    def stream(t):
        if other is None:
            return total[0]
        return total[0] + sum((out[u] - other[u] for u in (kept or {}).get(t, ())), torch.zeros_like(emb))

    add("input", emb)
    for li, layer in enumerate(lm.model.layers):
        at, n1 = layer.self_attn, layer.input_layernorm
        Wq, Wk = at.q_proj.weight.view(H, dh, -1), at.k_proj.weight.view(G, dh, -1)
        Wv, Wo = at.v_proj.weight.view(G, dh, -1), at.o_proj.weight.view(-1, H, dh)
        k = [_rope(_rms(n1, stream(f"L{li}.KV{g}.k")) @ Wk[g].T, cos, sin) for g in range(G)]
        v = [_rms(n1, stream(f"L{li}.KV{g}.v")) @ Wv[g].T for g in range(G)]
        heads = []
        for h in range(H):
            g = h // (H // G)
            q = _rope(_rms(n1, stream(f"L{li}.H{h}.q")) @ Wq[h].T, cos, sin)
            w = ((q @ k[g].transpose(-1, -2)) / dh**0.5).masked_fill(~causal, float("-inf")).softmax(-1)
            patterns[(li, h)] = w
            heads.append((f"L{li}.H{h}", (w @ v[g]) @ Wo[:, h].T))
        for name, o in heads:  # every head of a layer reads the stream before any of them writes
            add(name, o)
        x = _rms(layer.post_attention_layernorm, stream(f"L{li}.MLP"))
        m = layer.mlp
        add(f"L{li}.MLP", m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x)))
    final = stream("logits")
    return lm.lm_head(_rms(lm.model.norm, final)), out, patterns, final


def kept_edges(names):
    """``{target: {node, ...}}`` from edge names ``"NODE -> TARGET"``."""
    kept = defaultdict(set)
    for e in names:
        u, t = (p.strip() for p in e.split("->"))
        kept[t].add(u)
    return kept


def by_length(tokenizer, texts):
    """``{length: [index, ...]}``: the texts grouped by their number of tokens (batches without padding)."""
    groups = defaultdict(list)
    for i, text in enumerate(texts):
        groups[len(tokenizer.encode(text))].append(i)
    return dict(groups)


def _diff(logits, good, bad):
    """The summed logit difference of ``good`` over ``bad`` tokens at each row's last position."""
    r = torch.arange(logits.shape[0])
    return float((logits[r, -1, good] - logits[r, -1, bad]).sum())


def circuit_logit_diffs(lm, prompts, edge_names=None):
    """The mean logit difference (correct minus wrong answer, at the last token) of ``prompts`` (a
    :class:`~probe.intervene.circuit.PromptSet` of texts) on the clean and the corrupted prompts,
    and, for each list of edge names given, of the clean prompts run with every other edge
    corrupted: ``{"clean": x, "corrupted": y, "circuits": [z, ...]}``."""
    tok = lm.tokenizer
    edge_names = edge_names or []
    kept = [kept_edges(names) for names in edge_names]
    sums = {"clean": 0.0, "corrupted": 0.0, "circuits": [0.0] * len(kept)}
    for idx in by_length(tok, prompts.clean).values():
        a = torch.tensor([tok.encode(prompts.clean[i]) for i in idx])
        b = torch.tensor([tok.encode(prompts.corrupted[i]) for i in idx])
        good = torch.tensor([tok.encode(prompts.answers[i][0])[0] for i in idx])
        bad = torch.tensor([tok.encode(prompts.answers[i][1])[0] for i in idx])
        with torch.no_grad():
            sums["clean"] += _diff(edges_forward(lm, a)[0], good, bad)
            lb, other, _, _ = edges_forward(lm, b)
            sums["corrupted"] += _diff(lb, good, bad)
            for j, k in enumerate(kept):
                sums["circuits"][j] += _diff(edges_forward(lm, a, k, other)[0], good, bad)
    n = len(prompts.clean)
    return {
        "clean": sums["clean"] / n,
        "corrupted": sums["corrupted"] / n,
        "circuits": [s / n for s in sums["circuits"]],
    }
