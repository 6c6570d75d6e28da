"""Which rows of a generation cache wrote which generated tokens (see docs/generation.md).

A generation of ``N`` tokens from a prompt of ``P`` is cached over the sequence the model read,
prompt + output[:-1] (``T = P + N - 1`` positions); ``metadata["generation"]`` holds the prompt
length, the output ids and text, and the stack that generated, and the stack's positions
(``metadata["stacks"][stack]["positions"]``) say which positions are ``"generated"``. The query
that wrote generated token ``t`` is the real position just before it: the prompt's last token for
``t = 0``, generated token ``t - 1`` after that. Everything here reads the metadata only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from probe.errors import ProbeError

GENERATED = "generated"


@dataclass(frozen=True)
class Steps:
    """One text's generation laid on the cached sequence.

    ``prompt``: the real prompt positions (ascending); ``generated``: the positions of the
    generated tokens that were read (all but the last); ``writers``: per generated token ``t``
    (``0..N-1``) the query position that wrote it; ``kinds``: every position's kind (``"prompt"``
    or, for a vision-language prompt, ``"text"``/``"image"``; ``"generated"``; None for padding);
    ``tokens``: the tokens of the cached sequence; ``output``: the ``N`` generated tokens as text
    (the last one never read, so taken from the metadata); ``length``: ``T``.
    """

    stack: str
    batch: int
    prompt: list[int]
    generated: list[int]
    writers: list[int]
    kinds: list[str | None]
    tokens: list[str]
    output: list[str]
    length: int
    images: tuple[int, ...] = ()  # the prompt's image token positions (a vision-language prompt)

    @property
    def n_steps(self) -> int:
        """``N``: the number of generated tokens."""
        return len(self.writers)

    def image_positions(self) -> list[int]:
        """The prompt positions that are image tokens (a vision-language prompt), else ``[]``."""
        return [p for p in self.prompt if self.kinds[p] == "image" or p in self.images]


def generation_meta(cache: Any) -> dict[str, Any]:
    """``metadata["generation"]``, or a one-line error for a cache that is not a generation."""
    gen = cache.metadata.get("generation")
    if not isinstance(gen, dict):
        raise ProbeError(
            "this cache is not a generation (its metadata has no 'generation'); capture one with "
            "probe.generate(model, prompt, max_new_tokens=...) or `probe generate --model NAME 'prompt'`"
        )
    return gen


def _per_text(value: Any, batch: int) -> Any:
    return value[batch] if isinstance(value, list) and value and isinstance(value[0], list) else value


def _kinds(cache: Any, stack: str, batch: int, length: int, gen: dict[str, Any]) -> list[str | None]:
    """Every position's kind: the stack's recorded kinds (per text when there are several), else
    ``prompt_length`` prompt positions then generated ones; padding (mask 0) as None."""
    pos = ((cache.metadata.get("stacks") or {}).get(stack) or {}).get("positions") or {}
    kinds = pos.get("kinds")
    if kinds is None and pos.get("rows"):
        rows = pos["rows"]
        kinds = rows[batch]["kinds"] if batch < len(rows) else None
    if kinds is None:
        p = gen.get("prompt_length")
        p = p[batch] if isinstance(p, list) else p
        if not isinstance(p, int):
            raise ProbeError("this generation cache records neither position kinds nor a prompt_length")
        kinds = ["prompt"] * p + [GENERATED] * (length - p)
    kinds = list(kinds)
    if len(kinds) != length:
        raise ProbeError(
            f"the {stack} positions record {len(kinds)} kinds for a sequence of {length}; "
            "the cache is inconsistent"
        )
    masks = cache.metadata.get(
        "target_attention_mask" if stack == "decoder" and _enc_dec(cache) else "attention_mask"
    )
    mask = masks[batch] if masks and batch < len(masks) and len(masks[batch]) == length else [1] * length
    return [k if m else None for k, m in zip(kinds, mask, strict=True)]


def _enc_dec(cache: Any) -> bool:
    return cache.metadata.get("target_tokens") is not None or "encoder" in cache.stacks


def _output_tokens(gen: dict[str, Any], batch: int, read: list[str]) -> list[str]:
    """The generated tokens as text: the metadata's ``output_tokens`` when recorded, else the
    tokens read plus the last one (the rest of ``output_text`` after them, else its id)."""
    given = _per_text(gen.get("output_tokens"), batch)
    if isinstance(given, list) and len(given) == len(read) + 1:
        return [str(t) for t in given]
    ids = _per_text(gen.get("output_ids"), batch) or []
    text = gen.get("output_text")
    text = text[batch] if isinstance(text, list) else text
    for sep in ("", " "):  # characters or pieces joined as they are, or words joined by spaces
        head = sep.join(read)
        if isinstance(text, str) and text.startswith(head) and text[len(head) :].strip():
            return [*read, text[len(head) :].strip() if sep else text[len(head) :]]
    last = f"id {ids[-1]}" if ids else "?"
    return [*read, last]


def steps(cache: Any, batch: int = 0, stack: str | None = None) -> Steps:
    """The :class:`Steps` of text ``batch`` of a generation cache (``stack``: the one that
    generated, ``metadata["generation"]["stack"]``, by default)."""
    gen = generation_meta(cache)
    stack = stack or gen.get("stack") or "decoder"
    if stack not in cache.stacks:
        raise ProbeError(
            f"the generation's stack {stack!r} is not in this cache; it has {', '.join(cache.stacks)}"
        )
    n = cache.n_texts
    if isinstance(batch, bool) or not isinstance(batch, int) or not 0 <= batch < n:
        raise ProbeError(f"batch {batch!r} is out of range: the cache holds {n} text(s)")
    length = _length(cache, stack)
    kinds = _kinds(cache, stack, batch, length, gen)
    real = [p for p, k in enumerate(kinds) if k is not None]
    prompt = [p for p in real if kinds[p] != GENERATED]
    generated = [p for p in real if kinds[p] == GENERATED]
    if not prompt:
        raise ProbeError(f"text {batch} of this generation has no prompt position")
    writers = [prompt[-1], *generated]
    side = "target_tokens" if _enc_dec(cache) and stack == "decoder" else "tokens"
    rows = cache.metadata.get(side) or []
    tokens = (
        [str(t) for t in rows[batch]]
        if batch < len(rows) and len(rows[batch]) == length
        else [str(p) for p in range(length)]
    )
    output = _output_tokens(gen, batch, [tokens[p] for p in generated])
    images = tuple(p for p in prompt if p in _image_positions(cache, stack, batch))
    return Steps(stack, batch, prompt, generated, writers, kinds, tokens, output, length, images)


def _image_positions(cache: Any, stack: str, batch: int) -> set[int]:
    """The positions a vision-language stack's per-text kinds (``positions["rows"]``) call image."""
    pos = ((cache.metadata.get("stacks") or {}).get(stack) or {}).get("positions") or {}
    rows = pos.get("rows") or []
    kinds = rows[batch].get("kinds") or [] if batch < len(rows) else []
    return {p for p, k in enumerate(kinds) if k == "image"}


def _length(cache: Any, stack: str) -> int:
    """``T``: the query length of the stack's self-attention (whatever the cache kept of it)."""
    for k in cache.keys():
        if k.startswith(f"{stack}.") and ".self_attn." in k:
            field = k.rsplit(".", 1)[-1]
            shape = cache.shape(k)
            if field == "pattern":
                return shape[2]
            if field in ("rows", "topk_values"):
                return shape[3] if field == "rows" else shape[2]
    names = [k for k in cache.keys() if k.startswith(f"{stack}.") and k.endswith(("resid_pre", "resid_post"))]
    if names:
        return cache.shape(names[0])[1]
    raise ProbeError(f"the {stack} stack of this cache holds no self-attention and no residual stream")


__all__ = ["GENERATED", "Steps", "generation_meta", "steps"]
