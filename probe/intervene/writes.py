"""What each head writes to the residual stream: its slice of the output projection applied to its output.

An attention's output projection reads the heads side by side, ``z = [z_0 | z_1 | ... ]``
(:mod:`probe.intervene.locate` finds it and checks the order), so its output splits exactly::

    out_proj(z) = sum_h z_h @ W_O[h] + b_O        W_O[h] = the rows h*d_head:(h+1)*d_head of W_O

``head_writes(model, inputs)`` records ``z`` at every output projection in one forward and
returns ``writes [batch, heads, pos, d_model]`` per attention, the bias, and the check that
probe guarantees: the sum over heads plus the bias equals the attention delta the capture records
(<= 1e-5 relative). Where it does not (a norm between the projection and the stream: post-norm
blocks such as BERT's, sandwich norms such as Gemma 2's) the heads' writes are not what the stream
receives, and that attention is refused in one line, as is one whose projection is not a module
(``nn.MultiheadAttention``'s fused kernel, ``einsum`` with ``W_O``) or not ``x @ W + b``.

Memory: ``batch * heads * pos * d_model`` floats per attention kept; ``layers=`` keeps fewer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from probe.analysis.residual.exports import TableExports
from probe.analysis.table import Table
from probe.errors import ProbeError
from probe.intervene.anatomy_parts import as_matrix
from probe.intervene.core import prepare_sites
from probe.intervene.locate import Site

TOL = 1e-5  # the relative error the check allows: max |sum + bias - delta| / max |delta|


@dataclass
class HeadWrites(TableExports):
    """Per attention ``(stack, layer, role)``: ``writes[key]`` ``[batch, heads, pos, d_model]``
    (float32), ``bias[key]`` ``[d_model]`` (zeros when the projection has none), ``errors[key]``
    the check's relative error; ``refused`` says in one line why an attention has no writes.
    ``mask`` ``[batch, pos]`` per stack marks real tokens (padding False); ``tokens`` per stack."""

    writes: dict[tuple[str, int, str], Tensor]
    bias: dict[tuple[str, int, str], Tensor]
    errors: dict[tuple[str, int, str], float]
    refused: dict[tuple[str, int, str], str]
    stacks: list[str]
    mask: dict[str, Tensor] = field(default_factory=dict)
    tokens: list = field(default_factory=list)

    def _key(self, layer: int, stack: str | None, role: str) -> tuple[str, int, str]:
        if stack is None:
            if len(self.stacks) != 1:
                raise ProbeError(f"the model has stacks {', '.join(self.stacks)}; pass stack=")
            stack = self.stacks[0]
        key = (stack, int(layer), role)
        if key in self.refused:
            raise ProbeError(f"{stack} layer {layer} {role}-attention: {self.refused[key]}")
        if key not in self.writes:
            have = ", ".join(f"{s} {i} {r}" for s, i, r in self.writes) or "none"
            raise ProbeError(f"no writes for {stack} layer {layer} {role}-attention; kept: {have}")
        return key

    def write(
        self, layer: int, head: int | None = None, *, stack: str | None = None, role: str = "self"
    ) -> Tensor:
        """``[batch, heads, pos, d_model]``, or ``[batch, pos, d_model]`` for one ``head``."""
        w = self.writes[self._key(layer, stack, role)]
        if head is None:
            return w
        if not -w.shape[1] <= head < w.shape[1]:
            raise ProbeError(f"layer {layer} has {w.shape[1]} heads (0..{w.shape[1] - 1}); no head {head}")
        return w[:, head]

    def total(self, layer: int, *, stack: str | None = None, role: str = "self") -> Tensor:
        """The sum over heads plus the bias ``[batch, pos, d_model]``: the attention's delta."""
        key = self._key(layer, stack, role)
        return self.writes[key].sum(1) + self.bias[key]

    def norms(self, layer: int, *, stack: str | None = None, role: str = "self") -> Tensor:
        """``||write||`` of every head at every position ``[batch, heads, pos]``."""
        return self.writes[self._key(layer, stack, role)].norm(dim=-1)

    def check(self) -> Table:
        """One row per attention kept: the largest relative error of sum + bias against the
        recorded delta (each <= 1e-5; larger ones were refused)."""
        rows = [
            {"stack": s, "layer": i, "role": r, "heads": self.writes[(s, i, r)].shape[1], "rel_error": e}
            for (s, i, r), e in self.errors.items()
        ]
        return Table(
            rows, ["stack", "layer", "role", "heads", "rel_error"], "head writes: sum + bias vs delta"
        )

    def table(self) -> Table:
        """One row per head: the mean norm of its write over real positions, and its share of the
        layer's (the sum of its heads' mean norms)."""
        rows = []
        for (s, i, r), w in self.writes.items():
            m = self.mask.get(s)
            n = w.norm(dim=-1)  # [batch, heads, pos]
            keep = (
                m[:, None, :].expand_as(n) if m is not None and m.shape == (n.shape[0], n.shape[2]) else None
            )
            mean = (n * keep).sum((0, 2)) / keep.sum((0, 2)) if keep is not None else n.mean((0, 2))
            total = mean.sum().item()
            for h, v in enumerate(mean.tolist()):
                rows.append(
                    {
                        "stack": s,
                        "layer": i,
                        "role": r,
                        "head": h,
                        "mean_norm": v,
                        "share": v / total if total else 0.0,
                    }
                )
        return Table(rows, ["stack", "layer", "role", "head", "mean_norm", "share"], "what heads write")

    def main_table(self) -> Table:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """The per-head table, the check and the refusals as plain Python."""
        return {
            "heads": self.table().to_dict(),
            "check": self.check().to_dict(),
            "refused": {f"{s}.{i}.{r}": why for (s, i, r), why in self.refused.items()},
        }

    def __repr__(self) -> str:
        worst = max(self.errors.values(), default=float("nan"))
        return (
            f"HeadWrites({len(self.writes)} attentions, {len(self.refused)} refused; "
            f"sum over heads + bias vs the recorded delta: max rel error {worst:.1e})"
        )


def _record(model: nn.Module, run, sites: list[Site]) -> dict[int, tuple[Tensor, Tensor]]:
    """One forward recording each site's input and output at its call (index in ``sites``)."""
    got: dict[int, tuple[Tensor, Tensor]] = {}
    counts: dict[int, int] = {}
    handles = []
    by_mod: dict[int, list[int]] = {}
    for n, s in enumerate(sites):
        by_mod.setdefault(id(s.module), []).append(n)

    def hook(mod, args, out):
        c = counts.get(id(mod), 0)
        counts[id(mod)] = c + 1
        for n in by_mod[id(mod)]:
            if sites[n].call == c and args and isinstance(args[0], Tensor) and isinstance(out, Tensor):
                got[n] = (args[0].detach(), out.detach())

    for s in {id(s.module): s.module for s in sites}.values():
        handles.append(s.register_forward_hook(hook))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return got


def split_heads(z: Tensor, W: Tensor, heads: int, shape: torch.Size) -> Tensor:
    """``z [..., heads*d_head]`` and ``W [heads*d_head, d]`` -> writes ``[batch, heads, pos, d]``
    (``shape``: the delta's ``[batch, pos, d]``, which ``z``'s leading dims are reshaped to)."""
    d_head = W.shape[0] // heads
    z = z.float().reshape(*shape[:-1], heads, d_head)
    return torch.einsum("bthe,hed->bhtd", z, W.reshape(heads, d_head, W.shape[-1]))


def _split(
    site: Site, z: Tensor, out: Tensor, delta: Tensor | None, kind: str
) -> tuple[Tensor, Tensor, float]:
    """``(writes, bias, relative error)`` of one attention, else a ProbeError with the reason."""
    if delta is None:
        raise ProbeError("the capture recorded no delta for it")
    if kind == "stream difference":
        raise ProbeError(
            "a norm follows it (post-norm): the stream receives norm(x + attention), not the heads' sum"
        )
    W, b = as_matrix(site.module, (z.reshape(-1, z.shape[-1])[:4], out.reshape(-1, out.shape[-1])[:4]))
    if z.numel() // z.shape[-1] != delta.numel() // delta.shape[-1]:
        raise ProbeError(f"the input of {site.name} does not have one row per position")
    writes = split_heads(z, W, site.heads, delta.shape)
    bias = b if b is not None else torch.zeros(W.shape[-1])
    d = delta.float()
    err = ((writes.sum(1) + bias) - d).abs().max().item() / max(d.abs().max().item(), 1e-30)
    if err > TOL:
        raise ProbeError(
            f"the sum of its heads' writes is not the recorded delta (relative error {err:.1e}): something "
            f"between {site.name} and the stream (a norm, a scale) changes what the stream receives"
        )
    return writes, bias, err


def head_writes(
    model: nn.Module,
    inputs: Any,
    *,
    tokenizer: Any = None,
    target: Any = None,
    processor: Any = None,
    text: Any = None,
    sampling_rate: Any = None,
    layers: Any = None,
) -> HeadWrites:
    """What every head of ``model`` writes to the residual stream on ``inputs`` (see the module
    docstring). ``inputs``: anything :func:`probe.capture` takes; ``layers``: layer indices to
    keep (every stack), None for all. A ProbeError when no attention can be split per head."""
    keep = None if layers is None else {int(i) for i in ([layers] if isinstance(layers, int) else layers)}
    prep = prepare_sites(
        model, inputs, tokenizer=tokenizer, target=target, processor=processor, text=text,
        sampling_rate=sampling_rate, keep_cache=True,
    )  # fmt: skip
    cache, sites = prep.cache, prep.sites
    deltas = {(e["stack"], e["layer"]): e.get("deltas") or {} for e in cache.metadata.get("layers", [])}
    wanted = [k for k in sites.heads if keep is None or k[1] in keep]
    if keep is not None and not wanted:
        raise ProbeError(f"layers={sorted(keep)} selects no attention layer of this model")
    placed = [sites.attention[k] for k in wanted if k in sites.attention]
    got = _record(model, prep.run, placed)
    hw = HeadWrites({}, {}, {}, {}, list(sites.stacks), tokens=prep.labels)
    for k in wanted:
        if k not in sites.attention:
            hw.refused[k] = sites.refused.get(k, "probe found no output projection for it")
            continue
        n = placed.index(sites.attention[k])
        s, i, r = k
        dk = f"{s}.blocks.{i}.{r}_attn.delta"
        try:
            if n not in got:
                raise ProbeError(f"{sites.attention[k].name} did not run on these inputs")
            delta = cache[dk] if dk in cache else None
            hw.writes[k], hw.bias[k], hw.errors[k] = _split(
                sites.attention[k], *got[n], delta, deltas[(s, i)].get(f"{r}_attn", "")
            )
            if s not in hw.mask and (m := prep.mask(hw.writes[k][:, 0], s)) is not None:
                hw.mask[s] = m
        except ProbeError as err:
            hw.refused[k] = str(err)
    if not hw.writes:
        (s, i, r), why = next(iter(hw.refused.items()))
        raise ProbeError(f"probe has no head writes for this model ({s} layer {i} {r}-attention: {why})")
    return hw


__all__ = ["head_writes", "HeadWrites", "split_heads"]
