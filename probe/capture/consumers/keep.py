"""The default pattern consumer: every pattern whole, in ``[batch, heads, q, k]``, stored.

A sublayer's pattern may arrive in parts (one softmax per head module) and in torch's
``[batch·heads, q, k]`` layout: when the sublayer returns, the parts are checked untouched,
restored to ``[batch, heads, q, k]`` (the batch size read from the stream handed to the
sublayer), stacked, cut to ``heads=``, judged causal or not, and handed to the
:class:`~probe.capture.hooks.store.Store`. SDPA weights are recomputed whole, into the store's reused
buffers when the capture streams.
"""

from __future__ import annotations

import torch
from torch import Tensor

from probe.cache.selection import Selection
from probe.capture.calls import Attention
from probe.capture.consumers.scale import scaled
from probe.capture.hooks.store import Store
from probe.capture.patterns import sdpa_weights
from probe.errors import ProbeError


def batch_size(primary: Tensor | None, q: int) -> int | None:
    """The batch size of the stream handed to a sublayer, ``[batch, q, d]`` or ``[q, batch, d]``
    (None when it is neither)."""
    p = primary
    if p is None or p.is_nested or p.dim() != 3:
        return None
    if p.shape[1] == q:
        return p.shape[0]
    return p.shape[1] if p.shape[0] == q else None


def restore_layout(parts: list[Tensor], batch: int | None) -> Tensor:
    """One ``[batch, heads, q, k]`` pattern from the parts of one attention (each ``[batch, heads,
    q, k]``, ``[batch, q, k]`` for one head, or ``[batch·heads, q, k]``), heads in arrival order."""
    out = []
    for p in parts:
        if p.dim() == 3 and batch is not None and p.shape[0] != batch:
            # scores laid out [batch·heads, q, k] (bmm/baddbmm): batch-major, as torch's own
            if p.shape[0] % batch:
                raise ProbeError(
                    f"attention weights of shape {list(p.shape)} do not split into batch "
                    f"{batch} x heads; lay the scores out as [batch, heads, query, key]"
                )
            p = p.reshape(batch, p.shape[0] // batch, *p.shape[1:])
        out.append(p if p.dim() >= 4 else p.unsqueeze(-3))
    pattern = out[0] if len(out) == 1 else torch.cat(out, dim=-3)
    return pattern.flatten(1, -4) if pattern.dim() > 4 else pattern


def is_causal(pattern: Tensor) -> bool:
    """Whether a self-attention ``[batch, heads, q, k]`` pattern (``q > 1``) attends only to earlier keys.

    Judged per text on the first and middle queries: a decoder's longest text has no pad queries
    (a pad query whose keys are all masked may come out uniform), an encoder's texts all see
    ahead. Query i sits at key ``k - q + i`` (bottom-right, past a KV cache).
    """
    q, k = pattern.shape[-2], pattern.shape[-1]
    mid, off = q // 2, k - q
    first = (pattern[:, :, 0, off + 1 :] == 0).flatten(1).all(dim=1)
    middle = (pattern[:, :, mid, off + mid + 1 :] == 0).flatten(1).all(dim=1)
    return bool((first & middle).any())


def differential(pattern: Tensor, calls: int, lam: float) -> tuple[Tensor, Tensor]:
    """A differential attention's ``(combined [batch, H/2, q, k], parts [batch, H/2, 2, q, k])``
    from its softmaxes ``[batch, calls·H, q, k]`` (DiffLlama runs one softmax over H query heads
    once per value half, the same weights each time; its head ``i`` is ``a[i] - λ·a[i + H/2]``)."""
    if calls < 1 or pattern.shape[1] % calls:
        raise ProbeError(f"a differential attention's {calls} softmaxes do not split its heads")
    runs = pattern.chunk(calls, dim=1)
    if any(not torch.equal(r, runs[0]) for r in runs[1:]) or runs[0].shape[1] % 2:
        raise ProbeError(
            "a differential attention's softmaxes differ between its calls (or its heads do not "
            "pair up); probe cannot tell which of them combine"
        )
    a1, a2 = runs[0].float().chunk(2, dim=1)
    return a1 - lam * a2, torch.stack([a1, a2], dim=2)


class KeepPatterns:
    """Stores each attention's whole pattern through ``store``, cut to ``selection``'s heads.

    ``attn.parts`` holds ``(pattern, version at capture)`` until the attention closes.
    """

    def __init__(self, store: Store, selection: Selection) -> None:
        self.store = store
        self.selection = selection
        # id(attention) -> whether every SDPA call recomputed into it had is_causal=True: such
        # weights are zero past each query by construction, so is_causal() need not read them
        self._sdpa_causal: dict[int, bool] = {}

    def weights(self, attn: Attention, pattern: Tensor, impl: str) -> None:
        p = pattern.detach()
        attn.parts.append((p, p._version))

    def sdpa(self, attn: Attention, args: tuple, kwargs: dict) -> None:
        store = self.store
        buf, clean = store.buffer()
        w = sdpa_weights(*args, **kwargs, out=buf, clean=clean, empty=store.empty, dtype=store.dtype)
        p = w.detach()
        causal = bool(len(args) > 5 and args[5] or kwargs.get("is_causal", False))
        store.filled(p, causal)
        attn.parts.append((p, p._version))
        self._sdpa_causal[id(attn)] = self._sdpa_causal.get(id(attn), True) and causal

    def close(self, attn: Attention) -> None:
        sdpa_causal = self._sdpa_causal.pop(id(attn), False)
        if not attn.parts:
            return
        for p, v in attn.parts:
            if p._version != v:
                # the weights the model used are those before or after the edit, which probe cannot
                # tell (SEW-D's XSoftmax zeroes the masked keys in place after its softmax)
                raise ProbeError(
                    f"{attn.module or 'a layer'}: its attention pattern was modified in place after "
                    "the softmax; probe cannot capture it exactly and refuses the layer"
                )
        parts = [p for p, _ in attn.parts]
        pattern = restore_layout(parts, batch_size(attn.primary, attn.qk[0]))
        diff = None
        if attn.diff_lambda is not None:
            pattern, diff = differential(pattern, len(parts), attn.diff_lambda)
        if attn.scale is not None:  # a derived kind's shadow (kinds.py): its own copy, scaled
            pattern = scaled(pattern, attn.scale)
        heads = self.selection.heads
        if heads is not None:
            self.selection.check_heads(pattern.shape[1])
            pattern = pattern[:, heads]
        # recomputed weights are probe's own memory (a reused buffer only once written); softmax
        # outputs are the model's, unless stacking or selecting heads copied them
        mine = (
            attn.scale is not None
            or attn.impl <= {"sdpa", "mha", "flex"}
            or all(pattern.untyped_storage().data_ptr() != p.untyped_storage().data_ptr() for p in parts)
        )
        if attn.split is not None:
            # one softmax over the layer's own keys then the source's (or the source's first):
            # stored as two parts (self, cross), each a copy
            other = Attention(inputs=attn.inputs, primary=attn.primary, qk=attn.qk, impl=attn.impl)
            other.role, other.closed = "cross", True
            own, src = (
                (slice(attn.split, None), slice(None, attn.split))
                if attn.source_first
                else (
                    slice(None, attn.split),
                    slice(attn.split, None),
                )
            )
            cross = pattern[..., src].contiguous()
            pattern, mine = pattern[..., own].contiguous(), True
            other.shape = tuple(cross.shape)
            other.handle = self.store.put(cross, owned=True)
            attn.also.append(other)
        if attn.role == "self" and pattern.shape[-2] > 1:
            # recomputed from causal SDPA calls only (zeros past each query, keys >= queries) and
            # neither scaled nor combined: causal by construction
            known = sdpa_causal and attn.impl == {"sdpa"} and attn.scale is None and diff is None
            known = known and attn.split is None and pattern.shape[-1] >= pattern.shape[-2]
            attn.causal = True if known else is_causal(pattern)
        attn.shape = tuple(pattern.shape)
        attn.handle = self.store.put(pattern, owned=mine or diff is not None)
        if diff is not None:
            attn.fields["parts"] = self.store.put(diff if heads is None else diff[:, heads], owned=True)
        self.store.stored(parts)
        attn.parts.clear()
        if attn.sinks:
            self._sinks(attn, len(parts))
        for name, t in attn.extra.items():
            attn.fields[name] = self.store.put(t if heads is None else t[:, heads], owned=True)
        attn.extra = {}

    def _sinks(self, attn: Attention, n_parts: int) -> None:
        """Store the sink column's mass of every head, ``[batch, heads, q]``, as field ``sink``."""
        if len(attn.sinks) != n_parts:
            raise ProbeError(
                "an attention mixes softmaxes with and without a sink column; probe cannot "
                "line its sink up with its heads"
            )
        cols = [s.unsqueeze(-1) for s in attn.sinks]
        sink = restore_layout(cols, batch_size(attn.primary, attn.qk[0]))[..., 0]
        if self.selection.heads is not None:
            sink = sink[:, self.selection.heads]
        attn.fields["sink"] = self.store.put(sink)
        attn.sinks.clear()
