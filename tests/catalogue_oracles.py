"""Oracles the catalogue check (``catalogue_check.py``) adds for image and vision-language models,
whose attentions neither eager ``output_attentions`` nor the SDPA spy sees whole:

* ``torch.nn.MultiheadAttention`` (SigLIP's attention-pooling head, DETR-style heads): its weights
  per head, recomputed by the module itself with ``need_weights=True,
  average_attn_weights=False`` on the inputs of each call (read by a hook on the eager twin);
* the union check: a vision-language model's eager outputs hold the language model's attentions
  only, the SDPA spy sees the SDPA calls only, the hook the ``MultiheadAttention`` calls only.
  The capture is exact when every pattern each oracle returns is stored (each matched to a
  distinct stored pattern of its shape within the tolerance) and every stored pattern matches
  some oracle's pattern: nothing an oracle saw is missing, nothing stored is unchecked;
* the eager twin's softmaxes (:func:`softmax_spy`): every 3-d or 4-d softmax over the last axis of the
  eager forward, which may vouch for a stored pattern that no other oracle returns (an eager-only
  model's towers that ``output_attentions`` leaves out) but need not all be stored.

The SDPA spy (a softmax of the arguments handed to ``scaled_dot_product_attention``), the eager twin
(the same weights on eager attention) and the seed every forward starts from live here too.
"""

from __future__ import annotations

import copy
from typing import Any

import catalogue_layouts as L
import torch

# the global generator is seeded alike before every forward: a model that draws at random in eval
# (ViLT's patch sampling) draws the same in probe's run and in each oracle's
SEED = 0


def sdpa_spy(store: list):
    """A stand-in for ``scaled_dot_product_attention`` that appends softmax(q·kᵀ·scale + mask)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        kk = k
        if kk.dim() == 4 and q.dim() == 4 and kk.shape[1] != q.shape[1] and q.shape[1] % kk.shape[1] == 0:
            kk = kk.repeat_interleave(q.shape[1] // kk.shape[1], dim=1)
        s = (q.float() @ kk.float().transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if is_causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        if attn_mask is not None:
            s = (
                s.masked_fill(~attn_mask, float("-inf"))
                if attn_mask.dtype == torch.bool
                else s + attn_mask.float()
            )
        store.append(s.softmax(-1))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)

    return spy


def run_sdpa_oracle(model: Any, inputs: dict) -> list[torch.Tensor]:
    """The softmax of every ``scaled_dot_product_attention`` call of one forward, in call order."""
    store: list = []
    saved = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = sdpa_spy(store)
    try:
        with torch.no_grad():
            torch.manual_seed(SEED)
            model(**inputs)
    finally:
        torch.nn.functional.scaled_dot_product_attention = saved
    return store


def model_softmaxes(model: Any, inputs: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(softmaxes, mha)``: every softmax the model itself computes in one forward on its own
    attention implementation (:func:`softmax_spy`) and its ``nn.MultiheadAttention`` weights
    (:func:`mha_hooks` on the model, not the twin). Where eager computes something else (Phi-4's
    vision tower), the only oracles for what lies outside the attention interface, such as its
    attention-pooling head."""
    store: list = []
    mha: list = []
    hooks = mha_hooks(model, mha)
    try:
        with torch.no_grad(), softmax_spy(store):
            torch.manual_seed(SEED)
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return store, mha


def eager_twin(model: Any) -> Any:
    """The same weights on eager attention (built anew; else the same object switched to eager)."""
    try:
        twin = type(model)._from_config(copy.deepcopy(model.config), attn_implementation="eager")
        twin.load_state_dict(model.state_dict())
        return twin.eval()
    except Exception:
        model.set_attn_implementation("eager")
        return model


def eager_softmaxes(model: Any, inputs: dict) -> tuple[list, list]:
    """The eager twin's softmaxes and Swin layer calls from a forward without ``output_attentions``
    (for a model whose eager forward fails with the flag); empty where that fails too."""
    softmaxes: list = []
    windows: list = []
    try:
        twin = eager_twin(model)
        hooks = L.window_hooks(twin, windows)
        try:
            with torch.no_grad(), softmax_spy(softmaxes):
                torch.manual_seed(SEED)
                twin(**inputs)
        finally:
            for h in hooks:
                h.remove()
    except Exception:  # noqa: BLE001 - no eager forward at all: no eager softmaxes
        return [], []
    return softmaxes, windows


def mha_hooks(twin: Any, store: list) -> list:
    """Forward hooks on every ``nn.MultiheadAttention`` of ``twin`` that append the call's
    per-head weights ``[batch, heads, q, k]`` (batch first, as probe stores them) to ``store``."""
    busy: list = []

    def hook(module, args, kwargs, _out):
        if busy:
            return
        kw = {k: v for k, v in kwargs.items() if k not in ("need_weights", "average_attn_weights")}
        busy.append(1)
        try:
            _, w = module(*args, **kw, need_weights=True, average_attn_weights=False)
        finally:
            busy.clear()
        if w is not None:
            store.append(w.float() if w.dim() == 4 else w.float().unsqueeze(0))

    return [
        m.register_forward_hook(hook, with_kwargs=True)
        for m in twin.modules()
        if isinstance(m, torch.nn.MultiheadAttention)
    ]


def softmax_spy(store: list):
    """A context manager that appends every 3-d or 4-d softmax over the last axis (``F.softmax``,
    ``torch.softmax``, ``Tensor.softmax``) computed inside it to ``store``: on the eager twin, the
    weights of eager attention code that ``output_attentions`` does not return (a multimodal
    model's other towers, FLAVA's and GIT's)."""
    import contextlib

    @contextlib.contextmanager
    def spy():
        saved = torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax

        inside: list = []  # F.softmax calls Tensor.softmax: one record per outermost call

        def wrap(fn):
            def inner(x, *args, **kwargs):
                inside.append(1)
                try:
                    out = fn(x, *args, **kwargs)
                finally:
                    inside.pop()
                if inside:
                    return out
                dim = kwargs.get("dim", args[0] if args else None)
                if isinstance(out, torch.Tensor) and out.dim() in (3, 4) and dim in (-1, out.dim() - 1):
                    store.append(out.detach().float())
                return out

            return inner

        torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax = (wrap(f) for f in saved)
        try:
            yield
        finally:
            torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax = saved

    return spy()


def _distinct(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """``ts`` without tensors equal to an earlier one (BLIP-2's eager outputs list the Q-Former's
    cross-attention twice)."""
    out: list[torch.Tensor] = []
    for t in ts:
        if not any(u.shape == t.shape and torch.equal(u, t) for u in out):
            out.append(t)
    return out


def join_chunks(oracle: list[torch.Tensor], got: list[torch.Tensor]) -> list[torch.Tensor]:
    """``oracle`` with each run of consecutive one-row square calls ``[1, h, n_i, n_i]`` whose sizes add
    up to a stored ``[1, h, N, N]`` (two calls or more) joined into that block-diagonal
    ``[1, h, N, N]``, zeros between the blocks: a packed vision tower (Qwen2-VL) attends within each
    picture's patches, one call per picture (its ``cu_seqlens`` chunks), over one sequence of all
    pictures' patches."""
    sizes = {
        (p.shape[1], p.shape[2]) for p in got if p.dim() == 4 and p.shape[0] == 1 and p.shape[2] == p.shape[3]
    }

    def square(t: torch.Tensor) -> bool:
        return t.dim() == 4 and t.shape[0] == 1 and t.shape[2] == t.shape[3]

    out, i = [], 0
    while i < len(oracle):
        t, run = oracle[i], 0
        if square(t):
            h, n, j = t.shape[1], t.shape[2], i + 1
            while j < len(oracle) and square(oracle[j]) and oracle[j].shape[1] == h:
                n += oracle[j].shape[2]
                j += 1
                if (h, n) in sizes:
                    run = j - i
                    break
        if not run:
            out.append(t)
            i += 1
            continue
        block, at = t.new_zeros(1, h, n, n), 0
        for c in oracle[i : i + run]:
            m = c.shape[2]
            block[0, :, at : at + m, at : at + m] = c[0]
            at += m
        out.append(block)
        i += run
    return out


def _same(p: torch.Tensor, w: torch.Tensor, close: Any) -> bool:
    """Whether stored ``p`` ``[b, h, q, k]`` equals softmax ``w``, 4-d or ``[b·h, q, k]`` (CLIP-style
    eager code that folds the heads into the batch)."""
    if w.dim() == 3 and p.dim() == 4:
        p = p.flatten(0, 1)
    return p.shape == w.shape and close(p, w)


def union_check(
    got: list[torch.Tensor],
    oracles: dict[str, list[torch.Tensor]],
    close: Any,
    cover: dict[str, list[torch.Tensor]] | None = None,
) -> tuple[bool, str]:
    """Whether the stored patterns ``got`` and the oracles' patterns cover each other (see the
    module docstring); ``close(a, b)`` says whether two patterns of one shape agree. ``cover``:
    oracles whose patterns need not all be stored (the eager twin's every softmax, router and
    pooling softmaxes among them), only able to vouch for a stored pattern. Returns ``(exact,
    why)``, ``why`` naming the first pattern left without a partner."""
    used: set[int] = set()
    for name, want in oracles.items():
        free = list(range(len(got)))
        for j, w in enumerate(_distinct(want)):
            i = next((i for i in free if _same(got[i], w, close)), None)
            if i is None:
                return False, f"{name} pattern {j} {tuple(w.shape)} has no stored pattern equal to it"
            free.remove(i)
            used.add(i)
    extra = [w for ws in (cover or {}).values() for w in ws]
    vouched = {i for i in range(len(got)) if any(_same(got[i], w, close) for w in extra)}
    missing = [i for i in range(len(got)) if i not in used | vouched]
    if missing:
        i = missing[0]
        return False, f"stored pattern {i} {tuple(got[i].shape)} matches no oracle's pattern"
    counts = ", ".join(f"{n} {len(w)}" for n, w in {**oracles, **(cover or {})}.items() if w)
    return True, f"every stored pattern equals one of the oracles' ({counts}), and each of theirs is stored"


def head_averaged(
    got: list[torch.Tensor], want: list[torch.Tensor], softmaxes: list[torch.Tensor], close: Any
) -> tuple[bool, str] | None:
    """Where eager returns a layer's weights averaged over the heads and broadcast to every head
    (WavLM: ``F.multi_head_attention_forward``'s default average, a transformers issue it notes in
    its code), the stored per-head patterns are held to eager through their head mean and, per
    head, to the eager forward's own softmaxes (the one inside the function, ``[batch·heads, q,
    k]``). ``(exact, why)``; None where no eager pattern is such a broadcast average."""

    def broadcast(w: torch.Tensor) -> bool:
        return w.dim() == 4 and w.shape[1] > 1 and torch.equal(w, w[:, :1].expand_as(w))

    if len(got) != len(want) or not any(broadcast(w) for w in want):
        return None
    for i, (p, w) in enumerate(zip(got, want, strict=True)):
        if p.shape != w.shape:
            return False, f"pattern {i}: shape {tuple(p.shape)} vs eager {tuple(w.shape)}"
        if not broadcast(w):
            if not close(p, w):
                return False, f"pattern {i} differs from eager"
            continue
        if not close(p.mean(1, keepdim=True).expand_as(p), w):
            return False, f"pattern {i}: its head mean differs from eager's averaged weights"
        if not any(_same(p, s, close) for s in softmaxes):
            return False, f"pattern {i} matches none of the eager forward's softmaxes per head"
    n = sum(broadcast(w) for w in want)
    return True, (
        f"eager returns {n} layer(s) averaged over the heads (broadcast to each head): the stored "
        "patterns' head means equal eager's, and each per head one of the eager forward's softmaxes"
    )
