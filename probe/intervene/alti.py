"""ALTI (Ferrando et al. 2022): token-to-token contributions through each attention block, rolled out.

In a pre-norm layer the attention block's output at position ``i`` is a sum of one term per
input token ``j``, exactly (the weights ``a`` and each token's norm ``LN(x_j)`` as the model
computed them)::

    y_i = sum_j T_i(x_j) + b_O,    T_i(x_j) = sum_h a_ij^h v_j^h W_O^h  +  [i = j] x_i

(``v_j^h = LN(x_j) W_V^h + b_V^h``, the value the head read, bias included; the residual ``x_i``
belongs to token ``i``; the output bias ``b_O`` to no token). ALTI scores each term by how close
it brings the output, in the L1 norm, and normalises each row::

    c_ij = max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1) / sum_k max(0, ||y_i||_1 - ||y_i - T_i(x_k)||_1)

:func:`alti` returns these per layer and their rollout across layers (:class:`TokenMixing`).
What is left out: the MLPs, applied to each token on its own, mix no tokens and are not
decomposed (the rollout goes from attention block to attention block, as in the paper);
the bias ``b_O`` is in ``y_i`` but no token's. Checked, per layer: ``sum_j T_i(x_j) + b_O``
equals the stream after the attention that the capture records (``resid_pre`` plus the
attention's delta), to 1e-5 relative in float32 (8 units in the last place of the model's own
dtype otherwise); a layer where it does not, a post-norm layer (the norm after the residual
mixes the terms), a stack with cross-attention or layers sharing one module are refused in one
line.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from probe.capture.inputs.images import with_text
from probe.errors import ProbeError
from probe.forward import capture
from probe.intervene.anatomy import Anatomy
from probe.intervene.mixing import TokenMixing, anatomy_of, normalise_rows, one_stack, real_tokens
from probe.intervene.values import FLOATS, ValueTap, head_values, label

LEFT_OUT = (
    "MLPs are applied to each token on its own: they mix no tokens and are left out of the rollout; "
    "the output projection's bias is in each y_i but no token's"
)


def tolerance(dtype: torch.dtype) -> float:
    """The check's relative tolerance for a model computing in ``dtype``."""
    return max(1e-5, 8 * torch.finfo(dtype).eps)


def alti_layer(alpha: Tensor, f: Tensor, x: Tensor, b_O: Tensor) -> tuple[Tensor, Tensor]:
    """``(c [B, T, T] before normalising, y [B, T, d])`` of one layer: ``alpha`` ``[B, H, T, T]``,
    ``f = v_j W_O^h`` ``[B, H, T, d]``, ``x`` the stream entering ``[B, T, d]``, ``b_O`` ``[d]``;
    a block of query rows at a time."""
    B, H, T, d = f.shape
    c = torch.empty(B, T, T, device=f.device)
    y = torch.empty(B, T, d, device=f.device)
    step = max(1, FLOATS // max(1, B * T * d))
    for i0 in range(0, T, step):
        i1 = min(T, i0 + step)
        terms = torch.einsum("bhij,bhjd->bijd", alpha[:, :, i0:i1].float(), f)  # [B, r, T, d]
        r = torch.arange(i1 - i0, device=f.device)
        terms[:, r, r + i0] += x[:, i0:i1].float()
        yi = terms.sum(2) + b_O.to(f.device)
        y[:, i0:i1] = yi
        dist = (yi[:, :, None, :] - terms).abs().sum(-1)
        c[:, i0:i1] = (yi.abs().sum(-1, keepdim=True) - dist).clamp_min(0)
    return c, y


def alti(
    model: nn.Module | Anatomy,
    inputs: Any,
    *,
    stack: str | None = None,
    tokenizer: Any = None,
    target: Any = None,
    processor: Any = None,
    text: Any = None,
    sampling_rate: int | None = None,
) -> TokenMixing:
    """ALTI contributions of every pre-norm attention block of ``stack`` (the model's only one by
    default) on ``inputs`` (anything :func:`probe.capture` takes), and their rollout (see the
    module docstring). Costs the anatomy's few forwards and one capture of whole patterns;
    ``model`` may be its :class:`~probe.intervene.anatomy.Anatomy` already found."""
    media = {"processor": processor, "text": text, "sampling_rate": sampling_rate}
    an = anatomy_of(model, inputs, tokenizer=tokenizer, target=target, **media)
    model = an.model
    stack = one_stack(an.stacks, stack)
    keys = [(s, i, "self") for s, i in an.layers if s == stack]
    tap = ValueTap(an, keys)
    _refuse(an, tap, keys)
    values: dict = {}

    def keep(attn: Any) -> None:  # asked as the contribution kind, it keeps the values and stores nothing
        key = tap.key_of(attn.module, attn.role)
        if key is not None and key[0] == stack:
            values[key] = tap.values(key, attn.qk[1])
            tap.forget(key)

    with tap:
        cache = capture(
            model, inputs, tokenizer=tokenizer, target=target, kinds={"contribution": keep}, **_media(media)
        )
    mask, tokens = real_tokens(cache, stack)
    out = TokenMixing("ALTI", stack, {}, mask, tokens, notes=[LEFT_OUT])
    for key in keys:
        _, layer, _ = key
        pre = cache[f"{stack}.blocks.{layer}.resid_pre"]
        want = pre.float() + cache[f"{stack}.blocks.{layer}.self_attn.delta"].float()
        att = an.attention[key]
        f = head_values(values[key], tap.W_O[key], att.kv_of)
        b_O = an.head_weights(*key).b_O
        c, y = alti_layer(cache.pattern(stack, layer), f, pre, b_O)
        err = ((y - want.to(y.device)).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        if err > tolerance(pre.dtype):
            raise ProbeError(
                f"probe has no ALTI for this model ({label(key)}: the attention block's output is not the "
                f"sum of its per-token terms, relative error {err:.1e}; something between the heads and "
                "the stream is not linear)"
            )
        out.matrices[layer] = normalise_rows(c, mask).cpu()
        out.errors[layer] = err
    return out


def _media(media: dict) -> dict:
    return {
        "processor": with_text(media["processor"], media["text"]),
        "sampling_rate": media["sampling_rate"],
    }


def _refuse(an: Any, tap: ValueTap, keys: list) -> None:
    """A ProbeError naming the first layer of the stack ALTI cannot decompose exactly."""

    def no(key: tuple, why: str) -> ProbeError:
        return ProbeError(f"probe has no ALTI for this model ({label(key)}: {why})")

    if any((s, i, "cross") in an.attention or (s, i, "cross") in an.refused for s, i, _ in keys):
        raise no(keys[0], "its stack has cross-attention, which reads another stack's tokens")
    seen: dict = {}
    for key in keys:
        if label(key) in tap.refused or key not in tap.W_O:
            raise no(key, tap.refused.get(label(key), "probe found no attention there"))
        att = an.attention[key]
        if att.delta == "stream difference":
            raise no(key, "a norm follows the residual (post-norm) and mixes the terms")
        if (*key, "norm") in an.refused:
            raise no(key, an.refused[(*key, "norm")])
        mods = tuple(id(b.module) for b in att.v)
        if mods in seen:
            raise no(
                key, f"it shares its value projection with {label(seen[mods])} (one module, several layers)"
            )
        seen[mods] = key


__all__ = ["alti", "alti_layer", "LEFT_OUT"]
