"""The circuit graph of a model and its wiring, from the model's anatomy; and the check that the
residual stream really is the sum the graph says it is.

The anatomy (:func:`probe.intervene.anatomy.anatomy`) gives every attention's q/k/v blocks, norm
and output projection, every MLP's norm, readers and output leaf; the first layer's module (its
first argument is the stream entering it) and the last layer's (its output is the stream the
logits read, whatever the model does next) come from :func:`probe.intervene.core.prepare_sites`.
Circuits cover one-stack models (decoder-only, or an encoder alone); a part the anatomy refused
raises its one-line :class:`ProbeError` here.

:func:`check_sum`: on the clean run, the stream each group of targets reads must equal the sum of
the outputs of the nodes before it plus the attention output biases (relative error <= 1e-5),
else the model is refused (a post-norm model, a norm after a sublayer, a scaled residual).
"""

from __future__ import annotations

from torch import nn

from probe.errors import ProbeError
from probe.intervene.anatomy import Anatomy, anatomy
from probe.intervene.circuit.graph import Graph, LayerSpec
from probe.intervene.circuit.inputs import Examples
from probe.intervene.circuit.wiring import Block, Group, Proj, Run, Wiring, Writer
from probe.intervene.core import prepare_sites

SUM_TOLERANCE = 1e-5


def wire(model: nn.Module, examples: Examples, options: dict) -> Wiring:
    """The :class:`Wiring` of ``model``, found on the first of the ``examples``."""
    one = examples.take([0])
    kw = {k: v for k, v in options.items() if v is not None}
    an = anatomy(model, one, **kw)
    sites = prepare_sites(model, one, **kw).sites
    if len(an.stacks) != 1:
        raise ProbeError(
            f"circuits cover models with one stack (decoder-only or an encoder); this one has "
            f"{', '.join(an.stacks)}"
        )
    stack = an.stacks[0]
    layers = [i for s, i in an.layers if s == stack]
    if not layers:
        raise ProbeError("probe found no attention layers in the model; nothing to make a circuit of")
    entry = sites.layers.get((stack, layers[0]))
    if entry is None:
        why = sites.refused.get((stack, layers[0], "resid"), "it was not seen running")
        raise ProbeError(f"cannot find the stream entering {stack} layer {layers[0]}: {why}")
    specs = [_spec(an, stack, i) for i in layers]
    exit_ = sites.layers.get((stack, layers[-1]))
    if exit_ is None:
        raise ProbeError(f"cannot find the module of {stack} layer {layers[-1]} (the stream the logits read)")
    graph = Graph(specs, stack, type(model).__name__)
    groups, writers = [], []
    for i in layers:
        groups += _attention_groups(an, graph, stack, i)
        writers.append(_head_writer(an, graph, stack, i))
        if (stack, i) in an.mlp:
            m = an.mlp[(stack, i)]
            t = graph.target(f"L{i}.MLP")
            form = an.norm_form(m.norm) if m.norm is not None else None
            groups.append(Group("mlp", i, m.norm, [t], graph.upstream(t), readers=list(m.readers), form=form))
            writers.append(Writer("mlp", i, m.out.module, graph.node(f"L{i}.MLP")))
    groups.append(Group("logits", -1, None, [len(graph.targets) - 1], len(graph.nodes)))
    return Wiring(graph, entry.module, writers, groups, exit_.module)


def _spec(an: Anatomy, stack: str, layer: int) -> LayerSpec:
    if (stack, layer, "cross") in an.attention:
        raise ProbeError(f"{stack} layer {layer} has cross-attention; circuits cover one-stack models")
    a = an.attn(stack, layer, "self")
    for part in ("norm", "kv_norm", "weights"):
        an.need(stack, layer, "self", part)
    if a.delta and a.delta != "sublayer output":
        raise ProbeError(
            f"{stack} layer {layer}: the attention's output is normalised before it joins the stream "
            "(a post-norm model); circuits need a residual stream that is a sum of the parts' outputs"
        )
    m = an.mlp.get((stack, layer))
    return LayerSpec(layer, a.heads, a.kv_heads, tuple(a.kv_of), True, m is not None, bool(m and m.parallel))


def _attention_groups(an: Anatomy, graph: Graph, stack: str, layer: int) -> list[Group]:
    """One group per norm: the query side and, when it reads through another norm, the key/value side."""
    a = an.attention[(stack, layer, "self")]
    kv = f"L{layer}.KV" if a.kv_heads != a.heads else f"L{layer}.H"
    named = [(b, f"L{layer}.H{h}.q", a.norm) for h, b in enumerate(a.q)]
    named += [(b, f"{kv}{g}.k", a.kv_norm) for g, b in enumerate(a.k)]
    named += [(b, f"{kv}{g}.v", a.kv_norm) for g, b in enumerate(a.v)]
    by_norm: dict[int, list] = {}
    for b, name, norm in named:
        by_norm.setdefault(id(norm), []).append((b, name, norm))
    groups = []
    for items in by_norm.values():
        projs: dict[int, Proj] = {}
        for b, name, _ in items:
            W, bias = an.matrix(b.module)
            blk = Block(graph.target(name), b.cols, W[:, b.cols], bias[b.cols] if bias is not None else None)
            projs.setdefault(id(b.module), Proj(b.module, [])).blocks.append(blk)
        targets = [blk.target for p in projs.values() for blk in p.blocks]
        norm = items[0][2]
        form = an.norm_form(norm) if norm is not None else None
        groups.append(
            Group("attn", layer, norm, targets, graph.upstream(targets[0]), list(projs.values()), form=form)
        )
    return groups


def _head_writer(an: Anatomy, graph: Graph, stack: str, layer: int):
    a = an.attention[(stack, layer, "self")]
    W, b = an.matrix(a.out.module)
    W_O = W.reshape(a.heads, a.d_head, W.shape[-1])
    return Writer("heads", layer, a.out.module, graph.node(f"L{layer}.H0"), W_O, b)


def check_sum(wiring: Wiring, run: Run) -> float:
    """The largest relative error between the stream a group of targets reads on ``run`` and the
    sum of the node outputs before it plus the output biases; a ProbeError above the tolerance."""
    worst = 0.0
    for gi, g in enumerate(wiring.groups):
        x = run.streams.get(gi)
        if x is None:
            raise ProbeError(f"the {g.kind} of layer {g.layer} did not run in the forward")
        total = sum(v.sum(0) for _, v in run.value_groups(g.upstream)) + wiring.constants(g)
        err = float((x.float() - total).norm() / x.float().norm().clamp_min(1e-30))
        worst = max(worst, err)
        if err > SUM_TOLERANCE:
            where = "the logits" if g.kind == "logits" else f"layer {g.layer}'s {g.kind}"
            raise ProbeError(
                f"the stream entering {where} is not the sum of the embedding, head writes and MLP "
                f"outputs before it (relative error {err:.2g}); circuits need a residual stream that "
                "is such a sum (not a post-norm model or a norm after a sublayer)"
            )
    return worst


__all__ = ["wire", "check_sum", "SUM_TOLERANCE"]
