"""A generation loop for models without a transformers ``generate`` (probe's zoo minigpt, translator).

Greedy by default (``do_sample=True``: sampled from the softmax of the last logits, divided by
``temperature`` when given, with a generator seeded by ``seed``). These models have no KV cache,
so each step is one forward over the whole sequence so far (the translator: the source and the
decoder's tokens so far); the steps' recomputed rows are dropped when assembled and only each
step's new row is kept. A decoder-only model's context (``context_length``) bounds prompt +
output; the translator starts its decoder from its start token and stops after its end token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from probe.capture.inputs.prepared import model_name
from probe.errors import ProbeError


def _logits(out: Any, name: str) -> Tensor:
    first = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
    if not isinstance(first, Tensor) or first.dim() != 3:
        raise ProbeError(
            f"{name} returned no [batch, positions, vocab] logits; probe.generate cannot decode it"
        )
    return first


def _call(model: nn.Module, name: str, *args: Tensor) -> Tensor:
    """The model's logits on ``args``; a forward that fails on ids says so in one line."""
    try:
        out = model(*args)
    except ProbeError:
        raise
    except (TypeError, ValueError, RuntimeError, IndexError) as err:
        first = (str(err).strip().splitlines() or [""])[0][:160]
        raise ProbeError(
            f"{name} cannot generate here: its forward on token ids failed ({type(err).__name__}: {first}); "
            "give a language model (logits [batch, positions, vocab])"
        ) from None
    return _logits(out, name)


def _next(logits: Tensor, sample: bool, gen: torch.Generator | None, temperature: float = 1.0) -> Tensor:
    last = logits[:, -1, :].float()
    if sample:
        return torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=gen)
    return last.argmax(-1, keepdim=True)


def own_loop(
    model: nn.Module, ids: Tensor, max_new: int, enc_dec: bool, sample: bool, seed: int | None, kwargs: dict
) -> Tensor:
    """Run the loop (see the module docstring): prompt + output ids (encoder-decoders: the
    decoder's start token + output)."""
    name = model_name(model)
    unknown = set(kwargs) - {"do_sample", "temperature"}
    if unknown:
        raise ProbeError(f"{name} has no transformers generate; drop {', '.join(sorted(unknown))}")
    temperature = kwargs.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ProbeError(f"temperature must be a number above 0, got {temperature!r}")
    gen = torch.Generator(device=ids.device).manual_seed(seed) if sample and seed is not None else None
    limit = getattr(model, "context_length", None)
    if enc_dec:
        tok = getattr(model, "tokenizer", None)
        start, eos = getattr(tok, "bos_id", None), getattr(tok, "eos_id", None)
        if start is None:
            raise ProbeError(
                f"{name} names no decoder start token (tokenizer.bos_id); it cannot generate here"
            )
        seq = torch.tensor([[start]], dtype=torch.long, device=ids.device)
        if limit is not None and max_new + 1 > limit:
            raise ProbeError(
                f"{name} reads at most {limit} target tokens; ask for max_new_tokens <= {limit - 1}"
            )
        for _ in range(max_new):
            nxt = _next(_call(model, name, ids, seq), sample, gen, temperature)
            seq = torch.cat([seq, nxt], 1)
            if eos is not None and int(nxt) == eos:
                break
        return seq
    if limit is not None and ids.size(1) + max_new - 1 > limit:
        raise ProbeError(
            f"{name} reads at most {limit} tokens; a prompt of {ids.size(1)} leaves room for "
            f"max_new_tokens <= {limit - ids.size(1) + 1}"
        )
    seq = ids
    for _ in range(max_new):
        seq = torch.cat([seq, _next(_call(model, name, seq), sample, gen, temperature)], 1)
    return seq


__all__ = ["own_loop"]
