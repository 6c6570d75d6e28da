"""Which modules of a model play which role, per layer: found from the unmodified model's data flow.

Usage (the contract the per-head writes, composition and circuits build on)::

    from probe.intervene.anatomy import anatomy
    an = anatomy(model, "a short text")           # any inputs probe.capture takes (>= 3 positions)
    att = an.attention[("decoder", 0, "self")]    # AttentionAnatomy: q/k/v Blocks, out Site, norm
    att.q[h].module, att.q[h].cols                # head h's query channels in that module's output
    att.k[att.kv_of[h]]                           # its key block (GQA: shared by a group of heads)
    hw = an.head_weights("decoder", 0)            # W_Q [H,d,dh] W_K/W_V [Hkv,d,dh] W_O [H,dh,d], b_*
    W, b = an.matrix(att.out.module)              # any weighted leaf as x @ W + b (W [in, out])
    an.mlp[("decoder", 0)]                        # MLPAnatomy: norm, readers, out, parallel
    an.final_norm, an.unembed                     # the read-out, as the logit lens finds it
    an.norm_form(att.norm)                        # its affine form (LayerNorm/RMSNorm, weight, eps)
    an.refused                                    # {key: one line} for what could not be found
    an.attn("decoder", 0), an.need(*key)          # the part, or the refusal's one-line ProbeError

How it is found (no per-architecture code):

1. :func:`probe.intervene.core.prepare_sites` (a capture and :mod:`probe.intervene.locate`) names
   the stacks, layers and roles and finds each attention's output projection and MLP output;
2. :mod:`probe.intervene.anatomy_flow` follows tags through every op in each layer call: which
   weighted modules feed each attention's query, key and value;
3. :mod:`probe.intervene.anatomy_check` cuts those modules' outputs into head blocks and checks
   which block is which head's q, k or v by perturbing each in its own copy of the layer's input
   (one batched run of the layer alone; of the whole model where the layer cannot run alone);
4. norms: the module whose input is the stream entering the sublayer (``resid_pre``; plus the
   self-attention's delta for cross-attention and, in sequential blocks, for the MLP) and whose
   output is what the projections read; none when they read the stream itself (post-norm blocks);
5. the read-out: :func:`probe.analysis.residual.head.find_readout`, as the logit lens.

Only the first input is used (one text, one picture); every refusal is one line in ``refused``,
keyed ``(stack, layer, role)`` for an attention, ``(stack, layer, "mlp")``, ``(stack, layer,
role, part)`` for a part (``"norm"``, ``"kv_norm"``) and ``("readout",)``;
anything that needs a refused part raises :class:`ProbeError` with that line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from probe.errors import ProbeError
from probe.intervene.anatomy_check import Job, run_checks
from probe.intervene.anatomy_find import (
    assemble,
    candidates,
    find_norm,
    layer_flows,
    mlp_of,
    norm_forms,
    out_index,
    readout,
    roles_of,
    sample,
)
from probe.intervene.anatomy_flow import scan_flow
from probe.intervene.anatomy_parts import (
    Anatomy,
    AttentionAnatomy,
    Block,
    HeadWeights,
    MLPAnatomy,
    as_matrix,
)
from probe.intervene.core import prepare_call, prepare_sites


def _first_n(x: Any, n: int) -> Any:
    """``n`` copies of the first example of ``x`` (a text, ids, a dict of tensors, pictures, sound)."""
    if x is None:
        return None
    if isinstance(x, str):
        return [x] * n
    if isinstance(x, Tensor):
        if x.dim() == 1:  # one sequence of ids (or one clip): itself, or n rows of it
            return x if n == 1 else x.unsqueeze(0).repeat(n, 1)
        return x[:1].repeat(n, *([1] * (x.dim() - 1)))
    if isinstance(x, Mapping):
        b = next((v.shape[0] for v in x.values() if isinstance(v, Tensor) and v.dim()), None)
        data = {
            k: v[:1].repeat(n, *([1] * (v.dim() - 1)))
            if isinstance(v, Tensor) and v.dim() and v.shape[0] == b
            else v
            for k, v in x.items()
        }
        try:
            return type(x)(data)
        except Exception:  # a mapping type that cannot be rebuilt from a dict
            return data
    if isinstance(x, (list, tuple)):
        if not x:
            raise ProbeError("no inputs given; pass a text, ids or pictures")
        return [x[0]] * n
    return [x] * n  # one picture or one clip


def _copies(inputs: Any, target: Any, text: Any, n: int) -> tuple[Any, Any, Any]:
    return _first_n(inputs, n), _first_n(target, n), _first_n(text, n) if text is not None else None


def anatomy(
    model: nn.Module,
    inputs: Any,
    *,
    tokenizer: Any = None,
    target: Any = None,
    processor: Any = None,
    text: Any = None,
    sampling_rate: Any = None,
) -> Anatomy:
    """The :class:`Anatomy` of ``model``, found on the first of ``inputs`` (see the module docstring).

    ``inputs``: anything :func:`probe.capture` takes (texts, ids, a dict of model arguments,
    pictures with ``processor=``, sound); only the first example is run, and it needs at least
    3 positions. Costs a few forwards: a capture, a scan, and one batched forward (one copy of
    the input per head block) per group of layers.
    """
    media = {"processor": processor, "sampling_rate": sampling_rate}
    one, tgt1, text1 = _copies(inputs, target, text, 1)
    prep = prepare_sites(model, one, tokenizer=tokenizer, target=tgt1, text=text1, keep_cache=True, **media)
    cache, sites = prep.cache, prep.sites
    entries = [e for e in cache.metadata.get("layers", []) if roles_of(e)]
    flow = scan_flow(model, prep.run, {e["module"] for e in entries})
    flows = layer_flows(entries, flow.layers)
    an = Anatomy(model, list(sites.stacks), [], {}, {}, None, None, {}, sites.d_model)
    mlps = {(e["stack"], e["layer"]) for e in entries if "mlp" in (e.get("deltas") or {})}
    for key, why in sites.refused.items():
        if key[2] != "resid" and (key[2] != "mlp" or key[:2] in mlps):
            an.refused[key] = why
    found = _attention_blocks(an, entries, flows, sites, cache)

    def make(n: int):
        x, t, tx = _copies(inputs, target, text, n)
        return prepare_call(model, x, tokenizer, t, text=tx, **media).run

    run_checks(_jobs(found, flows, sites), make)
    for key, (cands, e) in found.items():
        try:
            an.attention[key] = assemble(
                key, sites.attention[key], cands, sites.heads[key], _delta(e, key[2])
            )
        except ProbeError as err:
            an.refused[key] = str(err)
    _norms_and_mlps(an, entries, flows, sites, cache, flow.outside)
    _readout(an, flow, cache)
    _samples(an, flow, flows)
    return an


def _local(lf: Any, module: nn.Module, name: str, call: int) -> int:
    """Which call of ``module`` within the layer call the scan's call ``call`` was."""
    mine = [c for c in lf.leaves if c.module is module]
    return next(i for i, c in enumerate(mine) if c.name == name and c.call == call)


def _jobs(found: dict, flows: dict, sites: Any) -> list[Job]:
    """One :class:`Job` per layer call with candidate blocks, in run order."""
    jobs: dict[tuple[str, int], Job] = {}
    for key, (cands, _e) in found.items():
        lf = flows[key[:2]]
        site = sites.attention[key]
        job = jobs.setdefault(key[:2], Job(lf, [], {}, {}, {}))
        for c in cands:
            c.local = _local(lf, c.leaf.module, c.leaf.name, c.leaf.call)
        job.cands += cands
        job.outs[key] = (site.module, site.call, _local(lf, site.module, site.name, site.call))
        out = next(c for c in lf.leaves if c.name == site.name and c.call == site.call)
        job.clean[key] = out.x
        job.heads[key] = site.heads
    return list(jobs.values())


def _delta(e: dict, role: str) -> str:
    return (e.get("deltas") or {}).get(f"{role}_attn", "")


def _attention_blocks(an: Anatomy, entries: list, flows: dict, sites: Any, cache: Any) -> dict:
    """``{key: (candidate blocks, layer entry)}`` of every placed attention; refusals into ``an``."""
    found = {}
    for e in entries:
        stack, layer = e["stack"], e["layer"]
        if (stack, layer) not in an.layers:
            an.layers.append((stack, layer))
        lf = flows.get((stack, layer))
        after = -1
        for role in roles_of(e):
            key = (stack, layer, role)
            site = sites.attention.get(key)
            if site is None or lf is None:
                an.refused.setdefault(key, "its layer was not seen running")
                continue
            try:
                cands, _names = candidates(key, site, lf, after)
                found[key] = (cands, e)
            except ProbeError as err:
                an.refused[key] = str(err)
            after = out_index(lf, site)
    return found


def _leaf_x(lf: Any, name: str) -> Any:
    got = [c for c in lf.leaves if c.name == name]
    return got[-1].x if got else None


def _attention_norms(an: Anatomy, key: tuple, lf: Any, stream: Tensor, kv_stream: Any, outside: list) -> list:
    """Set ``norm``/``kv_norm`` of one attention (refusals into ``an``); the norms' calls."""
    a = an.attention[key]
    xq, xk = _leaf_x(lf, a.q[0].name), _leaf_x(lf, a.k[0].name)
    calls = []
    ok, a.norm, call = find_norm(lf.mods, xq, stream)
    calls.append(call)
    if not ok:
        an.refused[(*key, "norm")] = "its query reads the stream through a computation that is not a module"
    if key[2] == "self" and (xk is xq or (ok and find_norm(lf.mods, xk, stream)[1] is a.norm)):
        a.kv_norm = a.norm
        if not ok:
            an.refused[(*key, "kv_norm")] = an.refused[(*key, "norm")]
        return calls
    ok, a.kv_norm, call = find_norm(lf.mods + outside, xk, kv_stream if key[2] == "cross" else stream)
    calls.append(call)
    if not ok:
        an.refused[(*key, "kv_norm")] = (
            "its keys read their stream through a computation that is not a module"
        )
    return calls


def _norms_and_mlps(an: Anatomy, entries: list, flows: dict, sites: Any, cache: Any, outside: list) -> None:
    calls = []
    for e in entries:
        stack, layer = e["stack"], e["layer"]
        lf, k = flows.get((stack, layer)), f"{stack}.blocks.{layer}."
        if lf is None or k + "resid_pre" not in cache:
            continue
        pre = cache[k + "resid_pre"]
        stream = pre
        for role in roles_of(e):
            if (stack, layer, role) in an.attention:
                calls += _attention_norms(
                    an, (stack, layer, role), lf, stream, _source(an, cache, stack), outside
                )
            if k + f"{role}_attn.delta" in cache:
                stream = stream + cache[k + f"{role}_attn.delta"]
        site = sites.mlp.get((stack, layer))
        if site is None:
            continue
        outs = [s.name for (st, i, _), s in sites.attention.items() if (st, i) == (stack, layer)]
        taken = set(outs) | {
            b.name
            for (st, i, _), a in an.attention.items()
            if (st, i) == (stack, layer)
            for b in a.q + a.k + a.v
        }
        try:
            m, call = mlp_of(stack, layer, lf, site, taken, (stream, pre), pre.shape[-1])
            an.mlp[(stack, layer)] = m
            calls.append(call)
        except ProbeError as err:
            an.refused[(stack, layer, "mlp")] = str(err)
    norm_forms(an, calls)


def _source(an: Anatomy, cache: Any, stack: str) -> Any:
    """The last stream of the stack before ``stack`` (what a cross-attention's keys read)."""
    if stack not in an.stacks or an.stacks.index(stack) == 0:
        return None
    src = an.stacks[an.stacks.index(stack) - 1]
    layers = cache.layer_indices(src, "resid_post")
    return cache[f"{src}.blocks.{layers[-1]}.resid_post"] if layers else None


def _readout(an: Anatomy, flow: Any, cache: Any) -> None:
    try:
        an.final_norm, an.unembed, call = readout(flow, cache)
        norm_forms(an, [call])
    except ProbeError as err:
        an.refused[("readout",)] = str(err).split("; pass ")[0]  # the lens's norm=/unembed= hint is not ours


def _samples(an: Anatomy, flow: Any, flows: dict) -> None:
    """A few rows of every weighted leaf's call, to check its matrix on demand."""
    for lf in flows.values():
        for c in lf.leaves:
            if id(c.module) not in an.samples and (s := sample(c.x, c.out)) is not None:
                an.samples[id(c.module)] = s
    for c in flow.outside:
        if id(c.module) not in an.samples and (s := sample(c.input, c.output)) is not None:
            an.samples[id(c.module)] = s


__all__ = ["anatomy", "Anatomy", "AttentionAnatomy", "MLPAnatomy", "Block", "HeadWeights", "as_matrix"]
