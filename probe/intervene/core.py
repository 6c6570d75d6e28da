"""What every intervention shares: the model's sites on some inputs, and naming heads and sublayers.

:func:`prepare_sites` runs the model on the inputs (a plain forward for the clean outputs, a
capture for the names, a scan for the sites). A head is named ``(layer, head)``, ``(stack,
layer, head)`` or ``(stack, layer, role, head)`` with ``role`` ``"self"``/``"cross"``; a sublayer
``(layer, kind)`` or ``(stack, layer, kind)`` with ``kind`` ``"attn"`` (= ``"self_attn"``),
``"cross_attn"`` or ``"mlp"``. Without a stack, the model's only stack (or ``stack=``) is meant.

The inputs are whatever :func:`probe.capture` takes, prepared by its own entry
(:func:`probe.capture.inputs.route.prepare`): texts, ids, a dict or ``BatchFeature`` of keyword
tensors, pictures with ``processor=`` (and ``text=`` beside them for a vision-language model),
sound with ``processor=``/``sampling_rate=``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from probe.capture.engine.trace import Trace
from probe.capture.inputs.images import with_text
from probe.capture.inputs.route import prepare
from probe.errors import ProbeError
from probe.intervene.edits import check_free
from probe.intervene.locate import Site, Sites, locate


@dataclass
class Prepared:
    """The forward call on the inputs, its clean outputs, capture metadata and the sites;
    ``media``: the ``processor``/``text``/``sampling_rate`` the inputs were prepared with (a
    reference or corrupted run of pictures or sound is prepared with the same); ``labels``: the
    captured positions' names per input (``[CLS]``, ``patch (r, c)``, words)."""

    model: nn.Module
    run: Any
    meta: dict
    outputs: Any
    sites: Sites
    media: dict = field(default_factory=dict)
    labels: list = field(default_factory=list)  # the capture's position names ([CLS], patch (r, c))
    cache: Any = None  # the capture of the clean forward, kept with prepare_sites(keep_cache=True)

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


def media_kw(processor: Any = None, text: Any = None, sampling_rate: Any = None) -> dict:
    """The options that make pictures or sound into the model's inputs, as :func:`probe.capture`
    takes them: ``processor``, ``text`` (read beside pictures), ``sampling_rate`` (of sound)."""
    return {"processor": processor, "text": text, "sampling_rate": sampling_rate}


def prepare_sites(
    model: nn.Module,
    inputs: Any,
    *,
    tokenizer: Any = None,
    target: Any = None,
    processor: Any = None,
    text: Any = None,
    sampling_rate: Any = None,
    keep_cache: bool = False,
) -> Prepared:
    """The :class:`Prepared` of ``model`` on ``inputs`` (three forwards, none of them edited);
    ``processor``/``text``/``sampling_rate``: pictures or sound, as for :func:`probe.capture`;
    ``keep_cache``: keep the capture of the clean forward in ``Prepared.cache``."""
    if not isinstance(model, nn.Module):
        raise ProbeError(f"probe intervenes on torch.nn.Module models, not {type(model).__name__}")
    check_free(model)
    m = media_kw(processor, text, sampling_rate)
    p = prepare_call(model, inputs, tokenizer, target, **m)
    with torch.no_grad():
        outputs = p.run()
    t = Trace(model, metadata=p.meta)
    with torch.no_grad(), t:
        p.run()
    sites = locate(model, p, t.cache)
    if not sites.heads:
        raise ProbeError(f"probe found no attention in {type(model).__name__}; nothing to intervene on")
    kept = t.cache if keep_cache else None
    return Prepared(model, p.run, p.meta, outputs, sites, m, list(t.cache.tokens), kept)


def prepare_call(
    model: nn.Module,
    inputs: Any,
    tokenizer: Any,
    target: Any,
    processor: Any = None,
    text: Any = None,
    sampling_rate: Any = None,
) -> Any:
    """:func:`probe.capture`'s forward call (pictures and sound too, through its own entry, which
    also refuses a ``processor``/``text`` that does not fit the inputs), or ``model(**inputs)``
    for a plain dict of keyword arguments (e.g. ``input_ids`` and ``decoder_input_ids`` of an
    encoder-decoder)."""
    if processor is not None or text is not None or sampling_rate is not None or not isinstance(inputs, dict):
        pictures_or_sound = with_text(processor, text)  # text= needs pictures and their processor
        return prepare(
            model,
            inputs,
            tokenizer=tokenizer,
            target=target,
            processor=pictures_or_sound,
            sampling_rate=sampling_rate,
        )
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


def choose_stack(prep: Prepared, stack: str | None) -> str:
    """``stack`` checked against the model's stacks; None: the only one (else a one-line error)."""
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
            st, layer, head = choose_stack(prep, stack), item[0], item[1]
        elif len(item) == 3:
            st, layer, head = choose_stack(prep, item[0]), item[1], item[2]
        else:
            st, layer, role, head = choose_stack(prep, item[0]), item[1], item[2], item[3]
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
        st = choose_stack(prep, stack if len(item) == 2 else item[0])
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


__all__ = [
    "Prepared",
    "choose_stack",
    "media_kw",
    "prepare_sites",
    "prepare_call",
    "parse_heads",
    "parse_sublayers",
    "site_label",
]
