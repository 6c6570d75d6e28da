"""Texts as inputs: tokenized, padded into one batch, recorded for the cache metadata.

Texts are tokenized through :mod:`probe.capture.inputs.tokenizers` (zoo and Hugging Face
tokenizers alike), padded into one batch on the tokenizer's padding side, checked against the
model's context length, and recorded (texts, display tokens, ids, special-token and padding
masks) for the cache metadata (:func:`record_tokens`, which the other modalities use for their
own token ids too). Hugging Face models are called with ``input_ids``/``attention_mask`` (and
position ids counted over real tokens in the model's own convention, so left padding does not
shift positions; see :func:`position_ids`); zoo models with their ids (and decoder ids for
encoder-decoders). An encoder-decoder's decoder reads ``target=`` (teacher forcing) or, without
it, the model's own greedy decoding (:mod:`probe.capture.inputs.decoding`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from probe.capture.inputs.checks import check_length, context_length, no_tokenizer
from probe.capture.inputs.decoding import decoder_start, greedy_sequences, until_end
from probe.capture.inputs.prepared import (
    Prepared,
    accepts,
    device_of,
    is_encoder_decoder,
    is_hf_model,
    model_name,
)
from probe.capture.inputs.tokenizers import Encoding, adapt, clip
from probe.errors import ProbeError


def as_texts(inputs: Any, what: str = "text") -> list[str]:
    """``inputs`` as a non-empty list of non-empty strings (one string, or a list of them)."""
    if isinstance(inputs, str):
        texts = [inputs]
    elif isinstance(inputs, (list, tuple)):
        texts = list(inputs)
    else:
        raise ProbeError(
            f"{what} should be a string, a list of strings, a tensor of ids"
            f"{' or a dict of keyword inputs' if what == 'text' else ''}, not {type(inputs).__name__}"
        )
    if not texts:
        raise ProbeError(f"no {what} given; pass a string or a non-empty list of strings")
    for t in texts:
        if not isinstance(t, str):
            raise ProbeError(f"expected {what} as strings, got {type(t).__name__}")
        if not t.strip():
            raise ProbeError(f"empty {what}: give at least one token to capture")
    return texts


def pad(seqs: list[list[int]], pad_id: int, side: str, device: torch.device) -> tuple[Tensor, Tensor]:
    """Ids and attention mask ``[batch, T]`` padded on ``side``, on ``device``."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[i, sl] = torch.tensor(s, dtype=torch.long)
        mask[i, sl] = 1
    return ids.to(device), mask.to(device)


def encode_all(
    tok: Any, texts: list[str], name: str, limit: int | None, what: str, target: bool = False
) -> list[Encoding]:
    """Each text encoded by ``tok`` (as a label sequence with ``target``), each checked to hold
    tokens and to fit ``limit``."""
    out = []
    for t in texts:
        enc = tok.encode(t, target=True) if target else tok.encode(t)
        if not enc.ids:
            raise ProbeError(f"empty {what}: {t!r} has no tokens for {name}")
        check_length(len(enc.ids), limit, name, f"{what} {clip(t)}")
        out.append(enc)
    return out


def record_tokens(meta: dict, prefix: str, texts: list[str], encs: list[Encoding], mask: Tensor) -> None:
    """Record texts, display tokens, ids, special-token and padding masks in ``meta`` under
    ``prefix`` (``""`` for the source, ``"target_"`` for a decoder's tokens)."""
    meta[f"{prefix}texts"] = texts
    meta[f"{prefix}tokens"] = [e.tokens for e in encs]
    meta[f"{prefix}ids"] = [e.ids for e in encs]
    # padded like attention_mask; padding positions count as special, as in the tokenizer's own
    # padded mask (attention_mask tells padding apart)
    special = torch.ones_like(mask)
    for i, e in enumerate(encs):
        special[i, mask[i].bool()] = torch.tensor(
            [int(s) for s in e.special], dtype=special.dtype, device=special.device
        )
    meta[f"{prefix}special_tokens_mask"] = special.tolist()
    meta[f"{prefix}attention_mask"] = mask.tolist()


def position_ids(model: nn.Module, mask: Tensor) -> Tensor:
    """Position ids ``[batch, T]`` counting real tokens only, in ``model``'s own convention.

    Most models count from 0. Models whose position embedding has a ``padding_idx`` (RoBERTa,
    XLM-R, CamemBERT, ESM) count from ``padding_idx + 1`` and give pads ``padding_idx``, as
    their own ``create_position_ids_from_input_ids`` does.
    """
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding) and "position" in name and m.padding_idx is not None:
            return mask.cumsum(-1) * mask + m.padding_idx
    return (mask.cumsum(-1) - 1).clamp(min=0)


def prepare_text(model: nn.Module, inputs: Any, tokenizer: Any = None, target: Any = None) -> Prepared:
    """The forward call for a text or a list of texts (see :func:`probe.capture`)."""
    name = model_name(model)
    raw_tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if raw_tok is None:
        raise no_tokenizer(model, name)
    tok = adapt(raw_tok)
    texts = as_texts(inputs)
    encs = encode_all(tok, texts, name, context_length(model), "text")
    hf = is_hf_model(model)
    side = tok.padding_side
    meta: dict[str, Any] = {"input_kind": "text", "pad_id": tok.pad_id}
    if side == "left" and hf and not accepts(model, "position_ids"):
        # without position ids, left padding would shift every real token's position
        side = "right"
        meta["padding_note"] = (
            f"the tokenizer pads on the left, but {name} takes no position_ids, "
            "so probe padded on the right to keep each text's positions"
        )
    ids, mask = pad([e.ids for e in encs], tok.pad_id, side, device_of(model))
    meta["padding_side"] = side
    record_tokens(meta, "", texts, encs, mask)
    if is_encoder_decoder(model):
        return _encoder_decoder(model, (ids, mask, encs), raw_tok, tok, target, meta)
    if target is not None:
        raise ProbeError(f"{name} is not an encoder-decoder; target= is only for those")
    if not hf and not accepts(model, "attention_mask"):
        return Prepared(lambda: model(ids), meta)
    # a transformers model, or any module whose forward takes the padding mask
    kwargs = {"attention_mask": mask}
    if accepts(model, "position_ids") and bool((mask[:, 0] == 0).any()):
        # left padding: count positions over real tokens only, so each text keeps the
        # positions it has alone (right padding needs nothing: the model's default agrees)
        kwargs["position_ids"] = position_ids(model, mask)
    if accepts(model, "use_cache"):
        kwargs["use_cache"] = False
    return Prepared(lambda: model(ids, **kwargs), meta)


def _encoder_decoder(
    model: nn.Module, source: tuple, raw_tok: Any, tok: Any, target: Any, meta: dict[str, Any]
) -> Prepared:
    """An encoder-decoder's forward: the source ``(ids, mask, encodings)``, and the decoder's
    inputs from ``target`` (teacher forcing) or the model's greedy decoding."""
    ids, mask, encs = source
    name, hf = model_name(model), is_hf_model(model)
    target_tok = tok if hf else adapt(getattr(raw_tok, "target", raw_tok))
    if target is None:
        tgt_encs = [target_tok.from_ids(s) for s in _greedy(model, ids, mask, raw_tok, hf)]
        tgt_texts = [target_tok.decode(e.ids) for e in tgt_encs]
        meta["target_source"] = "greedy"
    else:
        tgt_texts = as_texts(target, "target text")
        if len(tgt_texts) != len(encs):
            raise ProbeError(f"{len(encs)} texts but {len(tgt_texts)} targets; give one target per text")
        tgt_encs = encode_all(target_tok, tgt_texts, name, context_length(model), "target", target=hf)
        if hf:  # labels -> decoder inputs: the start token, then the labels shifted right
            start = decoder_start(model)
            tgt_encs = [target_tok.from_ids([start] + e.ids[:-1]) for e in tgt_encs]
        meta["target_source"] = "given"
    tgt_ids, tgt_mask = pad([e.ids for e in tgt_encs], target_tok.pad_id, "right", device_of(model))
    record_tokens(meta, "target_", tgt_texts, tgt_encs, tgt_mask)
    if not hf:
        return Prepared(lambda: model(ids, tgt_ids), meta)
    kwargs = {"input_ids": ids, "attention_mask": mask}
    kwargs |= {"decoder_input_ids": tgt_ids, "decoder_attention_mask": tgt_mask}
    if accepts(model, "use_cache"):
        kwargs["use_cache"] = False
    return Prepared(lambda: model(**kwargs), meta)


def _greedy(model: nn.Module, ids: Tensor, mask: Tensor, raw_tok: Any, hf: bool) -> list[list[int]]:
    """Greedy decoder inputs, one list per text: start token + generated tokens without the end
    (a transformers model's ``generate``, :func:`~probe.capture.inputs.decoding.greedy_sequences`;
    a zoo model's ``greedy_decode``)."""
    rows = [ids[i : i + 1, mask[i].bool()] for i in range(ids.shape[0])]
    if hf:
        inputs = [{"input_ids": src, "attention_mask": torch.ones_like(src)} for src in rows]
        new = min(32, context_length(model) or 32)
        return greedy_sequences(model, inputs, "the decoder text", max_new_tokens=new)
    if not hasattr(model, "greedy_decode"):
        raise ProbeError(f"{model_name(model)} offers no greedy decoding; pass target= (the decoder text)")
    bos, eos = getattr(raw_tok, "bos_id", None), getattr(raw_tok, "eos_id", None)
    seqs = []
    with torch.no_grad():
        for src in rows:
            out = [int(t) for t in model.greedy_decode(src).reshape(-1)]
            out = until_end(out, {eos} if eos is not None else set(), start=0)
            seqs.append(([bos] if bos is not None else []) + out)
    return seqs


__all__ = [
    "as_texts",
    "encode_all",
    "pad",
    "position_ids",
    "prepare_text",
    "record_tokens",
]
