"""An encoder-decoder's decoder side for keyword inputs: the transcript as ``decoder_input_ids``.

With ``target=`` (a text per input) the decoder inputs are the tokenizer's encoding of the text as
a label sequence, led by the model's decoder start token: a Whisper tokenizer's labels already
begin with it (``<|startoftranscript|>``, language and task tokens, ``<|notimestamps|>``, the
text, ``<|endoftext|>``: the layout openai-whisper's ``find_alignment`` runs), other labels get
it put in front. Without ``target=`` the model's own ``generate`` decodes greedily and that
sequence is captured. Either way, and for a dict that carries ``decoder_input_ids`` itself, the
metadata records ``target_ids``, ``target_tokens``, ``target_special_tokens_mask`` and
``target_attention_mask`` as for a text encoder-decoder, so the alignment analyses read the
decoder's tokens (``probe.align``, ``probe.word_timestamps``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from probe.capture.inputs.checks import context_length
from probe.capture.inputs.decoding import decoder_start, greedy_sequences
from probe.capture.inputs.prepared import accepts, device_of, is_hf_model, model_name
from probe.capture.inputs.processors import pick_tokenizer
from probe.capture.inputs.text import as_texts, encode_all, pad, record_tokens
from probe.capture.inputs.tokenizers import Encoding, adapt
from probe.errors import ProbeError

SOURCE_KEYS = ("input_features", "input_values", "attention_mask")


def _batch_size(kwargs: Mapping) -> int:
    for k in SOURCE_KEYS:
        if isinstance(kwargs.get(k), Tensor):
            return int(kwargs[k].shape[0])
    return 1


def target_inputs(
    model: nn.Module, kwargs: Mapping, target: Any, tokenizer: Any, processor: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(kwargs with decoder_input_ids, target metadata)``: ``target`` texts encoded (one per
    input), or the model's greedy decoding when ``target`` is None (see the module docstring)."""
    name = model_name(model)
    cfg = getattr(model, "config", None)
    if not getattr(cfg, "is_encoder_decoder", False):
        raise ProbeError(f"{name} is not an encoder-decoder; target= is only for those")
    if "decoder_input_ids" in kwargs:
        raise ProbeError("give the transcript once: as target= or as decoder_input_ids, not both")
    _check_heard(model, kwargs, processor)
    raw = pick_tokenizer(model, tokenizer, processor)
    n = _batch_size(kwargs)
    meta: dict[str, Any] = {}
    if target is None:
        seqs = _greedy(model, kwargs, n)
        tok = adapt(raw) if raw is not None else None
        encs = [
            tok.from_ids(s) if tok else Encoding(s, [str(i) for i in s], _specials(model, s)) for s in seqs
        ]
        texts = [tok.decode(s) if tok else "" for s in seqs]
        meta["target_source"] = "greedy"
    else:
        if raw is None:
            raise ProbeError(
                f"target= needs {name}'s tokenizer: give tokenizer= or a processor that holds one"
            )
        tok = adapt(raw)
        texts = as_texts(target, "target text")
        if len(texts) != n:
            raise ProbeError(f"{n} audio inputs but {len(texts)} targets; give one target per input")
        labels = encode_all(tok, texts, name, context_length(model), "target", target=is_hf_model(model))
        start = decoder_start(model)
        encs = [e if e.ids[0] == start else tok.from_ids([start] + e.ids) for e in labels]
        meta["target_source"] = "given"
    pad_id = tok.pad_id if tok is not None else int(getattr(cfg, "pad_token_id", 0) or 0)
    ids, mask = pad([e.ids for e in encs], pad_id, "right", device_of(model))
    record_tokens(meta, "target_", texts, encs, mask)
    out = dict(kwargs)
    out["decoder_input_ids"] = ids
    if n > 1 and accepts(model, "decoder_attention_mask"):
        out["decoder_attention_mask"] = mask
    return out, meta


def _check_heard(model: nn.Module, kwargs: Mapping, processor: Any) -> None:
    """Audio longer than the model hears, refused in one line before its encoder fails (inside
    ``generate`` the error was a tensor size mismatch, and no target helps). A Whisper-style front
    end (log-mel ``input_features`` ``[batch, mel bins, frames]``, two frames per encoder position:
    Whisper, the zoo's speech model) hears ``2 * max_source_positions`` frames; a frame is the
    processor's (else the config's) ``hop_length`` samples, default 160 at 16 kHz."""
    x = kwargs.get("input_features")
    cfg = getattr(model, "config", None)
    positions = getattr(cfg, "max_source_positions", None)
    mels = getattr(cfg, "num_mel_bins", None) or getattr(cfg, "n_mels", None)
    if not (isinstance(x, Tensor) and x.dim() == 3 and isinstance(positions, int) and x.shape[1] == mels):
        return
    most = 2 * positions
    if x.shape[-1] <= most:
        return
    fe = getattr(processor, "feature_extractor", processor)
    hop = getattr(fe, "hop_length", None) or getattr(cfg, "hop_length", None) or 160
    rate = getattr(fe, "sampling_rate", None) or getattr(cfg, "sampling_rate", None) or 16_000
    raise ProbeError(
        f"the audio is {x.shape[-1] * hop / rate:.1f} s long ({x.shape[-1]} feature frames) but "
        f"{model_name(model)} hears at most {most * hop / rate:g} s ({most} frames); shorten the audio "
        f"(or cut it into pieces of at most {most * hop / rate:g} s)"
    )


def _specials(model: nn.Module, ids: list[int]) -> list[bool]:
    cfg = getattr(model, "config", None)
    marks = {
        getattr(cfg, a, None)
        for a in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
    }
    return [i in marks for i in ids]


def _greedy(model: nn.Module, kwargs: Mapping, n: int) -> list[list[int]]:
    """Greedy decoder inputs per input: what ``generate`` returns, led by the start token, cut
    before its first end token (:func:`~probe.capture.inputs.decoding.greedy_sequences`)."""
    limit = context_length(model) or getattr(getattr(model, "config", None), "max_target_positions", None)
    new = min(32, limit - 1) if limit else 32  # the start token counts towards the decoder's length
    rows = [
        {k: kwargs[k][b : b + 1] for k in SOURCE_KEYS if isinstance(kwargs.get(k), Tensor)} for b in range(n)
    ]
    # the length as max_length (the start token and `new` tokens), not max_new_tokens: Whisper's
    # generate fills in a default max_length of 20 and warns that both are set
    start = decoder_start(model) if hasattr(model, "generate") else None
    return greedy_sequences(model, rows, "the transcript", start=start, max_length=new + 1)


def decoder_metadata(model: nn.Module, kwargs: Mapping, tokenizer: Any = None) -> dict[str, Any]:
    """The target fields of the metadata for keyword inputs holding ``decoder_input_ids``
    (empty without them): tokens from ``tokenizer`` (or ``model.tokenizer``), else the ids
    spelled out with the config's pad/BOS/EOS/start ids as special."""
    ids = kwargs.get("decoder_input_ids")
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.is_floating_point():
        return {}
    rows = ids.tolist()
    raw = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    tok = adapt(raw) if raw is not None else None
    encs = [tok.from_ids(r) if tok else Encoding(r, [str(i) for i in r], _specials(model, r)) for r in rows]
    mask = kwargs.get("decoder_attention_mask")
    full = isinstance(mask, Tensor) and mask.shape == ids.shape
    mask = (mask if full else torch.ones_like(ids)).long().cpu()
    meta: dict[str, Any] = {"target_source": "given"}
    texts = [tok.decode(r) if tok else "" for r in rows]
    record_tokens(meta, "target_", texts, encs, mask)
    return meta


__all__ = ["decoder_metadata", "target_inputs"]
