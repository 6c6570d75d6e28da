"""Turning what the user passes to ``probe.capture`` into one forward call and its metadata.

Texts are tokenized with the model's tokenizer (``encode(text) -> ids``, ``tokenize(text) ->
token strings``, ``pad_id``), padded on the right into one batch, checked against the model's
context length, and recorded (texts, tokens, ids, padding masks) for the cache metadata.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from probe.errors import ProbeError


@dataclass
class Prepared:
    """A ready-to-run forward pass and what it was made from."""

    run: Callable[[], Any]
    meta: dict[str, Any]


def _texts(inputs: Any, what: str = "text") -> list[str]:
    texts = [inputs] if isinstance(inputs, str) else list(inputs)
    if not texts:
        raise ProbeError(f"no {what} given; pass a string or a non-empty list of strings")
    for t in texts:
        if not isinstance(t, str):
            raise ProbeError(f"expected {what} as strings, got {type(t).__name__}")
        if not t.strip():
            raise ProbeError(f"empty {what}: give at least one token to capture")
    return texts


def _encode(tok: Any, text: str, model_name: str) -> tuple[list[int], list[str]]:
    try:
        ids = list(tok.encode(text))
    except ProbeError:
        raise
    except (ValueError, KeyError) as e:
        msg = str(e).strip("'\"")
        raise ProbeError(msg.splitlines()[0] if msg else f"{model_name} cannot encode {text!r}") from None
    if not ids:
        raise ProbeError(f"empty text: {text!r} has no tokens for {model_name}")
    if hasattr(tok, "tokenize"):
        tokens = list(tok.tokenize(text))
    else:
        tokens = [tok.decode([i]) for i in ids]
    return ids, tokens


def _check_length(n: int, limit: int | None, model_name: str, what: str) -> None:
    if limit is not None and n > limit:
        raise ProbeError(f"{what} is {n} tokens but {model_name} accepts at most {limit}; shorten it")


def _batch(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def _model_name(model: nn.Module) -> str:
    name = getattr(model, "name", None)
    return name if isinstance(name, str) else type(model).__name__


def prepare(model: nn.Module, inputs: Any, *, tokenizer: Any = None, target: Any = None) -> Prepared:
    """Build the forward call for ``model`` on ``inputs`` (see :func:`probe.capture`)."""
    if not isinstance(model, nn.Module):
        raise ProbeError(f"probe captures torch.nn.Module models, not {type(model).__name__}")
    name = _model_name(model)
    if isinstance(inputs, Tensor):
        return _prepare_tensor(model, inputs, tokenizer, name)
    tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if tok is None:
        raise ProbeError(f"{name} has no tokenizer; pass tokenizer=... or a tensor of token ids")
    texts = _texts(inputs)
    limit = getattr(model, "context_length", None)
    encoded = [_encode(tok, t, name) for t in texts]
    for t, (ids, _) in zip(texts, encoded, strict=False):
        _check_length(len(ids), limit, name, f"text {t[:30]!r}")
    pad_id = int(getattr(tok, "pad_id", 0) or 0)
    ids, mask = _batch([e[0] for e in encoded], pad_id)
    meta: dict[str, Any] = {
        "input_kind": "text",
        "texts": texts,
        "tokens": [e[1] for e in encoded],
        "ids": [e[0] for e in encoded],
        "attention_mask": mask.tolist(),
        "padding_side": "right",
        "pad_id": pad_id,
    }
    if not getattr(model, "is_encoder_decoder", False):
        if target is not None:
            raise ProbeError(f"{name} is not an encoder-decoder; target= is only for those")
        return Prepared(lambda: model(ids), meta)

    target_tok = getattr(tok, "target", tok)
    if target is None:
        if not hasattr(model, "greedy_decode"):
            raise ProbeError(f"{name} offers no greedy decoding; pass target= (the decoder text)")
        bos, eos = getattr(tok, "bos_id", None), getattr(tok, "eos_id", None)
        tgt_seqs = []
        with torch.no_grad():
            for i, e in enumerate(encoded):
                out = [int(t) for t in model.greedy_decode(ids[i : i + 1, : len(e[0])]).reshape(-1)]
                # the decoder input that produced `out` step by step: start token, then all but
                # the final end token
                if eos is not None and out and out[-1] == eos:
                    out = out[:-1]
                tgt_seqs.append(([bos] if bos is not None else []) + out)
        target_texts = [target_tok.decode(s) for s in tgt_seqs]
        tgt_encoded = [(s, [target_tok.decode([i]) for i in s]) for s in tgt_seqs]
        meta["target_source"] = "greedy"
    else:
        target_texts = _texts(target, "target text")
        if len(target_texts) != len(texts):
            raise ProbeError(f"{len(texts)} texts but {len(target_texts)} targets; give one target per text")
        tgt_encoded = [_encode(target_tok, t, name) for t in target_texts]
        meta["target_source"] = "given"
    for t, (s, _) in zip(target_texts, tgt_encoded, strict=False):
        _check_length(len(s), limit, name, f"target {t[:30]!r}")
    tgt_ids, tgt_mask = _batch([e[0] for e in tgt_encoded], int(getattr(target_tok, "pad_id", pad_id)))
    meta.update(
        {
            "target_texts": target_texts,
            "target_tokens": [e[1] for e in tgt_encoded],
            "target_ids": [e[0] for e in tgt_encoded],
            "target_attention_mask": tgt_mask.tolist(),
        }
    )
    return Prepared(lambda: model(ids, tgt_ids), meta)


def _prepare_tensor(model: nn.Module, x: Tensor, tokenizer: Any, name: str) -> Prepared:
    if x.numel() == 0:
        raise ProbeError("empty input tensor: give at least one position to capture")
    if x.is_floating_point():
        batch = x if x.dim() >= 3 else x.unsqueeze(0)
        T = batch.shape[1]
        limit = getattr(model, "context_length", None)
        _check_length(T, limit, name, "input")
        meta = {
            "input_kind": "tensor",
            "input_shape": list(batch.shape),
            "tokens": [[str(i) for i in range(T)] for _ in range(batch.shape[0])],
        }
        return Prepared(lambda: model(batch), meta)
    ids = x if x.dim() == 2 else x.reshape(1, -1)
    ids = ids.long()
    _check_length(ids.shape[1], getattr(model, "context_length", None), name, "input")
    tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if tok is not None and hasattr(tok, "decode"):
        tokens = [[tok.decode([int(i)]) for i in row] for row in ids]
    else:
        tokens = [[str(int(i)) for i in row] for row in ids]
    meta = {
        "input_kind": "ids",
        "tokens": tokens,
        "ids": ids.tolist(),
        "attention_mask": torch.ones_like(ids).tolist(),
    }
    return Prepared(lambda: model(ids), meta)
