"""The one door through which analyses run a model.

Analyses read caches and never import :mod:`probe.capture`; the few that must call the model
(the functional causal checks, the logit lens) do it through this module only, so the data flow
stays one-way and this stays the single place to look when a model call misbehaves.

* :func:`prepare` turns texts into the forward call ``probe.capture`` would make (same tokenizer
  adapter, padding and position ids), returning a :class:`Prepared` with ``.run()`` and ``.meta``.
* :func:`capture` is ``probe.capture`` itself.
* :func:`run` runs the model once on inputs, exactly as capture would, and returns its outputs.
* :func:`stream_attention` runs the model once and hands every attention pattern to a reader a
  block of query rows at a time, never whole (the focus statistics of ``head_stats(model, ...)``);
  :func:`capture_stats` does the same and writes a ``keep="stats"`` cache of what the readers
  computed (``parse_keep`` reads ``keep=``).
* :func:`run_recorded` does the same while recording the inputs and outputs of chosen submodules
  (and, optionally, capturing the cache of that very forward): the logit lens finds the model's
  final norm and unembedding this way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from probe.capture.calls import past_length
from probe.capture.consumers.kept import parse_keep
from probe.capture.engine.stats import capture_stats
from probe.capture.engine.streamed import stream_attention
from probe.capture.engine.trace import Trace, capture, trace
from probe.capture.inputs.prepared import Prepared, is_hf_model, model_name
from probe.capture.inputs.prepared import accepts as takes
from probe.capture.inputs.route import prepare
from probe.capture.inputs.tokenizers import adapt as adapt_tokenizer


def run(model: nn.Module, inputs: Any, *, tokenizer: Any = None, target: Any = None) -> tuple[Any, dict]:
    """Run ``model`` once on ``inputs`` the way :func:`probe.capture` would, without capturing.

    Returns ``(outputs, meta)``: the model's own return value and the input metadata (texts,
    tokens, ids, attention mask) that a cache of the same call would hold.
    """
    prepared = prepare(model, inputs, tokenizer=tokenizer, target=target)
    with torch.no_grad():
        out = prepared.run()
    return out, prepared.meta


__all__ = [
    "Prepared",
    "prepare",
    "capture",
    "trace",
    "run",
    "is_hf_model",
    "model_name",
    "adapt_tokenizer",
    "stream_attention",
    "capture_stats",
    "parse_keep",
]


# -- calls for the functional causal checks ------------------------------------------------------
# Small named entries so an analysis can run a model on ids it built itself (perturbed, padded,
# split for a KV cache) without importing probe.capture.


def accepts(model: nn.Module, name: str) -> bool:
    """Whether ``model.forward`` takes an argument called ``name``."""
    return takes(model, name)


def outputs_of(out: Any) -> torch.Tensor:
    """The per-position output of a model call: ``.logits``, else the first tensor it returned."""
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return o
    if isinstance(out, dict):
        for v in out.values():
            if isinstance(v, torch.Tensor):
                return v
    raise TypeError(f"cannot find an output tensor in {type(out).__name__}")


def has_outputs(out: Any) -> bool:
    """Whether :func:`outputs_of` finds a per-position output tensor in ``out``."""
    try:
        outputs_of(out)
    except TypeError:
        return False
    return True


def call(
    model: nn.Module,
    x: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    encoder_ids: torch.Tensor | None = None,
    past_key_values: Any = None,
    use_cache: bool = False,
) -> Any:
    """Call ``model`` on ids (or float inputs) ``x`` [batch, pos] the way :func:`prepare` would.

    ``attention_mask`` (1 = real token) is passed where the model takes it, with position ids
    counted over real tokens when there is left padding; ``encoder_ids`` makes ``x`` the decoder
    input of an encoder-decoder; ``past_key_values`` (a KV cache, as :func:`kv_cache_of` returns
    it) and ``use_cache`` drive incremental decoding: the cache is passed under the name the
    model's forward takes (:func:`kv_cache_arg`). Returns the model's own output.
    """
    hf = is_hf_model(model)
    kwargs: dict[str, Any] = {}
    if encoder_ids is not None:
        if hf:
            return model(input_ids=encoder_ids, decoder_input_ids=x, use_cache=False)
        return model(encoder_ids, x)
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
        if accepts(model, "position_ids") and bool((attention_mask[:, 0] == 0).any()):
            kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if past_key_values is not None:
        name = kv_cache_arg(model)
        if name is None:
            names = " or ".join(KV_CACHE_ARGS)
            raise TypeError(f"{model_name(model)} takes no KV cache (no {names} argument)")
        kwargs[name] = past_key_values
        if "position_ids" not in kwargs and accepts(model, "position_ids"):
            n = past_length(past_key_values)
            pos = torch.arange(n, n + x.shape[1], device=x.device)
            kwargs["position_ids"] = pos.unsqueeze(0).expand(x.shape[0], -1)
    if accepts(model, "use_cache"):
        kwargs["use_cache"] = use_cache
    if hf:
        return model(input_ids=x, **kwargs)
    return model(x, **kwargs)


# The names a forward takes its KV cache under, newest first: transformers renamed
# ``past_key_values`` to ``cache`` in 5.24 (the old name is a deprecated alias there, and gone
# from the signature); older releases and most hand-written decoders use ``past_key_values``.
KV_CACHE_ARGS = ("cache", "past_key_values")


def kv_cache_arg(model: nn.Module) -> str | None:
    """The argument name under which ``model.forward`` takes a KV cache (one of
    :data:`KV_CACHE_ARGS`), or None when it takes none.

    A transformers model's ``cache`` is only a KV cache where the model can also be asked for
    one (``use_cache``); for any model the name must be an explicit parameter of ``forward``."""
    if not accepts(model, "use_cache"):
        return None
    return next((name for name in KV_CACHE_ARGS if accepts(model, name)), None)


def kv_cache_of(out: Any) -> Any:
    """The KV cache a model call returned (``out.cache`` in transformers >= 5.24, else
    ``out.past_key_values``; either key of a dict), or None when it returned none."""
    for name in KV_CACHE_ARGS:
        if isinstance(out, dict):
            # a transformers ModelOutput is a dict whose ``past_key_values`` key is a deprecated
            # alias of ``cache`` (it logs a warning): read the real key only
            if name in dict.keys(out):
                return dict.__getitem__(out, name)
            continue
        got = getattr(out, name, None)
        if got is not None:
            return got
    return None


def supports_kv_cache(model: nn.Module) -> bool:
    """Whether ``model`` takes a KV cache and ``use_cache`` (:func:`kv_cache_arg` is not None)."""
    return kv_cache_arg(model) is not None


def input_gradient(
    model: nn.Module,
    x: torch.Tensor,
    weights: torch.Tensor,
    *,
    encoder_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``d(sum(weights * output)) / d(input embedding)``: one forward and one backward.

    ``x`` is ids [batch, pos] (the gradient is taken at the output of the embedding that reads
    them) or float inputs [batch, pos, d] (taken at the inputs). ``weights`` has the output's
    shape. Returns the gradient [batch, pos, d]; parameters' ``.grad`` are left untouched.
    """
    leaf: dict[str, torch.Tensor] = {}
    handles = []
    if x.is_floating_point():
        x = x.detach().clone().requires_grad_(True)
        leaf["x"] = x
    else:

        def hook(module, args, out):
            inp = args[0] if args else None
            if "x" in leaf or not isinstance(inp, torch.Tensor) or inp.shape != x.shape:
                return None
            if not torch.equal(inp, x):
                return None
            out = out.detach().requires_grad_(True)
            leaf["x"] = out
            return out

        handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Embedding)]
    try:
        with torch.enable_grad():
            out = outputs_of(call(model, x, encoder_ids=encoder_ids))
            if "x" not in leaf:
                raise RuntimeError("no nn.Embedding of this model reads the input ids")
            loss = (out.float() * weights.to(out.device, torch.float32)).sum()
            (grad,) = torch.autograd.grad(loss, [leaf["x"]], allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    if grad is None:
        return torch.zeros_like(leaf["x"])
    return grad.detach()


def reading_embedding(model: nn.Module, x: torch.Tensor, **kwargs: Any) -> nn.Embedding | None:
    """The ``nn.Embedding`` that reads the ids ``x`` when ``model`` runs on them (one forward), or None."""
    found: list[nn.Embedding] = []

    def hook(module, args):
        if not found and args and isinstance(args[0], torch.Tensor) and args[0].shape == x.shape:
            if torch.equal(args[0], x):
                found.append(module)

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, nn.Embedding)]
    try:
        with torch.no_grad():
            call(model, x, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


class _FutureZeroed(torch.overrides.TorchFunctionMode):
    """Zero (without renormalising) the future part of every square softmax over the last dim."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax):
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(out, torch.Tensor) and out.dim() >= 3 and dim in (-1, out.dim() - 1):
                q, k = out.shape[-2], out.shape[-1]
                if q == k:
                    keep = torch.ones(q, k, dtype=torch.bool, device=out.device).tril()
                    out = out.masked_fill(~keep, 0.0)  # the mode is off inside its own handler
        return out


def run_future_zeroed(model: nn.Module, x: torch.Tensor, **kwargs: Any) -> Any:
    """:func:`call`, with the future half of every softmax-computed pattern set to zero afterwards.

    Equal outputs with and without this mean the model never used the future weights its
    softmax produced (a mask applied after the softmax).
    """
    with torch.no_grad(), _FutureZeroed():
        return call(model, x, **kwargs)


def other_backend(model: nn.Module) -> tuple[str, str, nn.Module] | None:
    """For a transformers model on SDPA or eager: ``(current, other, copy on the other)``, else None."""
    if not is_hf_model(model):
        return None
    current = getattr(model.config, "_attn_implementation", None)
    if current not in ("sdpa", "eager"):
        return None
    other = "eager" if current == "sdpa" else "sdpa"
    import copy

    twin = copy.deepcopy(model)
    try:
        twin.set_attn_implementation(other)
    except Exception:  # the model does not offer the other backend
        return None
    return current, other, twin.eval()


__all__ += [
    "accepts",
    "outputs_of",
    "has_outputs",
    "call",
    "supports_kv_cache",
    "kv_cache_arg",
    "kv_cache_of",
    "KV_CACHE_ARGS",
    "input_gradient",
    "run_future_zeroed",
    "reading_embedding",
    "other_backend",
]


@dataclass
class Call:
    """One call of a recorded submodule: its first positional input and its (first) output."""

    name: str
    module: nn.Module
    input: Any
    output: Any
    order: int


@dataclass
class Recorded:
    """What :func:`run_recorded` saw: the model's outputs, input metadata, calls and the cache."""

    outputs: Any
    meta: dict
    calls: list[Call] = field(default_factory=list)
    cache: Any = None


def _first(x: Any) -> Any:
    if isinstance(x, (tuple, list)) and x:
        return x[0]
    return x


def run_recorded(
    model: nn.Module,
    inputs: Any,
    *,
    tokenizer: Any = None,
    target: Any = None,
    record: Callable[[str, nn.Module], bool] = lambda name, m: True,
    capture_cache: bool = False,
) -> Recorded:
    """Run ``model`` once on ``inputs`` (as :func:`run`), recording every call of the submodules
    ``record(name, module)`` selects, in call order; with ``capture_cache`` that same forward is
    also captured (``Recorded.cache``). Hooks are removed afterwards; outputs are unchanged.
    """
    prepared = prepare(model, inputs, tokenizer=tokenizer, target=target)
    calls: list[Call] = []
    handles = []
    for name, m in model.named_modules():
        if not record(name, m):
            continue

        def hook(mod, args, out, _name=name):
            calls.append(Call(_name, mod, args[0] if args else None, _first(out), len(calls)))

        handles.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            if capture_cache:
                t = Trace(model, metadata=prepared.meta)
                with t:
                    out = prepared.run()
                return Recorded(out, prepared.meta, calls, t.cache)
            out = prepared.run()
            return Recorded(out, prepared.meta, calls)
    finally:
        for h in handles:
            h.remove()


__all__ += [
    "run_recorded",
    "Recorded",
    "Call",
]
