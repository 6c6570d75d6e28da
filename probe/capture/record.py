"""Recording attention patterns: parts gathered per sublayer, then flushed to the sink.

A sublayer's pattern may arrive in parts (one softmax per head module) and in torch's
``[batch·heads, q, k]`` layout: when the sublayer returns, the parts are checked untouched,
restored to ``[batch, heads, q, k]`` (the batch size read from the stream handed to the
sublayer), stacked, cut to ``heads=``, judged self/cross and causal, and handed to the sink
(converted to ``dtype=`` on the way). Streamed captures recompute SDPA weights into two scratch
buffers used in turn.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from probe.capture.layers import _Attn
from probe.errors import ProbeError


class _Recorder:
    """The :class:`~probe.capture.tracer.Tracer`'s attention events and storage."""

    # -- attention events ----------------------------------------------------------------------
    def wants_pattern(self) -> bool:
        """Whether the attention about to be seen belongs to a layer being captured."""
        if not self.stack:
            return False
        return self._current_layer().wanted

    def note_event(self) -> None:
        for c in self.stack:
            c.events += 1
        self._current_layer().events += 1

    def on_softmax(self, args: tuple, kwargs: dict, out: Tensor) -> None:
        if not isinstance(out, Tensor) or out.dim() < 3:
            return
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if dim is None or dim not in (-1, out.dim() - 1):
            return
        if out.shape[-1] not in self.lengths or out.shape[-2] not in self.lengths:
            return  # over experts, classes or features: not attention over a sequence
        if self.wants_pattern():
            self.on_pattern(out, "softmax")
        else:
            self.note_event()

    def scratch(self) -> tuple[Tensor | None, bool]:
        """A buffer the next recomputed pattern may be written into (or None), and whether it is
        clean (last filled by a causal call: its unseen keys are zeros already)."""
        if not self._reuse or self._scratch_busy:
            return None, False
        buf = self._scratches[self._turn]
        if buf is not None:
            self.sink.wait_written(buf)  # its previous pattern may still be on its way to disk
        return buf, buf is not None and self._clean[self._turn]

    def note_causal(self, causal: Any) -> None:
        """Whether the SDPA call about to be recorded was ``is_causal`` (keeps a scratch clean)."""
        self._causal_call = bool(causal)

    def on_pattern(self, pattern: Tensor, impl: str) -> None:
        """Record an attention pattern ``[batch, (head,) query, key]`` computed now."""
        self.note_event()
        layer = self._current_layer()
        sub = self._sublayer_call()
        if sub.attn is None:
            a = _Attn(inputs=sub.inputs, primary=sub.primary)
            sub.attn = a
            layer.attns.append(a)
        a = sub.attn
        if a.parts and a.parts[0][0].shape[-2:] != pattern.shape[-2:]:
            # a second, differently shaped attention in the same sublayer: record it on its own
            self._flush_attn(a)
            a = _Attn(inputs=sub.inputs, primary=sub.primary)
            sub.attn = a
            layer.attns.append(a)
        p = pattern.detach()
        if self._reuse and not self._scratch_busy and impl == "sdpa":
            self._scratches[self._turn], self._scratch_busy = p, True
            # same shape next time: sdpa_weights writes the same causal region, the rest stays 0
            self._clean[self._turn] = self._causal_call
        a.parts.append((p, p._version))
        a.impl.add(impl)
        self.impls.add(impl)

    def _batch_size(self, a: _Attn, q: int) -> int | None:
        """The batch size of the stream handed to the sublayer: ``[batch, q, d]`` or ``[q, batch, d]``."""
        p = a.primary
        if p is None or p.is_nested or p.dim() != 3:
            return None
        if p.shape[1] == q:
            return p.shape[0]
        return p.shape[1] if p.shape[0] == q else None

    def _flush_attn(self, a: _Attn) -> None:
        if not a.parts or a.handle is not None:
            return
        for p, v in a.parts:
            if p._version != v:
                raise RuntimeError(
                    "an attention pattern was modified in place after softmax; "
                    "probe cannot capture it exactly"
                )
        batch = self._batch_size(a, a.parts[0][0].shape[-2])
        parts = []
        for p, _ in a.parts:
            if p.dim() == 3 and batch is not None and p.shape[0] != batch:
                # scores laid out [batch·heads, q, k] (bmm/baddbmm): batch-major, as torch's own
                if p.shape[0] % batch:
                    raise ProbeError(
                        f"attention weights of shape {list(p.shape)} do not split into batch "
                        f"{batch} x heads; lay the scores out as [batch, heads, query, key]"
                    )
                p = p.reshape(batch, p.shape[0] // batch, *p.shape[1:])
            parts.append(p if p.dim() >= 4 else p.unsqueeze(-3))
        pattern = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-3)
        if pattern.dim() > 4:
            pattern = pattern.flatten(1, -4)
        if self.heads is not None:
            if max(self.heads) >= pattern.shape[1]:
                n = pattern.shape[1]
                raise ProbeError(
                    f"heads={self.heads}: this model's attention has {n} heads; choose indices from 0-{n - 1}"
                )
            pattern = pattern[:, self.heads]
        q, k = pattern.shape[-2], pattern.shape[-1]
        cross = q != k
        p0 = a.primary
        if not cross and p0 is not None and not p0.is_nested and p0.dim() == 3:
            st = self.layer.stream if self.layer is not None else None
            for t in a.inputs:
                if (
                    t is not p0
                    and not t.is_nested
                    and t.dim() == 3
                    and t.is_floating_point()
                    and t.shape[0] == p0.shape[0]
                    and t.shape[-1] == p0.shape[-1]
                    and t.data_ptr() != p0.data_ptr()
                    and not (st is not None and st.label(t)[0])  # the layer's own stream (BLOOM's residual)
                ):
                    cross = True
                    break
        a.role = "cross" if cross else "self"
        if not cross and q > 1:
            # judged per text: a decoder's longest text has no pad queries (a pad query whose keys
            # are all masked may come out uniform), an encoder's texts all see ahead
            mid = q // 2
            first = (pattern[:, :, 0, 1:] == 0).flatten(1).all(dim=1)
            middle = (pattern[:, :, mid, mid + 1 :] == 0).flatten(1).all(dim=1)
            a.causal = bool((first & middle).any())
        a.shape = tuple(pattern.shape)
        # recomputed weights are probe's own memory (the scratch is only reused once written);
        # softmax outputs are the model's
        mine = a.impl <= {"sdpa", "mha"} or all(
            pattern.untyped_storage().data_ptr() != p.untyped_storage().data_ptr() for p, _ in a.parts
        )  # stacked heads or selected heads are a copy
        a.handle = self._put(pattern, owned=mine)
        if self._scratch_busy and any(p is self._scratches[self._turn] for p, _ in a.parts):
            self._scratch_busy = False
            self._turn ^= 1
        a.parts.clear()

    # -- storage -------------------------------------------------------------------------------
    def _put(self, t: Tensor, owned: bool = False) -> int:
        """Hand ``t`` to the sink; a converted copy is probe's own memory."""
        stored = self._store(t)
        if not owned and stored.device == t.device and not stored.is_nested and not t.is_nested:
            owned = stored.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        return self.sink.put(stored, owned=owned)

    def _store(self, t: Tensor) -> Tensor:
        t = t.detach()
        if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
            t = t.to(self.dtype)
        self.stored_dtypes.add(str(t.dtype).replace("torch.", ""))
        return t
