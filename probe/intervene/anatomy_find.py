"""Putting the anatomy together from one scan: q/k/v blocks per head, norms, MLPs, the read-out.

See :mod:`probe.intervene.anatomy` for what is found and how; this module holds the steps.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from probe.analysis.residual.head import find_readout, freeze
from probe.errors import ProbeError
from probe.intervene.anatomy_check import Cand, layout_of
from probe.intervene.anatomy_flow import LayerFlow, LeafCall
from probe.intervene.anatomy_parts import AttentionAnatomy, Block, MLPAnatomy
from probe.intervene.locate import Site

MIN_POSITIONS = 3


def roles_of(entry: dict) -> list[str]:
    """The attention roles a capture's layer entry holds, in run order."""
    return [r for r in ("self", "cross") if f"{r}_attn" in entry]


def layer_flows(entries: list[dict], flows: list[LayerFlow]) -> dict[tuple[str, int], LayerFlow]:
    """Each captured layer's call in the scan: the k-th entry of a module path is its k-th call."""
    out, by_path = {}, {}
    for e in entries:
        by_path.setdefault(e["module"], []).append(e)
    for path, group in by_path.items():
        calls = [f for f in flows if f.path == path]
        for e, f in zip(group, calls, strict=False):
            out[(e["stack"], e["layer"])] = f
    return out


def _leaf(lf: LayerFlow, name: str, before: int) -> LeafCall | None:
    got = [c for c in lf.leaves if c.name == name and c.index < before]
    return got[-1] if got else None


def out_index(lf: LayerFlow, site: Site) -> int:
    """The place of ``site``'s call among the layer call's events."""
    for c in lf.leaves:
        if c.name == site.name and c.call == site.call:
            return c.index
    raise ProbeError(f"{site.stack} layer {site.layer}: {site.name} was not seen in the scan")


def candidates(key: tuple, site: Site, lf: LayerFlow, after: int) -> tuple[list[Cand], dict]:
    """The head blocks of every module that feeds the attention's q/k/v (the ops between
    ``after`` and the output projection), and ``{"q"|"k"|"v": leaf names}``; a ProbeError with
    the reason when they cannot be cut into blocks."""
    end = out_index(lf, site)
    ops = [op for op in lf.ops if after < op.index < end]
    if not ops:
        raise ProbeError("no attention op (softmax over q @ k, SDPA) was seen before its output projection")
    names = {r: set().union(*(getattr(op, r) for op in ops)) for r in ("q", "k", "v")}
    for r, what in (("q", "query"), ("k", "key"), ("v", "value")):
        if not names[r]:
            raise ProbeError(f"its {what} is not computed by a weighted module (nn.Linear, Conv1D)")
    d_qk, d_v = ops[0].d_qk, site.d_head
    cands = []
    for name in sorted(names["q"] | names["k"] | names["v"]):
        leaf = _leaf(lf, name, end)
        lay = layout_of(leaf.out) if leaf is not None else None
        if lay is None:
            raise ProbeError(f"the output of {name} is not [batch, positions, features]")
        qk, v = name in names["q"] or name in names["k"], name in names["v"]
        if qk and v and d_qk != d_v:
            raise ProbeError(f"{name} computes q/k ({d_qk} per head) and v ({d_v}) of different widths")
        width = d_v if v else d_qk
        F = leaf.out.shape[-1]
        if F % width:
            raise ProbeError(f"the {F} outputs of {name} are not blocks of {width} (one head's channels)")
        if lay[1] < MIN_POSITIONS:
            raise ProbeError(
                f"{name} sees {lay[1]} positions; the anatomy needs at least {MIN_POSITIONS}: "
                "give a longer input"
            )
        for j in range(F // width):
            cands.append(Cand(key, leaf, slice(j * width, (j + 1) * width), lay[0], lay[1]))
    return cands, names


def _mixed(a: Cand, b: Cand, what: str) -> str:
    return (
        f"{a.leaf.name}[{a.cols.start}:{a.cols.stop}] and {b.leaf.name}[{b.cols.start}:{b.cols.stop}] "
        f"both act as the {what}: the heads' channels are mixed before the attention (a norm over "
        "the whole projection?), so it cannot be split per head"
    )


def assemble(key: tuple, site: Site, cands: list[Cand], heads: int, delta: str) -> AttentionAnatomy:
    """The :class:`AttentionAnatomy` from the checked blocks, else a ProbeError saying what is missing."""
    q: dict[int, Cand] = {}
    k: dict[frozenset, Cand] = {}
    v: dict[frozenset, Cand] = {}
    exact = True
    for c in cands:
        kind = c.found[0] if c.found else "none"
        if kind == "q":
            if c.found[1] in q:
                raise ProbeError(_mixed(q[c.found[1]], c, f"query of head {c.found[1]}"))
            q[c.found[1]] = c
        elif kind in ("k", "v"):
            d = k if kind == "k" else v
            if c.found[1] in d:
                raise ProbeError(
                    _mixed(
                        d[c.found[1]], c, f"{'key' if kind == 'k' else 'value'} of heads {sorted(c.found[1])}"
                    )
                )
            d[c.found[1]] = c
            exact &= kind == "k" or c.found[2]
        elif kind == "failed":
            raise ProbeError(c.found[1])
        elif kind == "unclear":
            raise ProbeError(
                f"perturbing {c.leaf.name}[{c.cols.start}:{c.cols.stop}] changed its pattern unlike a q or k"
            )
    missing = [h for h in range(heads) if h not in q]
    if missing:
        raise ProbeError(f"no block acts as the query of heads {missing} (the perturbation check)")
    groups = sorted(k, key=min)
    if sorted(h for g in groups for h in g) != list(range(heads)):
        raise ProbeError("the key blocks do not split the heads into groups (the perturbation check)")
    if set(v) != set(k):
        raise ProbeError("the value blocks are not read by the same head groups as the key blocks")
    kv_of = [next(i for i, g in enumerate(groups) if h in g) for h in range(heads)]

    def block(c: Cand) -> Block:
        return Block(c.leaf.module, c.leaf.name, c.cols)

    a = AttentionAnatomy(
        key[0], key[1], key[2], heads, len(groups), site.d_head, kv_of, None,
        [block(q[h]) for h in range(heads)], [block(k[g]) for g in groups], [block(v[g]) for g in groups],
        site, q[0].cols.stop - q[0].cols.start, None, delta, exact,
    )  # fmt: skip
    return a


def close(a: Any, b: Any) -> bool:
    """``a`` is ``b``, or equal to it up to float rounding (1e-6 relative); a ``[b·t, d]`` view
    of a ``[b, t, d]`` tensor (OPT's MLP) counts as the same."""
    if a is b:
        return True
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        return False
    if a.shape != b.shape:
        if a.numel() != b.numel() or a.shape[-1:] != b.shape[-1:]:
            return False
        a = a.reshape(b.shape)
    a, b = a.float(), b.float()
    return (a - b).abs().max().item() <= 1e-6 * (1 + b.abs().max().item())


def find_norm(mods: list, x: Any, stream: Tensor) -> tuple[bool, nn.Module | None, Any]:
    """``(found, module, call)``: the first module call whose output is ``x`` and whose input is
    ``stream``; ``(True, None, None)`` when ``x`` is the stream itself."""
    if close(x, stream):
        return True, None, None
    for same in (True, False):  # the very tensor first: two norms of one stream may agree in value
        for m in mods:
            if isinstance(m.out, Tensor) and (m.out is x if same else close(m.out, x)) and close(m.x, stream):
                return True, m.module, m
    return False, None, None


def norm_forms(anat: Any, calls: list) -> None:
    """The affine form of each norm found (:func:`probe.analysis.residual.head.freeze`)."""
    for c in calls:
        if c is not None and id(c.module) not in anat.forms:
            anat.forms[id(c.module)] = freeze(c.module, c.x, c.out)


def mlp_of(stack: str, layer: int, lf: LayerFlow, site: Site, taken: set[str], streams: tuple, d: int):
    """The :class:`MLPAnatomy` of one layer and its norm's call; a ProbeError with the reason.

    ``taken``: the attention modules of the layer; ``streams``: (sequential, parallel) streams
    the MLP may read (resid_pre + the attention deltas, resid_pre)."""
    start = max((c.index for c in lf.leaves if c.name in taken), default=-1)
    cands = [
        c
        for c in lf.leaves
        if c.index > start
        and c.name not in taken
        and isinstance(c.x, Tensor)
        and c.x.is_floating_point()
        and c.x.shape[-1] == d
    ]
    if not cands:
        raise ProbeError("no weighted module reads the stream after the attention")
    x = cands[0].x
    readers = [c for c in cands if close(c.x, x)]
    for parallel, stream in ((False, streams[0]), (True, streams[1])):
        found, norm, call = find_norm(lf.mods, x, stream)
        if found:
            names = [c.name for c in readers]
            return MLPAnatomy(stack, layer, norm, [c.module for c in readers], site, parallel, names), call
    raise ProbeError("the MLP reads its stream through a computation that is not a module")


def readout(flow: Any, cache: Any) -> tuple[nn.Module | None, nn.Module | None, Any]:
    """``(final norm, unembedding, norm call)`` as the logit lens finds them (a ProbeError if not)."""
    stacks = cache.stacks
    stack = "decoder" if "decoder" in stacks else stacks[-1]
    layers = cache.layer_indices(stack, "resid_post")
    last = layers[-1] if layers else None
    k = f"{stack}.blocks.{last}.resid_post"
    if last is None or k not in cache:
        raise ProbeError("the capture holds no last stream to read out")
    ro = find_readout(flow.outside, flow.outputs, cache[k])
    call = next((c for c in flow.outside if c.module is ro.norm), None) if ro.norm is not None else None
    return ro.norm, ro.unembed, call


def sample(x: Any, y: Any, rows: int = 4) -> tuple[Tensor, Tensor] | None:
    """A few rows of a call's input and output, kept to check a module's matrix later."""
    if not isinstance(x, Tensor) or not isinstance(y, Tensor):
        return None
    x2, y2 = x.detach().reshape(-1, x.shape[-1]), y.detach().reshape(-1, y.shape[-1])
    if x2.shape[0] != y2.shape[0]:
        return None
    return x2[:rows].clone(), y2[:rows].clone()


__all__ = [
    "roles_of",
    "layer_flows",
    "candidates",
    "assemble",
    "find_norm",
    "mlp_of",
    "readout",
    "sample",
    "close",
    "norm_forms",
    "out_index",
]
