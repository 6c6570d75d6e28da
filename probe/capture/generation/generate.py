"""``probe.generate``: what a model read while it wrote, captured step by step through its KV cache.

The model's own ``generate`` runs inside :class:`~probe.capture.engine.steps.StepTrace` (``probe.trace(model,
steps=True)``): every forward it makes (the prefill of the prompt, then one per new token, and an
encoder-decoder's encoder once) is captured as it ran and assembled into one cache over the
sequence the decoder read, prompt + output less the last token (see
``docs/generation.md`` and ``/work/notes``' contract: ``metadata["generation"]``, position
kinds ``prompt``/``generated``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from probe.cache import Cache
from probe.capture.engine.steps import StepTrace
from probe.capture.generation.beams import beam_of_rows, follow
from probe.capture.generation.loop import own_loop
from probe.capture.generation.pictures import as_decoder, name_pictures
from probe.capture.inputs.checks import SIGNAL_KEYS, check_ids, context_length, no_tokenizer
from probe.capture.inputs.images import is_images, load_images, process, texts_of
from probe.capture.inputs.prepared import device_of, is_hf_model, model_name
from probe.capture.inputs.processors import pick_tokenizer
from probe.capture.inputs.text import record_tokens
from probe.capture.inputs.tokenizers import adapt
from probe.capture.inputs.vlm import check_processor
from probe.capture.positions.patches import image_token_id
from probe.errors import ProbeError

STATS_NOTE = (
    "statistics of the sequence the model read, computed block by block in one forward over it "
    "after generate (each row equals the row its step computed through the KV cache)"
)


class Generation:
    """A captured generation: :attr:`cache` (a :class:`~probe.Cache` over the sequence the model
    read), :attr:`text` (the output), :attr:`ids` (prompt + output ids ``[batch, P + N]``),
    :attr:`new_ids` (``[batch, N]``), :attr:`prompt_length`; :meth:`save` writes the cache."""

    def __init__(self, cache: Cache, ids: Tensor, prompt_length: int, text: str | None) -> None:
        self.cache, self.ids, self.prompt_length, self.text = cache, ids, prompt_length, text

    @property
    def new_ids(self) -> Tensor:
        return self.ids[:, self.prompt_length :]

    def save(self, path: str | os.PathLike) -> None:
        """Save the cache (a safetensors file; ``probe.load`` reads it back with its generation facts)."""
        self.cache.save(path)

    def __repr__(self) -> str:
        g = self.cache.metadata["generation"]
        shown = repr(self.text if self.text is not None else g["output_ids"])
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return (
            f"Generation({g['new_tokens']} new tokens after {g['prompt_length']}, {g['strategy']}: {shown})"
        )

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(repr(self))}</pre>"


def _prompt_ids(model: nn.Module, prompt: Any, tok: Any) -> tuple[Tensor, dict[str, Any]]:
    """The prompt as ids ``[1, P]`` on the model's device, and keyword inputs for ``generate``."""
    extra: dict[str, Any] = {}
    if isinstance(prompt, dict) or hasattr(prompt, "keys") and not isinstance(prompt, Tensor):
        extra = dict(prompt)
        prompt = extra.pop("input_ids", None)
        extra.pop("attention_mask", None)
        if prompt is None and any(k in extra for k in SIGNAL_KEYS):
            raise ProbeError(
                "probe.generate starts from a text prompt, not sound: capture an audio model with "
                "probe.capture(model, sound, processor=...), which decodes its transcript greedily"
            )
        if prompt is None:
            raise ProbeError("the prompt's inputs hold no input_ids; give the tokenizer's output or a text")
    if isinstance(prompt, str):
        if tok is None:
            raise no_tokenizer(model, model_name(model))
        ids = torch.tensor([tok.encode(prompt).ids], dtype=torch.long)
    elif isinstance(prompt, Tensor) and not prompt.is_floating_point():
        ids = prompt.reshape(1, -1) if prompt.dim() == 1 else prompt
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
        raise ProbeError("probe.generate captures one prompt at a time; call it once per text")
    else:
        raise ProbeError(
            "the prompt should be a text, a tensor of token ids or a dict of inputs, "
            f"not {type(prompt).__name__}"
        )
    if ids.dim() != 2 or ids.size(0) != 1:
        raise ProbeError(f"probe.generate captures one prompt at a time; got ids of shape {list(ids.shape)}")
    if ids.size(1) == 0:
        raise ProbeError("the prompt is empty; give at least one token")
    check_ids(model, ids, model_name(model))
    return ids.to(device_of(model)), extra


def _check(model: nn.Module, max_new_tokens: Any, kwargs: dict[str, Any], seed: Any = None) -> int:
    if not isinstance(model, nn.Module):
        raise ProbeError(f"probe captures torch.nn.Module models, not {type(model).__name__}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ProbeError(f"max_new_tokens must be a positive number of tokens, not {max_new_tokens!r}")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64
    ):  # torch.manual_seed's range
        raise ProbeError(f"seed={seed!r}: give an integer from -2**63 to 2**64 - 1 (or None)")
    returned = kwargs.get("num_return_sequences", 1) or 1
    if returned > 1:
        raise ProbeError(
            f"num_return_sequences={returned}: probe.generate follows one returned sequence; drop it "
            "(beam search returns its best beam)"
        )
    for k in ("output_attentions", "return_dict_in_generate", "streamer", "assistant_model"):
        if kwargs.get(k):
            raise ProbeError(f"probe.generate runs generate itself; drop {k}=")
    return max_new_tokens


def generate(
    model: nn.Module,
    prompt: Any,
    *,
    max_new_tokens: int = 32,
    tokenizer: Any = None,
    processor: Any = None,
    text: Any = None,
    keep: Any = None,
    layers: list[int] | None = None,
    heads: list[int] | None = None,
    dtype: Any = None,
    seed: int | None = None,
    progress: bool = False,
    stats_of: Any = None,
    **generate_kwargs: Any,
) -> Generation:
    """Generate from ``prompt`` and capture what every new token read, as the model ran.

    A transformers model runs its own ``generate`` (greedy by default; ``do_sample=True`` samples,
    reproducibly under ``seed``; other keywords pass on) with its KV cache; every forward is one
    step of :func:`probe.trace` ``(model, steps=True)``. A model without a transformers
    ``generate`` (probe's zoo minigpt and translator) is run by a greedy loop here (sampling from
    the softmax under ``seed`` with ``do_sample=True``): one forward over the whole sequence so far
    per token, as they have no KV cache; the translator's decoder starts from its start token and
    stops at its end token. ``keep``: whole patterns (default), ``"rows"`` (the row of every
    generated token over every key: ``rows``/``row_index``), ``{"topk": k}``; never a ``T x T``
    pattern for the last two. Beam search (``num_beams > 1``) keeps the returned beam, row by row
    as the cache was reordered (:mod:`probe.capture.generation.beams`). ``tokenizer`` (or ``processor``'s, or
    ``model.tokenizer``) encodes a text prompt and decodes the output. ``prompt``: a text, token
    ids, a dict of inputs (a processor's output), or, for a vision-language model, pictures with
    ``processor=`` and ``text=`` (one text holding the image token): the cache then names the
    tower's patches and the prompt's image tokens on their grid, so :func:`probe.attention_map`
    lays a generated word's row on the picture (:mod:`probe.capture.generation.pictures`).
    ``keep="stats"`` (decoder-only models): the model generates uncaptured, then
    ``stats_of(model, ids, tokenizer, layers)`` (the top-level ``probe.generate`` passes
    ``probe.capture(..., keep="stats")``) streams the focus statistics of the sequence it read
    (with the prompt's pictures) through one forward, a block of rows at a time (each row the one
    its step computed). Returns a :class:`Generation` (``metadata["generation"]``: the facts).
    """
    max_new_tokens = _check(model, max_new_tokens, generate_kwargs, seed)
    stats = keep == "stats" or getattr(keep, "kind", None) == "stats"  # the string or a parsed Keep
    raw_tok, tok, ids, extra, hf, enc_dec = _inputs(model, prompt, tokenizer, processor, text)
    if hf:  # the zoo's loop checks its own context
        _check_context(model, ids.size(1), max_new_tokens, enc_dec)
    if stats and (stats_of is None or enc_dec or heads is not None or dtype is not None):
        raise ProbeError(
            "keep='stats' of a generation: decoder-only models, every head, float32 (drop heads=/dtype=; "
            "for an encoder-decoder keep='rows' or {'topk': k}), through the top-level probe.generate"
        )
    sample = bool(generate_kwargs.get("do_sample", False))
    P = 1 if enc_dec else ids.size(1)
    bar = tqdm(total=max_new_tokens, desc="tokens", disable=not progress, leave=False)
    st = StepTrace(
        model,
        layers=layers,
        heads=heads,
        dtype=dtype,
        keep=None if stats else keep,
        hint=(max_new_tokens, P + max_new_tokens - 1),
        on_step=lambda i: bar.update(1),
    )
    try:
        with contextlib.nullcontext() if stats else st:
            out, beam_indices = _run(model, hf, ids, extra, max_new_tokens, enc_dec, seed, generate_kwargs)
    finally:
        bar.close()
    toks = (tok, adapt(getattr(raw_tok, "target", raw_tok)) if raw_tok is not None and not hf else tok)
    facts = (ids, out, enc_dec, P, (sample, seed))
    if stats:  # the final sequence's statistics, streamed block by block (no pattern whole)
        tensors, meta = _statistics(model, stats_of, toks, facts, extra, raw_tok, layers)
    else:
        tensors, meta = _stepped(model, st, toks, facts, beam_indices, generate_kwargs)
    if not enc_dec:
        name_pictures(model, meta, tensors, extra, out[0, :-1].tolist(), P, processor)
    if sample and generate_kwargs.get("temperature") is not None:
        meta["generation"]["temperature"] = float(generate_kwargs["temperature"])
    new = out[:, P:] if not enc_dec else out[:, 1:]
    cache = Cache(tensors, meta)
    return Generation(cache, torch.cat([ids, new], 1), ids.size(1), meta["generation"]["output_text"])


def _check_context(model: nn.Module, P: int, max_new_tokens: int, enc_dec: bool) -> None:
    """Refuse a generation past the model's positions (its config's ``max_position_embeddings`` or
    ``n_positions``), where an absolute position embedding fails: the decoder reads the prompt and
    every new token but the last (an encoder-decoder's: its start token and those)."""
    limit = context_length(model)
    if limit is None:
        return
    name = model_name(model)
    if P > limit:
        raise ProbeError(f"the prompt is {P} tokens but {name} reads at most {limit}; shorten it")
    read = max_new_tokens if enc_dec else P + max_new_tokens - 1
    if read > limit:
        fits = limit if enc_dec else limit - P + 1
        raise ProbeError(
            f"{name} reads at most {limit} positions; a prompt of {P} leaves room for "
            f"max_new_tokens <= {fits}"
        )


def _run(model, hf, ids, extra, max_new_tokens, enc_dec, seed, kwargs) -> tuple[Tensor, Tensor | None]:
    """Generate (the model's own ``generate``, or the greedy/sampling loop of a zoo model): the
    sequences, and with beam search the beam of each token."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        if hf:
            return _hf_generate(model, ids, extra, max_new_tokens, kwargs)
        sample = bool(kwargs.get("do_sample", False))
        return own_loop(model, ids, max_new_tokens, enc_dec, sample, seed, kwargs), None


def _statistics(model, stats_of, toks, facts, extra, raw_tok, layers) -> tuple[dict[str, Tensor], dict]:
    """``keep="stats"``: the statistics of the sequence the model read (with the prompt's other
    inputs, its pictures), streamed through one forward by ``stats_of``; tensors and metadata."""
    read = facts[1][:, :-1]
    base = stats_of(model, {"input_ids": read, **extra} if extra else read, raw_tok, layers)
    tensors, base_meta = as_decoder({k: base[k] for k in base.keys()}, base.metadata)
    meta = _meta(model, toks, *facts, base_meta)
    meta["generation"]["stats"] = STATS_NOTE
    return tensors, meta


def _inputs(model: nn.Module, prompt: Any, tokenizer: Any, processor: Any, text: Any) -> tuple:
    """``(tokenizer, adapted, ids [1, P], other inputs, transformers generate?, encoder-decoder?)``."""
    if text is not None or (processor is not None and is_images(prompt)):
        prompt = _pictures_prompt(model, prompt, processor, text)
    raw_tok = pick_tokenizer(model, tokenizer, processor)
    tok = adapt(raw_tok) if raw_tok is not None else None
    ids, extra = _prompt_ids(model, prompt, tok)
    hf = is_hf_model(model) and callable(getattr(model, "generate", None))
    cfg = getattr(model, "config", None)
    enc_dec = bool(getattr(model, "is_encoder_decoder", False) or getattr(cfg, "is_encoder_decoder", False))
    return raw_tok, tok, ids, extra, hf, enc_dec


def _pictures_prompt(model: nn.Module, pictures: Any, processor: Any, text: Any) -> dict[str, Any]:
    """Pictures and one text through a vision-language ``processor``: the prompt's inputs."""
    name = model_name(model)
    if processor is None or text is None or not is_images(pictures):
        raise ProbeError(
            "a prompt with pictures is probe.generate(model, pictures, processor=..., text='... <image> "
            "...'): the pictures (PIL images, arrays or files), the model's processor and one text"
        )
    texts = texts_of(text)
    if len(texts) != 1:
        raise ProbeError("probe.generate captures one prompt at a time; give one text")
    batch = dict(process(processor, load_images(pictures), texts))
    check_processor(model, processor, batch, name)
    batch.pop("attention_mask", None)
    return {k: v.to(device_of(model)) if isinstance(v, Tensor) else v for k, v in batch.items()}


def _stepped(model, st, toks, facts, beam_indices, kwargs) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The stepped capture's tensors and metadata; with beam search, the returned beam's."""
    tensors = st.assembler.finished
    meta = _meta(model, toks, *facts, st.cache.metadata)
    beams = int(kwargs.get("num_beams", 1) or 1) if beam_indices is not None else 1
    if beams > 1:  # the returned beam, row by row as it was reordered in the cache
        rows = beam_of_rows(beam_indices, facts[3])
        tensors = follow(tensors, "decoder", rows, beams)
        meta["steps"] = dict(meta["steps"], lengths=dict(meta["steps"]["lengths"], decoder=rows.numel()))
        meta["generation"].update({"strategy": "beam", "num_beams": beams})
    return tensors, meta


def _hf_generate(model, ids, extra, max_new_tokens, kwargs) -> tuple[Tensor, Tensor | None]:
    """The model's own ``generate``: the sequences, and with beam search the beam of each token."""
    kwargs = dict(kwargs)
    kwargs.setdefault("do_sample", False)
    beams = kwargs.setdefault("num_beams", 1) or 1
    try:
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            return_dict_in_generate=beams > 1,
            **extra,
            **kwargs,
        )
        return (out.sequences, out.beam_indices) if beams > 1 else (out, None)
    except ProbeError:
        raise
    except (TypeError, ValueError) as err:
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise ProbeError(
            f"{model_name(model)}.generate() refused its arguments ({type(err).__name__}: {first})"
        ) from None


def _meta(model, toks, ids, out, enc_dec, P, sampling, meta) -> dict[str, Any]:
    """The cache metadata: the tokens the model read, and ``generation`` (see the contract);
    ``toks``: the source's and the output's tokenizers (None: ids only)."""
    (src_tok, tok), (sample, seed) = toks, sampling
    meta = dict(meta)
    new = out[0, P:].tolist() if not enc_dec else out[0, 1:].tolist()
    read = out[0, : out.size(1) - 1].tolist()
    N = len(new)
    side = "target_" if enc_dec else ""
    if enc_dec:
        _tokens(meta, "", src_tok, ids[0].tolist())
    _tokens(meta, side, tok, read)
    meta["input_kind"] = "ids"
    decode = (lambda x: tok.decode(x)) if tok is not None else (lambda x: None)
    src_decode = (lambda x: src_tok.decode(x)) if src_tok is not None else (lambda x: None)
    meta["generation"] = {
        "prompt_length": P,
        "new_tokens": N,
        "output_ids": new,
        "output_text": decode(new),
        "prompt_text": src_decode(ids[0].tolist()),
        "last_token_read": False,
        "strategy": "sample" if sample else "greedy",
        "stack": "decoder",
    }
    if sample:
        meta["generation"]["seed"] = seed
    kinds = ["prompt"] * P + ["generated"] * (len(read) - P)
    meta["stacks"] = dict(meta.get("stacks", {}))
    if "decoder" in meta["stacks"]:
        positions: dict[str, Any] = {"kinds": kinds}
        image = image_token_id(model)
        named = (meta["stacks"]["decoder"].get("positions") or {}).get("rows")
        if (
            named and len(named) == 1 and len(named[0]["kinds"]) == len(read)
        ):  # a capture of the sequence named it
            positions["rows"] = named
        elif image is not None and image in read[:P]:  # a vision-language prompt: which are pictures
            positions["rows"] = [{"kinds": ["image" if i == image else "text" for i in read]}]
        meta["stacks"]["decoder"] = dict(meta["stacks"]["decoder"], positions=positions)
    return meta


def _tokens(meta: dict[str, Any], prefix: str, tok: Any, ids: list[int]) -> None:
    if tok is not None:
        enc = tok.from_ids(ids)
        record_tokens(meta, prefix, [tok.decode(ids)], [enc], torch.ones(1, len(ids), dtype=torch.long))
    else:
        meta[f"{prefix}tokens"] = [[str(i) for i in ids]]
        meta[f"{prefix}ids"] = [ids]
        meta[f"{prefix}attention_mask"] = [[1] * len(ids)]


__all__ = ["Generation", "generate"]
