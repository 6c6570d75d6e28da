"""Clean and corrupted prompt sets for the two textbook circuits: induction and IOI.

**Induction** (:func:`induction_prompts`; Olsson et al. 2022): a beginning-of-sequence token, a
random first half of ``half`` distinct tokens, then its first ``shown`` tokens again; the next token
is the first half's token after the last one shown (an induction head finds the earlier copy of the
current token and copies what followed it). The corrupted prompt has a **different random first
half** in which the current token also occurs once, but at another place and followed by another
token, so induction predicts that wrong token there; the second half is the same. The answers are
``(correct, wrong)``: the token induction gives on the clean prompt and the one it gives on the
corrupted prompt, so ``metric="logit-diff"`` is high on clean and negative on corrupted.

**Indirect object identification** (:func:`ioi_prompts`; Wang et al. 2022): "When Mary and John
went to the store, John gave a drink to" -> " Mary" (the indirect object, IO), not " John" (the
subject, S, named twice). Templates, places and objects vary, and the order of the first clause
(ABBA and BABA). The corrupted prompt has **the two names swapped everywhere** ("When John and
Mary ..., Mary gave a drink to"): the same sentence with the other name duplicated, so its answer
is the other name. (Wang et al.'s "ABC" corruption, three unrelated names, removes the name
information instead; swapping keeps every position's role and flips the answer, so the logit
difference goes from positive to negative.) Names are single tokens with a leading space,
checked against the tokenizer, and every clean prompt has as many tokens as its corrupted one,
else a :class:`ProbeError`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from probe.capture.inputs.tokenizers import adapt
from probe.errors import ProbeError

TEMPLATES = [
    "When {A} and {B} went to the {place}, {B} gave a {thing} to",
    "Then, {A} and {B} went to the {place}. {B} gave a {thing} to",
    "While {A} and {B} were working at the {place}, {B} gave a {thing} to",
    "After {A} and {B} went to the {place}, {B} handed a {thing} to",
    "When {A} and {B} got a {thing} at the {place}, {B} decided to give it to",
    "Then, {A} and {B} had a long argument at the {place}. Afterwards {B} said to",
    "After the lunch, {A} and {B} went to the {place}. {B} gave a {thing} to",
    "Friends {A} and {B} found a {thing} at the {place}. {B} gave it to",
]
NAMES = (
    "Mary John Tom James Sarah Michael David Daniel Paul Mark Anna Emma Lisa Laura Kevin Peter "
    "Jack Alice Rose Adam Sam Ben Kate Amy Chris Steve Eric Ryan Alex Jane Linda George Max Luke"
).split()
PLACES = "store park school restaurant hospital station office garden market beach".split()
THINGS = "drink book ring bone ball computer necklace snack apple letter".split()


@dataclass
class PromptSet:
    """Clean and corrupted inputs and the ``(correct, wrong)`` answer of each clean prompt.

    ``clean``/``corrupted``: texts (or id tensors ``[n, pos]``); ``answers``: a list of pairs, as
    ``probe.circuit(..., answers=)`` takes them; ``info``: per prompt, what was drawn.
    """

    clean: Any
    corrupted: Any
    answers: list[tuple[Any, Any]]
    info: list[dict] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.answers)


def _single_tokens(tok: Any, words: list[str]) -> list[str]:
    """The words that are one (non-special) token each."""
    out = []
    for w in words:
        enc = tok.encode(w)
        if sum(1 for s in enc.special if not s) == 1:
            out.append(w)
    return out


def _length(tok: Any, text: str) -> int:
    return len(tok.encode(text).ids)


def ioi_prompts(
    n: int,
    tokenizer: Any,
    *,
    seed: int = 0,
    templates: list[str] | None = None,
    names: list[str] | None = None,
) -> PromptSet:
    """``n`` IOI prompts and their name-swapped corruptions (see the module docstring).

    ``tokenizer``: the model's (a Hugging Face or zoo tokenizer); ``templates``: strings with
    ``{A}`` (the indirect object), ``{B}`` (the subject, named twice), ``{place}``, ``{thing}``.
    """
    tok = adapt(tokenizer)
    pool = _single_tokens(tok, [" " + w for w in (names or NAMES)])
    if len(pool) < 2:
        raise ProbeError("fewer than two of the names are single tokens for this tokenizer; pass names=")
    rng = random.Random(seed)
    clean, corrupted, answers, info = [], [], [], []
    for i in range(n):
        t = (templates or TEMPLATES)[i % len(templates or TEMPLATES)]
        a, b = rng.sample(pool, 2)
        fill = {"place": rng.choice(PLACES), "thing": rng.choice(THINGS)}
        if rng.random() < 0.5:  # BABA: the subject first
            t = t.replace("{A} and {B}", "{B} and {A}", 1)
        text = t.format(A=a.strip(), B=b.strip(), **fill)
        swapped = t.format(A=b.strip(), B=a.strip(), **fill)
        if _length(tok, text) != _length(tok, swapped):
            raise ProbeError(
                f"IOI prompt {i} has {_length(tok, text)} tokens but its name-swapped version "
                f"{_length(tok, swapped)}: {text!r}; choose other names or templates"
            )
        clean.append(text)
        corrupted.append(swapped)
        answers.append((a, b))
        info.append({"template": t, "io": a.strip(), "s": b.strip()} | fill)
    return PromptSet(clean, corrupted, answers, info)


def induction_prompts(
    n: int,
    tokens: str | list[int],
    *,
    half: int = 16,
    shown: int = 8,
    bos: str | int | None = "^",
    seed: int = 0,
) -> PromptSet:
    """``n`` repeated-segment prompts and their corruptions (see the module docstring).

    ``tokens``: the symbols to draw from (a string of one-character tokens gives texts, a list of
    ids gives id tensors); ``bos``: what begins each prompt (None: nothing). Every prompt has
    ``1 + half + shown`` tokens (with a ``bos``).
    """
    pool = list(tokens)
    if not 2 <= shown < half or len(pool) < half + 2:
        raise ProbeError(
            f"induction prompts need 2 <= shown < half and more than half + 1 tokens to draw from "
            f"(shown={shown}, half={half}, {len(pool)} tokens)"
        )
    rng = random.Random(seed)
    clean, corrupted, answers = [], [], []
    for _ in range(n):
        first = rng.sample(pool, half)
        cur, right = first[shown - 1], first[shown]  # the current token and what followed it
        other = rng.sample([t for t in pool if t not in (cur, right)], half)
        j = rng.choice([p for p in range(1, half) if p != shown])  # where cur occurs in the corrupted half
        other[j - 1] = cur
        wrong = other[j]
        second = first[:shown]
        clean.append(first + second)
        corrupted.append(other + second)
        answers.append((right, wrong))
    head = [] if bos is None else [bos]
    if isinstance(tokens, str):
        return PromptSet(["".join(head + s) for s in clean], ["".join(head + s) for s in corrupted], answers)
    return PromptSet(
        torch.tensor([head + s for s in clean]), torch.tensor([head + s for s in corrupted]), answers
    )


__all__ = ["PromptSet", "ioi_prompts", "induction_prompts", "TEMPLATES", "NAMES"]
