"""What each attention stack is held to: ``causal``, ``bidirectional`` or a sliding window.

:func:`expected` reads the user's ``expect=`` when given, else what the model says about itself
(a decoder config, a ``*ForCausalLM`` class, an ``is_causal`` attribute, a ``generate`` method, a
declared ``sliding_window``), else what the captured attention looks like.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from probe import forward
from probe.errors import ProbeError

Expect = Any  # "causal", "bidirectional" or an int window


def declared_window(model: nn.Module | None, meta: dict) -> int | None:
    """The sliding window (in keys) the model or its stored config declares, or None."""
    cfg = getattr(model, "config", None) if model is not None else None
    for src in (model, cfg):
        for attr in ("sliding_window", "window"):
            v = getattr(src, attr, None) if src is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    v = ((meta.get("model") or {}).get("config") or {}).get("sliding_window")
    return v if isinstance(v, int) and v > 0 else None


def meant_causal(model: nn.Module | None, meta: dict) -> bool | None:
    """Whether the model says it is a decoder (config, class name, a generate method); None = silent."""
    info = meta.get("model") or {}
    cfg = (info.get("config") or {}) if model is None else getattr(model, "config", None)

    def get(k):
        return cfg.get(k) if isinstance(cfg, dict) else getattr(cfg, k, None)

    if get("is_decoder"):
        return True
    if any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in (get("architectures") or [])):
        return True
    cls = type(model).__name__ if model is not None else str(info.get("class", ""))
    if cls.endswith(("ForCausalLM", "LMHeadModel")):
        return True
    for flag in ("is_causal", "causal"):
        v = getattr(model, flag, None) if model is not None else None
        if isinstance(v, bool):
            return v
    if model is not None and not forward.is_hf_model(model) and callable(getattr(model, "generate", None)):
        return True
    return None


def expected(cache: Any, model: nn.Module | None, expect: Any) -> tuple[dict[str, Expect], list[str]]:
    """What each of ``cache.stacks`` is held to, and notes on how that was decided.

    Returns ``({stack: "causal" | "bidirectional" | window}, notes)``. ``expect`` as for
    :func:`probe.check_causal`; a dict must name stacks the cache has."""
    if isinstance(expect, dict):
        return _from_dict(cache.stacks, expect), []
    notes: list[str] = []
    stacks = cache.stacks
    window = declared_window(model, cache.metadata)
    out: dict[str, Expect] = {}
    for s in stacks:
        if s == "encoder" and "decoder" in stacks:
            out[s] = "bidirectional"
            continue
        if expect is not None:
            out[s] = normalise(expect)
            continue
        meant = True if s == "decoder" and "encoder" in stacks else meant_causal(model, cache.metadata)
        if meant is None:
            meant = s == "decoder"  # the capture found causal patterns
            if not meant:
                notes.append(
                    f"nothing says this model is a decoder and its {s} attention sees ahead, so it was "
                    "held to bidirectional; pass expect='causal' (CLI: --expect causal) to audit it "
                    "as a decoder"
                )
        out[s] = (window or "causal") if meant else "bidirectional"
    return out, notes


def _from_dict(stacks: list[str], expect: dict) -> dict[str, Expect]:
    if stacks == ["encoder"] and set(expect) == {"decoder"}:
        expect = {"encoder": expect["decoder"]}  # a broken decoder's lone stack looks like an encoder
    bad = set(expect) - set(stacks)
    if bad:
        raise ProbeError(f"expect names stacks {sorted(bad)} the cache lacks; it has {stacks}")
    return {s: normalise(expect.get(s, "bidirectional")) for s in stacks}


def normalise(e: Any) -> Expect:
    """``e`` checked: ``"causal"``, ``"bidirectional"`` or a positive window size (else ProbeError)."""
    if isinstance(e, int) and not isinstance(e, bool):
        if e < 1:
            raise ProbeError(f"expect={e}: a window is a positive number of keys")
        return e
    if e in ("causal", "bidirectional"):
        return e
    raise ProbeError(f"expect={e!r}: use 'causal', 'bidirectional', a window size, or a dict per stack")


def describe(e: Expect) -> str:
    """How an expectation reads in the report: ``causal``, ``bidirectional``, ``causal, window 4``."""
    return f"causal, window {e}" if isinstance(e, int) else str(e)
