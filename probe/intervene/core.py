"""What every intervention shares: the model's sites on some inputs, and naming heads and sublayers.

:func:`prepare_sites` runs the model on the inputs (a plain forward for the clean outputs, a
capture for the names, a scan for the sites). A head is named ``(layer, head)``, ``(stack,
layer, head)`` or ``(stack, layer, role, head)`` with ``role`` ``"self"``/``"cross"``; a sublayer
``(layer, kind)`` or ``(stack, layer, kind)`` with ``kind`` ``"attn"`` (= ``"self_attn"``),
``"cross_attn"`` or ``"mlp"``. Without a stack, the model's only stack (or ``stack=``) is meant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from probe.capture.engine import Trace
from probe.capture.inputs import prepare
from probe.errors import ProbeError
from probe.intervene.edits import check_free
from probe.intervene.locate import Site, Sites, locate


@dataclass
class Prepared:
    """The forward call on the inputs, its clean outputs, capture metadata and the sites."""

    model: nn.Module
    run: Any
    meta: dict
    outputs: Any
    sites: Sites

    def site(self, stack: str, layer: int, role: str) -> Site:
        """The site of an attention (``role`` self/cross) or MLP (``"mlp"``), else a ProbeError."""
        key = (stack, layer, role)
        got = self.sites.mlp.get((stack, layer)) if role == "mlp" else self.sites.attention.get(key)
        if got is not None:
            return got
        if key in self.sites.refused:
            what = "MLP" if role == "mlp" else f"{role}-attention"
            raise ProbeError(
                f"cannot place an intervention on the {what} of {stack} layer {layer}: "
                f"{self.sites.refused[key]}"
            )
        have = sorted({(s, i) for s, i, _ in self.sites.heads})
        raise ProbeError(
            f"{stack} layer {layer} has no {role} attention; the model's attention layers are "
            + ", ".join(f"{s} {i}" for s, i in have)
        )

    def mask(self, x: Tensor, stack: str) -> Tensor | None:
        """The real-token mask ``[batch, pos]`` of ``stack`` if it fits ``x [batch, pos, ...]``, else None."""
        keys = ("target_attention_mask", "attention_mask") if stack == "decoder" else ("attention_mask",)
        for k in keys:
            m = self.meta.get(k)
            if m is None:
                continue
            m = torch.as_tensor(m, dtype=torch.bool, device=x.device)
            if m.shape == x.shape[:2]:
                return m
        return None


def prepare_sites(model: nn.Module, inputs: Any, *, tokenizer: Any = None, target: Any = None) -> Prepared:
    """The :class:`Prepared` of ``model`` on ``inputs`` (three forwards, none of them edited)."""
    if not isinstance(model, nn.Module):
        raise ProbeError(f"probe intervenes on torch.nn.Module models, not {type(model).__name__}")
    check_free(model)
    p = _prepare(model, inputs, tokenizer, target)
    with torch.no_grad():
        outputs = p.run()
    t = Trace(model, metadata=p.meta)
    with torch.no_grad(), t:
        p.run()
    sites = locate(model, p, t.cache)
    if not sites.heads:
        raise ProbeError(f"probe found no attention in {type(model).__name__}; nothing to intervene on")
    return Prepared(model, p.run, p.meta, outputs, sites)


def _prepare(model: nn.Module, inputs: Any, tokenizer: Any, target: Any) -> Any:
    """:func:`probe.capture`'s forward call, or ``model(**inputs)`` for a dict of keyword arguments
    (e.g. ``input_ids`` and ``decoder_input_ids`` of an encoder-decoder)."""
    if not isinstance(inputs, dict):
        return prepare(model, inputs, tokenizer=tokenizer, target=target)
    if target is not None:
        raise ProbeError("target= is for texts; with a dict of model arguments give decoder_input_ids in it")
    meta = {}
    for k in ("attention_mask", "decoder_attention_mask"):
        if isinstance(inputs.get(k), Tensor):
            meta["target_attention_mask" if k.startswith("decoder") else k] = inputs[k].tolist()
    return _Call(lambda: model(**inputs), meta)


@dataclass
class _Call:
    run: Any
    meta: dict


def _stack(prep: Prepared, stack: str | None) -> str:
    stacks = prep.sites.stacks
    if stack is None:
        if len(stacks) == 1:
            return stacks[0]
        raise ProbeError(
            f"the model has stacks {', '.join(stacks)}; pass stack= or name the stack in each item"
        )
    if stack not in stacks:
        raise ProbeError(f"no stack {stack!r}; the model's stacks are {', '.join(stacks)}")
    return stack


def parse_heads(prep: Prepared, heads: Any, stack: str | None) -> list[tuple[Site, int]]:
    """``[(site, head), ...]`` for the named heads (see the module docstring)."""
    out = []
    for item in heads or []:
        if not isinstance(item, (tuple, list)) or not 2 <= len(item) <= 4:
            raise ProbeError(
                f"a head is (layer, head), (stack, layer, head) or (stack, layer, role, head), not {item!r}"
            )
        item = tuple(item)
        role = "self"
        if len(item) == 2:
            st, layer, head = _stack(prep, stack), item[0], item[1]
        elif len(item) == 3:
            st, layer, head = _stack(prep, item[0]), item[1], item[2]
        else:
            st, layer, role, head = _stack(prep, item[0]), item[1], item[2], item[3]
        if role not in ("self", "cross"):
            raise ProbeError(f"a head's role is 'self' or 'cross', not {role!r}")
        site = prep.site(st, int(layer), role)
        n = site.heads
        if not -n <= int(head) < n:
            raise ProbeError(f"{st} layer {layer} has {n} heads (0..{n - 1}); head {head} does not exist")
        out.append((site, int(head) % n))
    return out


_KINDS = {
    "attn": "self",
    "self_attn": "self",
    "attention": "self",
    "cross_attn": "cross",
    "cross": "cross",
    "mlp": "mlp",
}


def parse_sublayers(prep: Prepared, sublayers: Any, stack: str | None) -> list[Site]:
    """The sites of the named sublayers (``(layer, kind)`` or ``(stack, layer, kind)``)."""
    out = []
    for item in sublayers or []:
        if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
            raise ProbeError(f"a sublayer is (layer, kind) or (stack, layer, kind), not {item!r}")
        st = _stack(prep, stack if len(item) == 2 else item[0])
        layer, kind = item[-2], item[-1]
        if kind not in _KINDS:
            raise ProbeError(f"a sublayer kind is one of {', '.join(_KINDS)}, not {kind!r}")
        out.append(prep.site(st, int(layer), _KINDS[kind]))
    return out


def site_label(site: Site, head: int | None = None) -> str:
    """``decoder.L1.H2``, ``decoder.L1.cross.H0``, ``decoder.L1.attn``, ``decoder.L1.mlp``."""
    role = "" if site.role == "self" else f".{site.role}"
    if head is not None:
        return f"{site.stack}.L{site.layer}{role}.H{head}"
    return f"{site.stack}.L{site.layer}" + (
        ".mlp" if site.role == "mlp" else f"{role}.attn".replace(".self", "")
    )


__all__ = ["Prepared", "prepare_sites", "parse_heads", "parse_sublayers", "site_label"]
