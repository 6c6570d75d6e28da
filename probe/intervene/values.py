"""The values each attention mixes, read where the model computes them, and what each head writes from them.

:class:`ValueTap` hooks the value projections the anatomy found (:mod:`probe.intervene.anatomy`)
and keeps each one's latest output while the model runs. When an attention's sublayer returns,
``tap.values(key, K)`` cuts that output into the attention's value heads, ``[batch, K, kv heads,
d_head]``: exactly what the model fed its attention, the projection's bias included (an anatomy
whose value blocks do not reach the heads' outputs unchanged, ``v_exact`` False, is refused).
:func:`head_values` turns them into what each head writes from each key, ``v_j W_O^h`` ``[batch,
heads, K, d_model]``, and :func:`value_norms` into its norm ``||v_j W_O^h||`` ``[batch, heads,
K]``, a block of keys at a time. ``tap.scale`` is the pattern kind a capture keeps beside the
weights (:mod:`probe.capture.consumers.kinds`): the capture multiplies each weight ``a_ij`` by
it, giving ``||a_ij v_j W_O^h||`` (Kobayashi et al. 2020; ``a_ij >= 0``).

The hooks only keep a reference to each output (no op runs inside the forward); the norms are
computed when the capture asks, while its hooks are off.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from probe.errors import ProbeError
from probe.intervene.anatomy_parts import Anatomy

Key = tuple[str, int, str]
FLOATS = 1 << 24  # floats of d_model-wide writes held at once by value_norms


def label(key: Key) -> str:
    """``decoder/3/self``: an attention's name in a cache's metadata."""
    return f"{key[0]}/{key[1]}/{key[2]}"


def head_values(v: Tensor, W_O: Tensor, kv_of: list[int]) -> Tensor:
    """What each head writes from each key, ``v_j^{kv(h)} W_O^h``: ``v`` ``[B, K, Hkv, dh]``,
    ``W_O`` ``[H, dh, d]`` -> ``[B, H, K, d]`` (float32)."""
    vh = v.float()[:, :, kv_of]
    return torch.einsum("bkhe,hed->bhkd", vh, W_O.to(vh.device, torch.float32))


def value_norms(v: Tensor, W_O: Tensor, kv_of: list[int]) -> Tensor:
    """``||v_j^{kv(h)} W_O^h||`` ``[B, H, K]`` (float32), :func:`head_values` a block of keys at a time."""
    B, K = v.shape[:2]
    H, d = W_O.shape[0], W_O.shape[-1]
    out = torch.empty(B, H, K, device=v.device)
    step = max(1, FLOATS // max(1, B * H * d))
    for j in range(0, K, step):
        out[..., j : j + step] = head_values(v[:, j : j + step], W_O, kv_of).norm(dim=-1)
    return out


class ValueTap:
    """Hooks on the value projections of ``keys`` (every attention of ``an`` by default); use as a
    context manager around the forward (see the module docstring). ``refused``: one line per
    attention without values, by :func:`label` (filled before and while the model runs)."""

    def __init__(self, an: Anatomy, keys: list[Key] | None = None, refused: dict | None = None) -> None:
        self.an = an
        self.refused: dict[str, str] = refused if refused is not None else {}
        self.W_O: dict[Key, Tensor] = {}
        for key, why in an.refused.items():
            if len(key) == 3 and key[2] in ("self", "cross") and (keys is None or key in keys):
                self.refused[label(key)] = why
        for key, att in an.attention.items():
            if keys is not None and key not in keys:
                continue
            if not att.v_exact:
                self.refused[label(key)] = "its values are changed after the value projection"
                continue
            try:
                W, _ = an.matrix(att.out.module)
            except ProbeError as err:
                self.refused[label(key)] = str(err)
                continue
            self.W_O[key] = W.reshape(att.heads, att.d_head, W.shape[-1])
        self.latest: dict[int, Tensor] = {}
        self._handles: list[Any] = []

    @property
    def keys(self) -> list[Key]:
        return list(self.W_O)

    def __enter__(self) -> ValueTap:
        mods = {id(b.module): b.module for k in self.W_O for b in self.an.attention[k].v}
        for m in mods.values():
            self._handles.append(m.register_forward_hook(self._keep))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.latest.clear()

    def _keep(self, module: nn.Module, args: Any, out: Any) -> None:
        if isinstance(out, Tensor):
            self.latest[id(module)] = out

    def key_of(self, module: str | None, role: str | None) -> Key | None:
        """The attention whose value projections (or output projection) live inside the sublayer
        module at path ``module``, of role ``role``; None when none does."""
        if not module:
            return None
        prefix = module + "."
        for key in self.W_O:
            att = self.an.attention[key]
            if key[2] == role and any(n.startswith(prefix) for n in [att.out.name, *(b.name for b in att.v)]):
                return key
        return None

    def values(self, key: Key, K: int) -> Tensor:
        """``[B, K, Hkv, dh]``: the value heads of ``key``'s last run (a ProbeError saying why not)."""
        att = self.an.attention[key]
        heads = []
        for b in att.v:
            o = self.latest.get(id(b.module))
            if o is None:
                raise ProbeError(f"its value projection {b.name} did not run")
            o = o[..., b.cols]
            lead = o.shape[:-1]
            if len(lead) == 2 and lead[1] == K:
                pass
            elif len(lead) == 2 and lead[0] == K:
                o = o.transpose(0, 1)
            elif len(lead) == 1 and lead[0] % K == 0:
                o = o.reshape(-1, K, o.shape[-1])
            else:
                raise ProbeError(f"its values {list(o.shape)} are not one per key ({K} keys)")
            heads.append(o)
        return torch.stack(heads, 2)

    def norms(self, key: Key, K: int) -> Tensor:
        """``||v_j W_O^h||`` ``[B, H, K]`` of ``key``'s last run."""
        return value_norms(self.values(key, K), self.W_O[key], self.an.attention[key].kv_of)

    def scale(self, attn: Any) -> Tensor | None:
        """The contribution kind's scale of a closed capture attention (``attn.module``,
        ``attn.role``, ``attn.qk``), or None with the reason in :attr:`refused`."""
        key = self.key_of(attn.module, attn.role)
        if key is None:
            self.refused.setdefault(
                f"{attn.module}/{attn.role}", "probe found no value projection inside this attention's module"
            )
            return None
        try:
            return self.norms(key, attn.qk[1])
        except ProbeError as err:
            self.refused[label(key)] = str(err)
            return None
        finally:
            self.forget(key)

    def forget(self, key: Key) -> None:
        """Let ``key``'s value outputs go (a long context holds one layer's at a time)."""
        for b in self.an.attention[key].v:
            self.latest.pop(id(b.module), None)


__all__ = ["ValueTap", "head_values", "value_norms", "label", "Key"]
