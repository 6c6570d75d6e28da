"""Greedy decoding of an encoder-decoder's decoder inputs, when no target is given.

Without ``target=`` an encoder-decoder's decoder reads what the model itself writes: each input
is decoded greedily by the model's own ``generate`` (one input at a time, no sampling, one beam)
and that sequence, led by the decoder start token and cut before its first end token, is
captured (``metadata["target_source"] == "greedy"``). Texts (:mod:`~probe.capture.inputs.text`)
and sound or features (:mod:`~probe.capture.inputs.transcript`) are decoded here alike; only the
length asked of ``generate`` differs (a text's ``max_new_tokens``, Whisper's ``max_length``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from probe.capture.inputs.prepared import model_name
from probe.errors import ProbeError


def decoder_start(model: nn.Module) -> int:
    """The token the model's decoder starts from: its config's (or generation config's)
    ``decoder_start_token_id``, else ``bos_token_id``, else ``pad_token_id``."""
    cfg = model.config
    for attr in ("decoder_start_token_id", "bos_token_id", "pad_token_id"):
        v = getattr(cfg, attr, None)
        if v is None and hasattr(model, "generation_config"):
            v = getattr(model.generation_config, attr, None)
        if v is not None:
            return int(v)
    raise ProbeError(f"{model_name(model)} has no decoder_start_token_id; pass target= ids instead")


def end_ids(model: nn.Module) -> set[int]:
    """The model's end tokens (its generation config's ``eos_token_id``: one id or a list)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return set(eos if isinstance(eos, list) else [eos]) - {None}


def until_end(seq: list[int], ends: set[int], start: int = 1) -> list[int]:
    """``seq`` cut before its first end token at position ``start`` or later (the decoder start
    token at position 0 may be an end token too: BART starts from ``</s>``)."""
    cut = next((k for k in range(start, len(seq)) if seq[k] in ends), len(seq))
    return seq[:cut]


def greedy_sequences(
    model: nn.Module, rows: list[dict[str, Any]], fix: str, start: int | None = None, **length: Any
) -> list[list[int]]:
    """One greedy decoding per input of ``rows`` (each the keyword inputs of one input for
    ``generate``; ``length``: ``max_new_tokens=`` or ``max_length=``), each cut before its first
    end token; with ``start``, a sequence ``generate`` returned without the start token gets it
    in front (Whisper's leaves it out). A model without ``generate``, or whose ``generate``
    fails, is one line ending ``pass target= (<fix>)``."""
    name = model_name(model)
    if not hasattr(model, "generate"):
        raise ProbeError(f"{name} offers no greedy decoding; pass target= ({fix})")
    ends = end_ids(model)
    seqs = []
    with torch.no_grad():
        for inputs in rows:
            try:
                out = model.generate(**inputs, do_sample=False, num_beams=1, **length)
            except Exception as e:  # generation is the library's; say what failed and the way out
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                why = f"{type(e).__name__}: {first}" if first else type(e).__name__
                raise ProbeError(
                    f"greedy decoding with {name}.generate() failed ({why}); pass target= ({fix})"
                ) from None
            seq = [int(t) for t in (out.sequences if hasattr(out, "sequences") else out)[0]]
            if start is not None and (not seq or seq[0] != start):
                seq = [start, *seq]
            seqs.append(until_end(seq, ends))
    return seqs


__all__ = ["decoder_start", "end_ids", "greedy_sequences", "until_end"]
