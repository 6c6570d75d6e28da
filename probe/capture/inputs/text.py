"""Turning what the user passes to ``probe.capture`` into one forward call and its metadata.

Texts are tokenized through :mod:`probe.capture.inputs.tokenizers` (zoo and Hugging Face tokenizers
alike), padded into one batch on the tokenizer's padding side, checked against the model's
context length, and recorded (texts, display tokens, ids, special-token and padding masks) for
the cache metadata. Hugging Face models are called with ``input_ids``/``attention_mask`` (and
position ids counted over real tokens in the model's own convention, so left padding does not
shift positions; see :func:`position_ids`); zoo models
with their ids (and decoder ids for encoder-decoders).
"""

from __future__ import annotations

import inspect
import itertools
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from probe.capture.inputs.checks import SIGNAL_KEYS, check_ids, check_length, context_length, no_tokenizer
from probe.capture.inputs.images import is_images
from probe.capture.inputs.tokenizers import Encoding, adapt, clip
from probe.errors import ProbeError


@dataclass
class Prepared:
    """A ready-to-run forward pass and what it was made from."""

    run: Callable[[], Any]
    meta: dict[str, Any]


def past_length(past: Any) -> int:
    """Positions held in a KV cache: a transformers ``Cache``, or nested tuples of ``(k, v)`` per layer."""
    if hasattr(past, "get_seq_length"):
        return int(past.get_seq_length())
    t = past
    while isinstance(t, (tuple, list)):
        t = t[0]
    return int(t.shape[-2])


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` ``PreTrainedModel`` (without importing transformers)."""
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


def _texts(inputs: Any, what: str = "text") -> list[str]:
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


def device_of(model: nn.Module) -> torch.device:
    """Where ``model`` computes: the device of its first parameter or buffer (CPU if it has none)."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        return t.device
    return torch.device("cpu")


def _batch(seqs: list[list[int]], pad_id: int, side: str, device: torch.device) -> tuple[Tensor, Tensor]:
    """Ids and attention mask ``[batch, T]`` padded on ``side``, on ``device``."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[i, sl] = torch.tensor(s, dtype=torch.long)
        mask[i, sl] = 1
    return ids.to(device), mask.to(device)


def model_name(model: nn.Module) -> str:
    """The name a person knows ``model`` by: ``model.name``, its config's path or type, its class."""
    name = getattr(model, "name", None)
    if isinstance(name, str):
        return name
    cfg = getattr(model, "config", None)
    return getattr(cfg, "name_or_path", None) or getattr(cfg, "model_type", None) or type(model).__name__


def _accepts(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _encode_all(
    tok: Any, texts: list[str], name: str, limit: int | None, what: str, target: bool = False
) -> list[Encoding]:
    out = []
    for t in texts:
        enc = tok.encode(t, target=True) if target else tok.encode(t)
        if not enc.ids:
            raise ProbeError(f"empty {what}: {t!r} has no tokens for {name}")
        check_length(len(enc.ids), limit, name, f"{what} {clip(t)}")
        out.append(enc)
    return out


def _record(meta: dict, prefix: str, texts: list[str], encs: list[Encoding], mask: Tensor) -> None:
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


def prepare(
    model: nn.Module,
    inputs: Any,
    *,
    tokenizer: Any = None,
    target: Any = None,
    processor: Any = None,
    sampling_rate: Any = None,
) -> Prepared:
    """Build the forward call for ``model`` on ``inputs`` (see :func:`probe.capture`)."""
    if not isinstance(model, nn.Module):
        raise ProbeError(f"probe captures torch.nn.Module models, not {type(model).__name__}")
    name = model_name(model)
    kw = {"tokenizer": tokenizer, "target": target, "processor": processor}
    if (routed := _routed(model, inputs, kw, sampling_rate)) is not None:  # sound, dicts, pictures
        return routed
    if isinstance(inputs, Tensor):
        return _prepare_tensor(model, inputs, tokenizer, name)
    raw_tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if raw_tok is None:
        raise no_tokenizer(model, name)
    tok = adapt(raw_tok)
    texts = _texts(inputs)
    limit = context_length(model)
    encs = _encode_all(tok, texts, name, limit, "text")
    hf = is_hf_model(model)
    side = tok.padding_side
    meta: dict[str, Any] = {"input_kind": "text", "pad_id": tok.pad_id}
    if side == "left" and hf and not _accepts(model, "position_ids"):
        # without position ids, left padding would shift every real token's position
        side = "right"
        meta["padding_note"] = (
            f"the tokenizer pads on the left, but {name} takes no position_ids, "
            "so probe padded on the right to keep each text's positions"
        )
    ids, mask = _batch([e.ids for e in encs], tok.pad_id, side, device_of(model))
    meta["padding_side"] = side
    _record(meta, "", texts, encs, mask)
    enc_dec = bool(
        getattr(model, "is_encoder_decoder", False)
        or getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    )
    if not enc_dec:
        if target is not None:
            raise ProbeError(f"{name} is not an encoder-decoder; target= is only for those")
        if not hf and not _accepts(model, "attention_mask"):
            return Prepared(lambda: model(ids), meta)
        # a transformers model, or any module whose forward takes the padding mask
        kwargs = {"attention_mask": mask}
        if _accepts(model, "position_ids") and bool((mask[:, 0] == 0).any()):
            # left padding: count positions over real tokens only, so each text keeps the
            # positions it has alone (right padding needs nothing: the model's default agrees)
            kwargs["position_ids"] = position_ids(model, mask)
        if _accepts(model, "use_cache"):
            kwargs["use_cache"] = False
        return Prepared(lambda: model(ids, **kwargs), meta)

    target_tok = tok if hf else adapt(getattr(raw_tok, "target", raw_tok))
    if target is None:
        tgt_encs = [target_tok.from_ids(s) for s in _greedy(model, ids, mask, encs, raw_tok, hf, name)]
        tgt_texts = [target_tok.decode(e.ids) for e in tgt_encs]
        meta["target_source"] = "greedy"
    else:
        tgt_texts = _texts(target, "target text")
        if len(tgt_texts) != len(texts):
            raise ProbeError(f"{len(texts)} texts but {len(tgt_texts)} targets; give one target per text")
        tgt_encs = _encode_all(target_tok, tgt_texts, name, limit, "target", target=hf)
        if hf:  # labels -> decoder inputs: the start token, then the labels shifted right
            start = _decoder_start(model)
            tgt_encs = [target_tok.from_ids([start] + e.ids[:-1]) for e in tgt_encs]
        meta["target_source"] = "given"
    tgt_ids, tgt_mask = _batch([e.ids for e in tgt_encs], target_tok.pad_id, "right", device_of(model))
    _record(meta, "target_", tgt_texts, tgt_encs, tgt_mask)
    if not hf:
        return Prepared(lambda: model(ids, tgt_ids), meta)
    kwargs = {"input_ids": ids, "attention_mask": mask}
    kwargs |= {"decoder_input_ids": tgt_ids, "decoder_attention_mask": tgt_mask}
    if _accepts(model, "use_cache"):
        kwargs["use_cache"] = False
    return Prepared(lambda: model(**kwargs), meta)


def _routed(model: nn.Module, inputs: Any, kw: dict[str, Any], sampling_rate: Any) -> Prepared | None:
    """Sound (:mod:`probe.capture.inputs.audio`), keyword dicts and pictures
    (:mod:`probe.capture.inputs.keywords`), each prepared by its own module on this module's helpers;
    None for texts and tensors of ids."""
    from probe.capture.inputs import audio

    # a file name is a text to a model that reads text; to one that reads pictures or sound (no
    # tokenizer, or a forward that takes them), it is a file to open, and said to need processor=
    reads_text = kw["tokenizer"] is not None or getattr(model, "tokenizer", None) is not None
    sound_file = audio.is_audio(inputs) and (not reads_text or any(_accepts(model, k) for k in SIGNAL_KEYS))
    if audio.routes_here(inputs, kw["processor"], sampling_rate) or sound_file:
        return audio.prepare_audio(model, inputs, sampling_rate=sampling_rate, **kw)
    picture_file = is_images(inputs) and (not reads_text or _accepts(model, "pixel_values"))
    if (
        kw["processor"] is not None
        or isinstance(inputs, Mapping)
        or is_images(inputs, files=False)
        or picture_file
    ):
        from probe.capture.inputs.keywords import prepare_keywords

        return prepare_keywords(model, inputs, **kw)
    return None


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


def _decoder_start(model: nn.Module) -> int:
    cfg = model.config
    for attr in ("decoder_start_token_id", "bos_token_id", "pad_token_id"):
        v = getattr(cfg, attr, None)
        if v is None and hasattr(model, "generation_config"):
            v = getattr(model.generation_config, attr, None)
        if v is not None:
            return int(v)
    raise ProbeError(f"{model_name(model)} has no decoder_start_token_id; pass target= ids instead")


def _greedy(model, ids, mask, encs, raw_tok, hf: bool, name: str) -> list[list[int]]:
    """Greedy decoder inputs, one list per text: start token + generated tokens without the end."""
    seqs = []
    with torch.no_grad():
        for i in range(len(encs)):
            row = mask[i].bool()
            src = ids[i : i + 1, row]
            if hf:
                try:
                    out = model.generate(
                        input_ids=src,
                        attention_mask=torch.ones_like(src),
                        do_sample=False,
                        num_beams=1,
                        max_new_tokens=min(32, context_length(model) or 32),
                    )
                except Exception as err:  # generation is the library's; say what failed and the way out
                    raise ProbeError(
                        f"greedy decoding with {name}.generate() failed ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''}); pass target= (the decoder text)"
                    ) from None
                seq = [int(t) for t in out[0]]
                eos = model.generation_config.eos_token_id
                eos = set(eos if isinstance(eos, list) else [eos])
                if len(seq) > 1 and seq[-1] in eos:
                    seq = seq[:-1]
                seqs.append(seq)
            elif hasattr(model, "greedy_decode"):
                out = [int(t) for t in model.greedy_decode(src).reshape(-1)]
                bos, eos = getattr(raw_tok, "bos_id", None), getattr(raw_tok, "eos_id", None)
                if eos is not None and out and out[-1] == eos:
                    out = out[:-1]
                seqs.append(([bos] if bos is not None else []) + out)
            else:
                raise ProbeError(f"{name} offers no greedy decoding; pass target= (the decoder text)")
    return seqs


def _prepare_tensor(model: nn.Module, x: Tensor, tokenizer: Any, name: str) -> Prepared:
    if x.numel() == 0:
        raise ProbeError("empty input tensor: give at least one position to capture")
    limit = context_length(model)
    x = x.to(device_of(model))  # ids or inputs built on the CPU for a model on a GPU
    if x.is_floating_point():
        if not bool(torch.isfinite(x).all()):
            raise ProbeError("the input tensor holds NaN or infinite values; give finite numbers")
        batch = x if x.dim() >= 3 else x.unsqueeze(0)
        T = batch.shape[1]
        check_length(T, limit, name, "input")
        meta = {
            "input_kind": "tensor",
            "input_shape": list(batch.shape),
            "tokens": [[str(i) for i in range(T)] for _ in range(batch.shape[0])],
        }
        return Prepared(lambda: model(batch), meta)
    ids = (x if x.dim() == 2 else x.reshape(1, -1)).long()
    check_length(ids.shape[1], limit, name, "input")
    check_ids(model, ids, name)
    raw_tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if raw_tok is not None:
        tokens = [adapt(raw_tok).tokens_of(row) for row in ids.tolist()]
    else:
        tokens = [[str(int(i)) for i in row] for row in ids]
    meta = {
        "input_kind": "ids",
        "tokens": tokens,
        "ids": ids.tolist(),
        "attention_mask": torch.ones_like(ids).tolist(),
    }
    if is_hf_model(model):
        return Prepared(lambda: model(input_ids=ids), meta)
    return Prepared(lambda: model(ids), meta)


__all__ = [
    "Prepared",
    "is_hf_model",
    "model_name",
    "position_ids",
    "prepare",
]
