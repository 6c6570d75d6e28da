"""Checks one tiny model the way a new user would: random ids with a padded row, probe on the
default attention implementation, every stored pattern against eager ``output_attentions`` with
the same weights and, where eager returns nothing or differs, against a softmax of the arguments
the model hands to ``scaled_dot_product_attention``.

``check_model(model)`` returns a dict: ``status`` (one of :data:`STATUSES`), ``reason``,
``eager_diff`` / ``sdpa_diff`` (max |probe − oracle| over the real query rows; None when that
oracle was not comparable), ``pad_diff`` (the same over the padded rows), ``n_probe``,
``n_eager``, ``n_sdpa`` (pattern counts) and ``oracle`` (which oracle made it exact).
"""

from __future__ import annotations

import inspect
import traceback
from typing import Any

import catalogue_layouts as L
import catalogue_oracles as O
import torch
from catalogue_oracles import SEED, eager_twin, run_sdpa_oracle, sdpa_spy  # noqa: F401 - used here and by tests

import probe
from probe.errors import ProbeError

TOL = 1e-5
STATUSES = (
    "exact",
    "wrong",
    "crash",
    "refused",
    "no softmax attention",
    "cannot run",
    "run failed",
    "build failed",
)
_NOT_TEXT = (
    "pixel_values",
    "input_features",
    "input_values",
    "takes no input_ids",
    "required positional argument",
    "image",
    "audio",
    "speech",
    "video",
    "past_values",
    "inputs_embeds",
    "specify either",
)


_OTHER_INPUTS = ("pixel_values", "input_features", "input_values", "pixel_values_videos", "past_values")


def run_failure(e: BaseException, model: Any = None, inputs: dict | None = None) -> dict[str, str]:
    """A forward that fails without probe: ``cannot run`` when it asks for inputs other than those
    given (its message names them, or the forward takes them and fails on their absence); ``run
    failed`` otherwise (the shrunk config or the inputs made from it do not suit the model)."""
    msg = f"{type(e).__name__}: {str(e)[:300]}"
    params = inspect.signature(model.forward).parameters if model is not None else {}
    given = set(inputs or ())
    wants = [p for p in _OTHER_INPUTS if p in params and p not in given]
    words = [w for w in _NOT_TEXT if not ("pixel_values" in given and w in ("pixel_values", "image"))]
    if any(w in msg.lower() for w in words):
        return {"status": "cannot run", "reason": msg}
    if wants and "NoneType" in msg:
        return {"status": "cannot run", "reason": f"needs {wants[0]} ({msg})"}
    return {"status": "run failed", "reason": msg}


BATCH, T, T_DEC = 2, 8, 6
_TEXT_KEYS = {"input_ids", "attention_mask", "decoder_input_ids"}


def make_inputs(model: Any, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random ids ``[2, 8]`` (row 1 padded after 5 tokens) and, for encoder-decoders, decoder ids."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    vocab = getattr(cfg, "vocab_size", None) or getattr(cfg.get_text_config(), "vocab_size", None) or 256
    hi = max(8, min(int(vocab), 512))
    ids = torch.randint(4, hi, (BATCH, T), generator=g)
    mask = torch.ones(BATCH, T, dtype=torch.long)
    mask[1, 5:] = 0
    params = inspect.signature(model.forward).parameters
    out = {"input_ids": ids}
    if "attention_mask" in params:
        out["attention_mask"] = mask
    if "decoder_input_ids" in params:
        out["decoder_input_ids"] = torch.randint(4, hi, (BATCH, T_DEC), generator=g)
    return out


def probe_patterns(cache: Any) -> list[tuple[str, str, torch.Tensor]]:
    """``(label, kind, pattern)`` in the cache's order: stacks, layers, attentions of each layer."""
    out = []
    for stack in cache.stacks:
        for layer in cache.layer_indices(stack):
            for kind, index in cache.attentions(stack, layer):
                label = f"{stack}[{layer}].{kind}" + ("" if index is None else f".{index}")
                out.append((label, kind, cache.pattern(stack, layer, kind, index=index).float()))
    return out


def eager_patterns(outputs: Any) -> dict[str, list[torch.Tensor]]:
    """The weights eager returns (``[b, h, q, k]`` or the model's own layout), by kind: self
    (encoder then decoder) and cross."""

    def pick(*names, obj=outputs, depth=0):
        found = []
        for n in names:
            v = obj.get(n) if hasattr(obj, "get") else getattr(obj, n, None)
            if isinstance(v, (tuple, list)):
                # every tensor, whatever its layout: a local-attention block layout (LongT5's 5-d
                # blocks) must count, or an encoder that probe and the filter both skip looks exact
                found += [t.float() for t in v if isinstance(t, torch.Tensor)]
                # pairs per layer (BridgeTower's cross-modal layers: the text's and the image's)
                found += [
                    t.float()
                    for u in v
                    if isinstance(u, (tuple, list))
                    for t in u
                    if isinstance(t, torch.Tensor)
                ]
        if not found and depth < 2 and hasattr(obj, "values"):  # nested outputs (FLAVA's text_output)
            for v in obj.values():
                if hasattr(v, "values") and not isinstance(v, torch.Tensor):
                    found += pick(*names, obj=v, depth=depth + 1)
        return found

    out = {
        "self": pick("encoder_attentions", "attentions", "decoder_attentions"),
        "cross": pick("cross_attentions"),
    }
    # a map with negative weights or rows summing past 1 is no softmax (MiniMax's linear-attention
    # layers return q·kᵀ with decay): set aside, counted under "other"; rows summing to less than
    # 1 stay (a softmax with a sink column dropped, as in GPT-OSS)
    out["other"] = [t for k in ("self", "cross") for t in out[k] if not is_distribution(t)]
    for k in ("self", "cross"):
        out[k] = [t for t in out[k] if is_distribution(t)]
    return out


def is_distribution(t: torch.Tensor, tol: float = 1e-3) -> bool:
    """Whether ``t``'s last axis holds non-negative weights summing to at most 1 (any layout)."""
    if not t.numel() or not torch.isfinite(t).all():
        return True  # nothing to judge; NaN rows are left for the comparison to show
    # a huge negative is a mask value left in a padded row (ProphetNet), not a weight
    neg = t[(t < -1e-6) & (t > -1e30)]
    return bool(neg.numel() == 0 and t.clamp(min=0).sum(-1).max() <= 1 + tol)


def _run_order(
    got: list[torch.Tensor], want: list[torch.Tensor], mask: torch.Tensor | None
) -> list[torch.Tensor] | None:
    """``want`` reordered so that each stored pattern meets its own, where the cache's order (stack
    by stack) is not the run order eager returns (HRM alternates two looped stacks): each stored
    pattern is paired with a distinct oracle pattern of the same shape that equals it on the real
    rows to 1e-5. None where the given order already pairs them or no such pairing exists."""

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return _real_diff(a, b, mask) <= 1e-5

    same = all(a.shape == b.shape for a, b in zip(got, want, strict=True))
    if same and all(close(a, b) for a, b in zip(got, want, strict=True)):
        return None
    free, out = list(range(len(want))), []
    for a in got:
        j = next((j for j in free if want[j].shape == a.shape and close(a, want[j])), None)
        if j is None:
            return None
        free.remove(j)
        out.append(want[j])
    return out


def _real_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None) -> float:
    """max |a - b| over the real query rows (every row where the mask does not fit)."""
    d = (torch.nan_to_num(a, nan=-1.0) - torch.nan_to_num(b, nan=-1.0)).abs()
    if mask is not None and d.shape[0] == mask.shape[0] and d.shape[2] == mask.shape[1]:
        d = d[mask.bool()[:, None, :, None].expand_as(d)]
    return float(d.max()) if d.numel() else 0.0


def eager_subset(
    got: list[torch.Tensor], want: list[torch.Tensor], mask: torch.Tensor | None
) -> list[torch.Tensor] | None:
    """Where eager returns fewer patterns than probe stores (MusicGen-Melody's text encoder, the
    stacks of BLT, DiffusionGemma's encoder return none): for each eager pattern, the distinct
    stored pattern of its shape closest to it, in eager's order; None where one has no partner."""
    free, out = list(range(len(got))), []
    for w in want:
        cands = [i for i in free if got[i].shape == w.shape]
        if not cands:
            return None
        best = min(cands, key=lambda i: _real_diff(got[i], w, mask))
        free.remove(best)
        out.append(got[best])
    return out


def diff(
    got: list[torch.Tensor], want: list[torch.Tensor], mask: torch.Tensor | None
) -> tuple[float, float] | str:
    """Max |got − want| over real query rows and over padded query rows, or why not comparable."""
    if len(got) != len(want):
        return f"{len(got)} patterns stored, oracle has {len(want)}"
    matched = _run_order(got, want, mask)
    if matched is not None:
        want = matched
    real = pad = 0.0
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a.shape != b.shape:
            return f"pattern {i}: shape {tuple(a.shape)} vs oracle {tuple(b.shape)}"
        d = (torch.nan_to_num(a, nan=-1.0) - torch.nan_to_num(b, nan=-1.0)).abs()
        if mask is not None and d.shape[0] == mask.shape[0] and d.shape[2] == mask.shape[1]:
            rows = mask.bool()[:, None, :, None].expand_as(d)
            real = max(real, float(d[rows].max()) if rows.any() else 0.0)
            pad = max(pad, float(d[~rows].max()) if (~rows).any() else 0.0)
        else:
            real = max(real, float(d.max()) if d.numel() else 0.0)
    return real, pad


def trace_and_eager(model: Any, inputs: dict, hooks: Any = ()) -> tuple[Any, Any]:
    """``(cache, outputs)``: probe's trace of one forward of ``model`` on ``inputs``, with the forward
    hooks ``hooks`` (``(module, fn)`` pairs) installed for that forward only, and the outputs of
    :func:`eager_twin` with ``output_attentions=True`` (the oracle)."""
    handles = [m.register_forward_hook(fn) for m, fn in hooks]
    try:
        with torch.no_grad(), probe.trace(model) as t:
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        want = eager_twin(model)(**inputs, output_attentions=True)
    return t.cache, want


def _capture(model: Any, inputs: dict) -> tuple[Any, dict]:
    """probe's capture of one forward; (cache, None) or (None, the failure as a result dict). Token
    ids are run under ``probe.trace``; inputs with pixels through ``probe.capture(model, inputs)``
    (keyword inputs, whose positions probe names from the pixels)."""
    try:
        torch.manual_seed(SEED)
        if "input_ids" in inputs and len(inputs.keys() - _TEXT_KEYS) == 0:
            with torch.no_grad(), probe.trace(model) as t:
                model(**inputs)
            return t.cache, {}
        return probe.capture(model, dict(inputs)), {}
    except ProbeError as e:
        return None, {"status": "refused", "reason": str(e).splitlines()[0][:400]}
    except Exception as e:  # noqa: BLE001 - every other exception is a crash to report
        tb = traceback.extract_tb(e.__traceback__)
        where = next(
            (
                f"{f.filename.split('/probe/')[-1]}:{f.lineno}"
                for f in reversed(tb)
                if "/probe/" in f.filename
            ),
            "",
        )
        return None, {"status": "crash", "reason": f"{type(e).__name__}: {str(e)[:300]} {where}".strip()}


def check_model(model: Any, inputs: dict | None = None) -> dict[str, Any]:
    """Capture ``model`` with probe and compare every stored pattern with the oracles."""
    inputs = inputs or make_inputs(model)
    res: dict[str, Any] = {"impl": getattr(model.config, "_attn_implementation", None)}
    try:
        sdpa = run_sdpa_oracle(model, inputs)
    except Exception as e:  # noqa: BLE001
        return {**res, **run_failure(e, model, inputs)}
    cache, failed = _capture(model, inputs)
    blocks: list = []  # Pegasus-X's encoder weights, which eager's outputs leave out
    mha: list = []  # nn.MultiheadAttention's weights (SigLIP's pooling head), read by a hook
    softmaxes: list = []  # every softmax of the eager forward, for the union check
    windows: list = []  # Swin's layer calls (shift, window, grid), to map its windows to the grid
    try:
        twin = eager_twin(model)
        lsh: list = []  # Reformer's LSH buckets, to map its hash-sorted weights back
        hooks = L.global_local_hooks(twin, blocks) + L.lsh_hooks(twin, lsh) + O.mha_hooks(twin, mha)
        hooks += L.window_hooks(twin, windows)
        try:
            with torch.no_grad(), O.softmax_spy(softmaxes):
                torch.manual_seed(SEED)
                outputs = twin(**inputs, output_attentions=True)
            eager = L.prophetnet_streams(model, outputs) or eager_patterns(outputs)
            eager = L.split_compressed(model, L.reformer_in_probe_layout(model, eager, lsh))
        finally:
            for h in hooks:
                h.remove()
        if blocks:
            n, T = model.config.block_size, inputs["input_ids"].shape[1]
            enc = [L.global_local_to_keys(p, s, n, T) for p, s in blocks]
            eager = {**eager, "self": enc + eager["self"]}
    except Exception as e:  # noqa: BLE001
        eager, res["eager_error"] = (
            {"self": [], "cross": [], "other": []},
            f"{type(e).__name__}: {str(e)[:200]}",
        )
        softmaxes[:], windows[:] = O.eager_softmaxes(model, inputs)  # MaskFormer-Swin: fails on the flag only
    eager = L.eager_in_probe_layout(model, eager, inputs)
    if windows:  # Swin: eager returns each stage's last layer, SDPA every call, per window
        n = int(inputs["pixel_values"].shape[0]) if "pixel_values" in inputs else 1
        eager = {**eager, "self": L.windows_in_grid(eager["self"], windows, n, last_of_grid=True)}
        sdpa = L.windows_in_grid(sdpa, windows, n)
        softmaxes = L.windows_in_grid(softmaxes, windows, n)
    n_eager = len(eager["self"]) + len(eager["cross"])
    res.update(n_eager=n_eager, n_sdpa=len(sdpa))
    if eager.get("other"):
        res["eager_other"] = f"{len(eager['other'])} eager map(s) that are no softmax (negative or rows > 1)"
    if cache is None:
        if failed["status"] == "refused" and "no attention" in failed["reason"] and not n_eager and not sdpa:
            failed["status"] = "no softmax attention"
        return {**res, **failed}
    got = L.join_source_first(cache, probe_patterns(cache))
    prompt = L.prompt_length(model)
    if prompt:  # CpmAnt: eager crops its prompt positions, so compare probe's text block
        got = [(label, kind, p[..., prompt:, prompt:]) for label, kind, p in got]
    res["n_probe"] = len(got)
    if not got and not n_eager and not sdpa:
        return {**res, "status": "no softmax attention", "reason": "no pattern stored, none in eager or SDPA"}
    mask = inputs.get("attention_mask")
    by_kind = [[p for _, k, p in got if k == kind] for kind in ("self", "cross")]
    e = (
        diff(by_kind[0] + by_kind[1], eager["self"] + eager["cross"], mask)
        if n_eager
        else "eager returns none"
    )
    if eager["parts"] and isinstance(e, tuple):  # differential attention: its two softmaxes too
        parts = [cache[k].float().flatten(1, 2) for k in cache.keys() if k.endswith("attn.parts")]
        e = _worse(e, diff(parts, [p.flatten(1, 2) for p in eager["parts"]], mask))
    if eager.get("compressed") and isinstance(e, tuple):  # DeepSeek-V4: the summaries' weights too
        comp = [cache[k].float() for k in cache.keys() if k.endswith("attn.compressed")]
        e = _worse(e, diff(comp, eager["compressed"], mask))
    s = diff([p for _, _, p in got], sdpa, mask) if sdpa else "no SDPA call"
    subset = False
    if isinstance(e, str) and n_eager and len(got) > n_eager and isinstance(s, tuple):
        # eager returns some of the stored patterns: those against eager, all against SDPA
        flat = by_kind[0] + by_kind[1]
        chosen = eager_subset(flat, eager["self"] + eager["cross"], mask)
        if chosen is not None:
            e, subset = diff(chosen, eager["self"] + eager["cross"], mask), True
            res["eager_subset"] = f"eager returns {n_eager} of the {len(got)} stored patterns"
    res["eager_diff"], res["sdpa_diff"] = _num(e), _num(s)
    res["pad_diff"] = max([x[1] for x in (e, s) if isinstance(x, tuple)], default=None)
    why = _why(e, s) + (f"; {res['eager_other']}" if "eager_other" in res else "")
    if subset:
        # eager computes something else than the SDPA path probe ran (Seamless M4T v2's speech
        # encoder; the models' outputs differ too): SDPA, which sees every stored pattern, decides,
        # as for the whole-count comparison below
        exact = isinstance(s, tuple) and s[0] <= TOL
        why += f"; {res['eager_subset']}, every one against SDPA"
        if exact and not (isinstance(e, tuple) and e[0] <= TOL):
            why += " (eager differs: SDPA decides)"
        return {**res, "status": "exact" if exact else "wrong", "oracle": "eager+sdpa", "reason": why}
    if isinstance(e, tuple) and e[0] <= TOL:
        return {**res, "status": "exact", "oracle": "eager", "reason": why}
    if (isinstance(e, tuple) or not n_eager) and isinstance(s, tuple) and s[0] <= TOL:
        # eager computes something else (Falcon's ALiBi order) or returns nothing: SDPA decides
        return {**res, "status": "exact", "oracle": "sdpa", "reason": why}
    if n_eager and not sdpa:  # WavLM: eager averages the heads; the softmaxes hold each head
        close = lambda a, b: _real_diff(a, b, mask) <= TOL  # noqa: E731
        flat = by_kind[0] + by_kind[1]
        averaged = O.head_averaged(flat, eager["self"] + eager["cross"], softmaxes, close)
        if averaged is not None:
            ok, note = averaged
            res["eager_diff"] = None  # eager's weights are head means: the note says what was compared
            why = _why("its weights are head means", s)
            return {
                **res,
                "status": "exact" if ok else "wrong",
                "oracle": "eager mean",
                "reason": f"{why}; {note}",
            }
    if mha or n_eager or sdpa or softmaxes:
        # eager, SDPA and MultiheadAttention each see a part (a vision-language model's eager outputs
        # hold its language model only): exact where they and the stored patterns cover each other
        flat = [p for _, _, p in got]
        sdpa = O.join_chunks(sdpa, flat)  # a packed vision tower's per-picture calls, block-diagonal
        softmaxes = O.join_chunks(softmaxes, flat)
        oracles = {"eager": eager["self"] + eager["cross"], "sdpa": sdpa, "MultiheadAttention": mha}
        close = lambda a, b: _real_diff(a, b, mask) <= TOL  # noqa: E731
        ok, union = O.union_check(flat, oracles, close, {"eager softmax": softmaxes})
        if not ok and sdpa and n_eager:
            # eager computes something else than the SDPA path probe ran (Phi-4's vision tower): SDPA
            # decides, as for the whole-count comparison above
            own, own_mha = O.model_softmaxes(model, inputs)
            only = {"sdpa": sdpa, "MultiheadAttention": own_mha}  # the model's own, not the twin's
            cover = {"eager softmax": softmaxes, "model softmax": O.join_chunks(own, flat)}
            ok, alone = O.union_check(flat, only, close, cover)
            union = f"{alone} (eager differs: {union})" if ok else union
        res["n_mha"] = len(mha)
        if ok:
            return {**res, "status": "exact", "oracle": "union", "reason": f"{why}; {union}"}
        why += f"; union: {union}"
    # eager's count or shapes disagree: an omission or a different layout, whatever SDPA says
    return {**res, "status": "wrong", "reason": why}


def _worse(a: tuple[float, float], b: tuple[float, float] | str) -> tuple[float, float] | str:
    """The larger of two ``diff`` results, or ``b``'s reason when it was not comparable."""
    return b if isinstance(b, str) else (max(a[0], b[0]), max(a[1], b[1]))


def _num(d: Any) -> float | None:
    return d[0] if isinstance(d, tuple) else None


def _why(e: Any, s: Any) -> str:
    part = lambda n, d: f"{n}: {d if isinstance(d, str) else f'max diff {d[0]:.2e}'}"  # noqa: E731
    return "; ".join((part("eager", e), part("sdpa", s)))
