"""Eager ``output_attentions`` in the layouts probe stores, for the catalogue check
(``catalogue_check.py``): written here from the models' own definitions, never with probe's
mapping code, so that the check stays an independent oracle.

* Longformer / LED sliding-chunk attention: eager returns ``[batch, heads, T, x + 2w + 1]``, the
  first ``x`` columns the weights of the ``x`` global tokens (the positions of
  ``global_attention_mask``, in order), column ``x + j`` the key ``i - w + j`` of query ``i``;
  mapped to ``[batch, heads, T, T]``, zeros outside the window (Longformer's own definition).
* LongT5 block-local attention: eager returns ``[batch, blocks, heads, n, 3n]``, query ``a`` of
  block ``i`` over the keys of blocks ``i - 1, i, i + 1`` (column ``c`` is key ``(i - 1)·n + c``);
  mapped to ``[batch, heads, T, T]`` for the ``T`` positions of the input.
* Differential attention (DiffLlama): eager returns the ``2H`` softmaxes of one call, query head
  ``h`` of the first half paired with ``h + H`` (the model chunks its heads in two); the combined
  map of differential head ``h`` is ``a1 - λ·a2`` with λ computed here from the module's
  ``lambda_q1/k1/q2/k2`` and ``lambda_init``, and the parts are ``[a1, a2]``.
* SqueezeBERT: eager returns the scores before the softmax (mask added); their softmax over the
  keys is the weights its attention module computes.
* LiLT: each layer's self-attention runs two softmaxes over the same summed text and layout
  scores, the layout stream's then the text stream's; eager returns the text stream's. The layout
  stream's is written here from the layer's ``query``/``key``/``layout_query``/``layout_key``
  outputs (read by hooks) and put before eager's, in run order.
* DiffusionGemma: its decoder runs one softmax over the encoder's cached prompt keys then the
  canvas's own; probe stores the two parts (``cross_attn``, ``self_attn``) and eager returns the
  whole: probe's parts are joined back (``[cross | self]``) for the comparison.
* CpmAnt: eager crops its weights to the text (``[prompt:, prompt:]``, ``prompt`` =
  ``config.prompt_length``); probe's patterns are cropped the same way before the comparison.
* Pegasus-X's encoder (block-local attention with global tokens): eager's ``output_attentions``
  leaves the encoder out, but its attention module returns its weights as its third output
  (``{"global": [b, h, G, G + P], "local": [b, h, blocks, n, G + n]}``), read here by a hook on
  the eager twin. Query ``a`` of block ``i`` is padded position ``i·n + a``, key column ``G + c``
  padded position ``i·n + c``; a layer that staggers its blocks pads ``n // 2`` ahead, so padded
  position ``p`` is input position ``p − n // 2`` there (``p`` elsewhere). Mapped to the tokens'
  ``[b, h, T, T]`` (weights on the global tokens are left out, as probe's pattern does).
* Reformer's local attention: eager returns ``[b, h, n, c, m·c]``, query ``a`` of chunk ``i`` (position
  ``i·c + a``) over the ``m`` chunks from ``i − before`` on, which the model rolls cyclically: column
  ``j`` is key ``((i − before)·c + j) mod (n·c)``; a key met twice gets the sum. Its LSH layers
  return the same layout over hash-sorted positions: sorted position ``s`` is input position
  ``order[s]``, ``order`` the stable sort of the layer's buckets (read by a hook on the module,
  sorted by the model's own helper); one hash round only (more: left unmapped).
* ProphetNet: eager returns its encoder and cross-attention maps as scores before the softmax
  (mask added; their softmax is the weights), the decoder's main stream as weights, and its
  predict streams as ``decoder_ngram_attentions`` ``[b, ngram, h, T, 2T]``; put in probe's order
  here: per decoder layer the main stream, then predict stream 1, 2, ...
* DeepSeek-V4's compressed layers: eager returns ``[b, h, T, T + C]``, the weights on the T
  positions then on the C compressed block summaries (the sink column dropped); split here into
  the positions' ``[b, h, T, T]`` and the summaries' ``[b, h, T, C]`` (under ``"compressed"``).

Each mapping returns None where the eager tensor does not fit it, or where it gives weight to a
key outside the sequence on a real query row (the mapping would lose mass): the tensor is then
compared as it is, and its shape makes the verdict "wrong".
"""

from __future__ import annotations

from typing import Any

import torch

LAMBDA_NAMES = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "lambda_init")


def band_to_keys(
    e: torch.Tensor, global_mask: torch.Tensor | None = None, real: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Longformer's eager ``[batch, heads, T, x + 2w + 1]`` weights as ``[batch, heads, T, T]``
    (``global_mask`` ``[batch, T]``, nonzero at the global tokens; ``real`` ``[batch, T]``, the
    query rows to hold to "no weight outside the sequence"). None where the width does not fit."""
    b, h, T, width = e.shape
    n_global = [] if global_mask is None else [int(g.nonzero().numel()) for g in global_mask.bool()]
    x = max(n_global, default=0)
    if (width - x) % 2 != 1:
        return None
    w = (width - x - 1) // 2
    out = e.new_zeros(b, h, T, T)
    for bi in range(b):
        for g, key in enumerate(global_mask[bi].bool().nonzero().flatten().tolist() if x else []):
            out[bi, :, :, key] += e[bi, :, :, g]
    rows = torch.ones(b, T, dtype=torch.bool) if real is None else real.bool()
    for j in range(2 * w + 1):
        col = e[:, :, :, x + j]
        for i in range(T):
            key = i - w + j
            if 0 <= key < T:
                out[:, :, i, key] += col[:, :, i]
            elif bool((col[:, :, i].abs() > 0)[rows[:, i]].any()):
                return None  # weight on a key outside the sequence: not this layout
    return out


def blocks_to_keys(e: torch.Tensor, T: int, real: torch.Tensor | None = None) -> torch.Tensor | None:
    """LongT5's eager local weights ``[batch, blocks, heads, n, 3n]`` as ``[batch, heads, T, T]``
    for the ``T`` input positions; None where the layout does not fit (or weight falls outside
    the sequence on a ``real`` query row)."""
    if e.dim() != 5 or e.shape[-1] != 3 * e.shape[-2]:
        return None
    b, nb, h, n, _ = e.shape
    if nb * n < T:
        return None
    rows = torch.ones(b, T, dtype=torch.bool) if real is None else real.bool()
    out = e.new_zeros(b, h, T, T)
    for i in range(nb):
        for a in range(n):
            q = i * n + a
            if q >= T:
                break
            first = (i - 1) * n  # the key of column 0
            lo, hi = max(0, -first), min(3 * n, T - first)
            out[:, :, q, first + lo : first + hi] = e[:, i, :, a, lo:hi]
            outside = torch.cat([e[:, i, :, a, :lo], e[:, i, :, a, hi:]], -1)
            if bool((outside.abs() > 0).any(-1).any(-1)[rows[:, q]].any()):
                return None
    return out


def differential_lambdas(model: Any) -> list[float]:
    """λ of every differential-attention module of ``model``, in module order (layer order):
    ``exp(Σ lambda_q1·lambda_k1) − exp(Σ lambda_q2·lambda_k2) + lambda_init``."""
    out = []
    with torch.no_grad():
        for m in model.modules():
            if all(hasattr(m, n) for n in LAMBDA_NAMES):
                one = (m.lambda_q1.double() * m.lambda_k1.double()).sum().exp()
                two = (m.lambda_q2.double() * m.lambda_k2.double()).sum().exp()
                out.append(float(one - two + float(m.lambda_init)))
    return out


def split_differential(e: torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager's ``[batch, 2H, q, k]`` softmaxes as the combined map ``[batch, H, q, k]`` and the
    parts ``[batch, H, 2, q, k]`` (``a1`` = heads ``0..H-1``, ``a2`` = heads ``H..2H-1``)."""
    a1, a2 = e.chunk(2, dim=1)
    return a1 - lam * a2, torch.stack([a1, a2], dim=2)


def prompt_length(model: Any) -> int:
    """The prompt positions CpmAnt runs ahead of the text and crops from its weights (0 if none)."""
    cfg = model.config
    return int(getattr(cfg, "prompt_length", 0) or 0) if cfg.model_type == "cpmant" else 0


def eager_in_probe_layout(model: Any, eager: dict, inputs: dict) -> dict:
    """``eager`` (``catalogue_check.eager_patterns``'s dict) with its self-attention maps in
    probe's layout: local layouts mapped to ``[query, key]``, differential softmaxes combined (and
    their parts under ``"parts"``). Tensors no mapping fits are left as they are."""
    ids = inputs.get("input_ids")
    T = ids.shape[1] if ids is not None else None
    real = inputs.get("attention_mask")
    try:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    except ValueError:  # several text configs (MusicGen-Melody's text encoder and decoder)
        cfg = model.config
    banded = getattr(cfg, "attention_window", None) is not None
    lams = differential_lambdas(model)
    if model.config.model_type == "squeezebert" and not eager["self"]:
        # SqueezeBERT's ``attentions`` are its scores before the softmax (mask added): the weights
        # are their softmax over the keys, as its attention module computes them
        eager = {**eager, "self": [t.softmax(-1) for t in eager["other"]], "other": []}
    if model.config.model_type == "lilt" and eager["self"]:
        eager = {**eager, "self": lilt_streams(model, eager["self"], inputs)}
    out, parts = [], []
    for t in eager["self"]:
        mapped = None
        if t.dim() == 5 and T is not None:
            mapped = blocks_to_keys(t, T, real)
        elif banded and t.dim() == 4 and t.shape[-1] != t.shape[-2]:
            mapped = band_to_keys(t, inputs.get("global_attention_mask"), real)
        elif lams and t.dim() == 4 and len(parts) < len(lams) and t.shape[1] % 2 == 0:
            mapped, p = split_differential(t, lams[len(parts)])
            parts.append(p)
        out.append(t if mapped is None else mapped)
    return {**eager, "self": out, "parts": parts}


def lilt_streams(model: Any, text: list[torch.Tensor], inputs: dict) -> list[torch.Tensor]:
    """LiLT's two softmaxes per layer in run order: the layout stream's, written here from the
    projections read by hooks (scores ``q·kᵀ/√d + lq·lkᵀ/√(d/r)`` plus the padding bias), then
    eager's ``text`` (the text stream's)."""
    seen: dict = {}
    hooks = []
    for i, ly in enumerate(model.encoder.layer):
        for name in ("query", "key", "layout_query", "layout_key"):
            hook = lambda m, a, o, i=i, name=name: seen.__setitem__((i, name), o)  # noqa: E731
            hooks.append(getattr(ly.attention.self, name).register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    H, r = model.config.num_attention_heads, model.config.channel_shrink_ratio
    d = model.config.hidden_size // H
    mask = inputs.get("attention_mask")
    out = []
    for i, t in enumerate(text):
        heads = [
            seen[(i, n)].unflatten(-1, (H, -1)).transpose(1, 2)
            for n in ("query", "key", "layout_query", "layout_key")
        ]
        q, k, lq, lk = (h.float() for h in heads)
        s = q @ k.transpose(-1, -2) / d**0.5 + lq @ lk.transpose(-1, -2) / (d // r) ** 0.5
        if mask is not None:
            s = s + (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        out += [s.softmax(-1), t]
    return out


def join_source_first(cache: Any, got: list) -> list:
    """``got`` (``catalogue_check.probe_patterns``) with each layer's self and cross parts joined
    back into the one softmax the model ran, ``[cross | self]`` over the keys, where the layer's
    metadata says the source's keys come first (DiffusionGemma's decoder)."""
    joined = {
        f"{m['stack']}[{m['layer']}]"
        for m in cache.metadata["layers"]
        if "the source's keys then" in m.get("merged_attention", "")
    }
    if not joined:
        return got
    parts = {label: p for label, _, p in got}
    out = []
    for label, kind, p in got:
        base = label.rsplit(".", 1)[0]
        if base not in joined:
            out.append((label, kind, p))
        elif kind == "self":
            out.append((f"{base}.joint", "self", torch.cat([parts[f"{base}.cross"], p], dim=-1)))
    return out


def global_local_hooks(twin: Any, store: list) -> list:
    """Forward hooks on Pegasus-X's encoder layers of ``twin`` that append ``(weights, stagger)``
    per call to ``store``: the attention module's own ``{"global", "local"}`` weights and the
    layer's ``stagger_blocks_this_layer``. Returns the hook handles (none for other models)."""
    hooks = []
    for m in twin.modules():
        attn = getattr(m, "self_attn", None)
        if hasattr(m, "stagger_blocks_this_layer") and hasattr(attn, "block_size"):
            stagger = bool(m.stagger_blocks_this_layer)
            hooks.append(attn.register_forward_hook(lambda _m, _i, o, s=stagger: store.append((o[2], s))))
    return hooks


def global_local_to_keys(probs: dict, stagger: bool, n: int, T: int) -> torch.Tensor:
    """Pegasus-X's block weights ``probs["local"]`` ``[b, h, blocks, n, G + n]`` as the tokens'
    ``[b, h, T, T]`` (zeros outside each block; the global tokens' columns left out)."""
    local = probs["local"].float()
    g = probs["global"].shape[-2]
    b, h, nb, _, _ = local.shape
    shift = n // 2 if stagger else 0
    out = local.new_zeros(b, h, T, T)
    for i in range(nb):
        for a in range(n):
            q = i * n + a - shift
            if not 0 <= q < T:
                continue
            for c in range(n):
                k = i * n + c - shift
                if 0 <= k < T:
                    out[:, :, q, k] = local[:, :, i, a, g + c]
    return out


def reformer_to_keys(e: torch.Tensor, before: int) -> torch.Tensor:
    """Reformer's eager local weights ``[b, h, n, c, m·c]`` as ``[b, h, n·c, n·c]``."""
    b, h, n, c, width = e.shape
    out = e.new_zeros(b, h, n * c, n * c)
    for i in range(n):
        for a in range(c):
            for j in range(width):
                out[:, :, i * c + a, ((i - before) * c + j) % (n * c)] += e[:, :, i, a, j]
    return out


def prophetnet_streams(model: Any, outputs: Any) -> dict | None:
    """ProphetNet's eager maps as ``eager_patterns``' dict (``self``: encoder layers, then per
    decoder layer the main stream and each predict stream; ``cross``), scores turned into
    weights; None for other models."""
    if model.config.model_type != "prophetnet":
        return None
    enc = [t.float().softmax(-1) for t in outputs.encoder_attentions]
    dec = []
    for main, ngram in zip(outputs.decoder_attentions, outputs.decoder_ngram_attentions, strict=True):
        dec += [main.float()] + [ngram[:, n].float() for n in range(ngram.shape[1])]
    cross = [t.float().softmax(-1) for t in outputs.cross_attentions]
    return {"self": enc + dec, "cross": cross, "other": []}


def lsh_hooks(twin: Any, store: list) -> list:
    """Hooks on Reformer's LSH attention modules of ``twin`` appending ``(module, buckets)`` per
    call to ``store``. Returns the handles (none for other models)."""
    return [
        m.register_forward_hook(lambda mod, _i, o: store.append((mod, o.buckets)))
        for m in twin.modules()
        if type(m).__name__ == "LSHSelfAttention"
    ]


def reformer_in_probe_layout(model: Any, eager: dict, lsh: list) -> dict:
    """Reformer's eager 5-d maps as ``[b, h, T, T]``: local layers by the rolled chunks, LSH
    layers through the sorted positions of the ``lsh`` hooks' buckets (in call order)."""
    if model.config.model_type != "reformer":
        return eager
    kinds = model.config.attn_layers
    out, calls = [], iter(lsh)
    for i, t in enumerate(eager["self"]):
        if t.dim() != 5:
            out.append(t)
        elif kinds[i % len(kinds)] == "local":
            out.append(reformer_to_keys(t, model.config.local_num_chunks_before))
        else:
            module, buckets = next(calls)
            out.append(lsh_to_keys(t, module, buckets) if module.num_hashes == 1 else t)
    return {**eager, "self": out}


def lsh_to_keys(e: torch.Tensor, module: Any, buckets: torch.Tensor) -> torch.Tensor:
    """One hash round's eager LSH weights ``[b, h, n, c, m·c]`` as ``[b, h, T, T]``."""
    b, h, n, c, width = e.shape
    T = n * c
    order, _ = module._get_sorted_bucket_idx_and_undo_sorted_bucket_idx(T, buckets.reshape(b, h, -1), 1)
    before = module.num_chunks_before
    out = e.new_zeros(b, h, T, T)
    for bi in range(b):
        for hi in range(h):
            pos = order[bi, hi] % T
            for s in range(T):
                i, a = divmod(s, c)
                for j in range(width):
                    key_s = ((i - before) * c + j) % T
                    out[bi, hi, pos[s], pos[key_s]] += e[bi, hi, i, a, j]
    return out


def split_compressed(model: Any, eager: dict) -> dict:
    """DeepSeek-V4's eager self maps cut at their query length (no KV cache: the positions are the
    queries'): the positions' part under ``self``, the summaries' under ``compressed``."""
    if model.config.model_type not in ("deepseek_v4",):
        return eager
    cut = [(t[..., : t.shape[-2]], t[..., t.shape[-2] :]) for t in eager["self"]]
    return {**eager, "self": [a for a, _ in cut], "compressed": [b for _, b in cut]}


def window_hooks(twin: Any, store: list) -> list:
    """Forward hooks on Swin-style layers of ``twin`` (modules with ``shift_size``, ``window_size``
    and a forward taking ``input_dimensions``) that append each call's ``(shift, window, height, width)``,
    read after the call (the layer sets its shift and window from the grid it is given)."""

    def hook(m, args, kwargs, _out):
        dims = kwargs.get("input_dimensions", args[1] if len(args) > 1 else None)
        if dims is not None:
            store.append((int(m.shift_size), int(m.window_size), int(dims[0]), int(dims[1])))

    import inspect

    def swin_layer(m: Any) -> bool:
        if not (hasattr(m, "shift_size") and hasattr(m, "window_size")):
            return False
        return "input_dimensions" in inspect.signature(m.forward).parameters

    return [m.register_forward_hook(hook, with_kwargs=True) for m in twin.modules() if swin_layer(m)]


def windows_to_grid(t: torch.Tensor, shift: int, ws: int, H: int, W: int) -> torch.Tensor | None:
    """Swin's eager ``[batch·windows, heads, ws², ws²]`` weights as ``[batch, heads, H·W, H·W]`` over
    the patch grid (Swin's definition: the grid padded to whole windows, rolled by ``-shift`` on
    both axes, cut into windows row by row; window position ``(r, c)`` of window ``(a, b)`` is rolled
    position ``(a·ws + r, b·ws + c)``, grid position ``((y + shift) mod Hp, (x + shift) mod Wp)``;
    padding positions left out). None where the shape does not fit."""
    Hp, Wp = -(-H // ws) * ws, -(-W // ws) * ws
    nW = (Hp // ws) * (Wp // ws)
    if t.dim() != 4 or t.shape[0] % nW or t.shape[-1] != ws * ws or t.shape[-2] != ws * ws:
        return None
    B, h = t.shape[0] // nW, t.shape[1]
    tw = t.reshape(B, nW, h, ws * ws, ws * ws)
    out = t.new_zeros(B, h, H * W, H * W)
    r = torch.arange(ws * ws)
    for w in range(nW):
        a, b = divmod(w, Wp // ws)
        y = (a * ws + r // ws + shift) % Hp
        x = (b * ws + r % ws + shift) % Wp
        keep = (y < H) & (x < W)
        q = (y * W + x)[keep]
        out[:, :, q[:, None], q[None, :]] = tw[:, w][:, :, keep][:, :, :, keep]
    return out


def windows_in_grid(
    ts: list[torch.Tensor], calls: list, batch: int, last_of_grid: bool = False
) -> list[torch.Tensor]:
    """``ts`` (one windowed tensor per Swin layer call, in call order; or, with ``last_of_grid``, one
    per stage, the stage's last call, as eager's ``output_attentions`` returns them) mapped to the
    grid by :func:`windows_to_grid` (``batch`` pictures); ``ts`` unchanged where they do not pair
    with ``calls``."""
    if not calls or not ts:
        return ts

    def windows(c: tuple) -> int:
        _, ws, H, W = c
        return batch * (-(-H // ws)) * (-(-W // ws))

    if last_of_grid:
        last = list({(c[2], c[3]): c for c in calls}.values())  # each grid's last call
        pairs = []
        for t in ts:
            match = [c for c in last if t.shape[0] == windows(c) and t.shape[-1] == c[1] ** 2]
            pairs.append(match[0] if len(match) == 1 else None)
    elif len(ts) == len(calls):
        pairs = list(calls)
    else:
        return ts
    out = []
    for t, c in zip(ts, pairs, strict=True):
        mapped = windows_to_grid(t, *c) if c is not None else None
        out.append(t if mapped is None else mapped)
    return out
