"""Scores for every edge: edge attribution patching (EAP), EAP with integrated gradients, exact patching.

The score of edge ``u -> t`` estimates how much the metric drops when ``t`` reads ``u``'s
corrupted output instead of its clean one, everything else clean: ``M(clean) - M(edge corrupted)``
(positive: the edge carries the clean behaviour).

* ``"eap"`` (Syed et al. 2023): the first-order estimate
  ``Σ_batch,pos,d (clean_u - corrupt_u) · ∂M/∂(input of t)`` at the clean run, ``∂M/∂(input of t)``
  taken through ``t``'s own path only (its projection block and its norm; see
  :mod:`~probe.intervene.circuit.wiring`). One corrupted forward, one clean forward and backward.
* ``"eap-ig"`` (Hanna et al. 2024): the same with the gradient averaged over ``steps`` runs whose
  input embeddings are ``corrupt + (k / steps) (clean - corrupt)``, ``k = 1 .. steps`` (``steps=1``
  is EAP). One corrupted forward and ``steps`` forwards and backwards; the targets' gradients are
  summed over the steps and contracted with the output differences once (the score is linear in
  the gradient).
* ``"patching"``: the exact effect, one edge at a time (the clean run with only ``t``'s input
  changed by ``corrupt_u - clean_u``); one forward per edge and example, the edges into one target
  batched as rows. The oracle for the others; too slow for big graphs (SmolLM2-135M has 72,000
  edges).

The batch runs in chunks of ``batch_size`` examples. Memory, per chunk of ``B`` examples of ``T``
positions: every node's output in the clean and the corrupted run and their difference
(``3 · nodes · B · T · d`` floats) and every target's gradient (``targets · B · T · d``), so it
grows linearly with the batch chunk, the length and the number of nodes (heads and MLPs), not
with the number of edges; the scores are one ``nodes × targets`` matrix, and their contraction is
one matrix product per chunk (``nodes · targets · B · T · d`` multiply-adds), whatever the steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from probe.errors import ProbeError
from probe.intervene.circuit.grads import target_grads
from probe.intervene.circuit.task import Task, diffs, real_positions
from probe.intervene.circuit.wiring import Run

METHODS = ("eap", "eap-ig", "patching")


def contract(D: Tensor, G: Tensor) -> Tensor:
    """``[nodes, targets]``: ``Σ_b,t,d D[u,b,t,d] · G[m,b,t,d]`` for every node's output difference
    ``D`` and every target's gradient ``G``, as one matrix product (nodes and targets lead, so
    nothing is copied; the pairs that are no edges are computed too and masked afterwards, which
    costs less than many thin products)."""
    return D.reshape(D.shape[0], -1) @ G.reshape(G.shape[0], -1).T


def eap_scores(task: Task, steps: int = 1) -> Tensor:
    """``[nodes, targets]`` EAP (``steps=1``) or EAP-IG scores (see the module docstring)."""
    if steps < 1:
        raise ProbeError(f"steps must be at least 1, got {steps}")
    graph, w = task.wiring.graph, task.wiring
    scores = torch.zeros(len(graph.nodes), len(graph.targets))
    for ci, (clean, _) in enumerate(task.pairs()):
        ref = task.corrupted(ci)
        entry = ref.values[0][1][0]
        D = G = None
        for k in range(steps, 0, -1):  # k = steps first: the clean run itself
            ip = None if k == steps else (entry, k / steps)
            run = Run(w, interpolate=ip, grads=True, record=k == steps)  # the clean run's outputs only
            logits = task.forward(run, clean)
            if k == steps:
                task.keep_clean(ci, logits, clean)
                D = real_positions(diffs(run, ref), clean)
                G = D.new_zeros(len(graph.targets), *D.shape[1:])
            m = task.rows(logits, clean, ci).sum() / task.n
            if not m.requires_grad:
                raise ProbeError("the metric does not depend on the model's outputs differentiably")
            got = torch.autograd.grad(m, run.slots, allow_unused=True)
            target_grads(w, run, dict(enumerate(got)), G)  # adds this step's gradients to G
            del run, logits, m, got
        # the contraction is linear in G: the mean of the steps' scores is the score of their
        # mean gradient, one product per chunk instead of one per step
        scores += (contract(D, G) / steps).cpu()
        del D, G
    return torch.where(graph.mask(), scores, torch.tensor(float("nan")))


def patching_scores(task: Task, max_rows: int = 64) -> Tensor:
    """``[nodes, targets]``: the exact ``M(clean) - M(edge u -> t corrupted)`` of every edge."""
    graph, w = task.wiring.graph, task.wiring
    scores = torch.zeros(len(graph.nodes), len(graph.targets))
    refs = task.references()
    for ci, (clean, _) in enumerate(task.pairs()):
        base, _ = task.record(clean, ci=ci)
        ref = task.corrupted(ci)
        D = ref.stacked() - base.stacked()  # [nodes, B, T, d]
        B = D.shape[1]
        per = max(1, max_rows // B)
        for gi, g in enumerate(w.groups):
            for t in g.targets:
                for lo in range(0, g.upstream, per):
                    srcs = list(range(lo, min(g.upstream, lo + per)))
                    total = _patched(task, ci, clean, gi, t, D[srcs], B)
                    scores[srcs, t] += total.cpu()
        del base, ref, D
    scores = refs["clean"] - scores  # the batch mean of M(patched) was summed per edge
    return torch.where(graph.mask(), scores, torch.tensor(float("nan")))


def _patched(task: Task, ci: int, clean, gi: int, t: int, devs: Tensor, B: int) -> Tensor:
    """``[sources]``: the batch-mean metric (this chunk's share) with edge ``source -> t`` corrupted,
    one source per block of ``B`` rows of one forward."""
    K = devs.shape[0]
    chunk = task.chunk_of(clean.examples.tolist() * K)
    dev = devs.reshape(K * B, *devs.shape[2:])

    def deviate(run: Run, g: int):
        return {t: dev} if g == gi else None

    logits = task.forward(Run(task.wiring, deviate=deviate), chunk)
    rows = task.rows(logits, chunk, ci, repeat=K)
    return rows.reshape(K, B).sum(1) / task.n


__all__ = ["METHODS", "eap_scores", "patching_scores", "contract"]
