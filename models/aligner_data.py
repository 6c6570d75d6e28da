"""A German-like -> English-like parallel corpus whose word alignments are known by construction.

Every pair is generated from one abstract sentence (subject, verb, object, adjectives, adverbs,
a clause) and realised twice, once per language; each word records the abstract slot it came
from, so the gold links fall out of the generator instead of being annotated afterwards. The
phenomena a word aligner has to get right are all here:

* verb-second inversion: ``gestern sah der mann den hund`` -> ``yesterday the man saw the dog``
* verb-final subordinate clauses: ``weil die frau das buch las`` -> ``because the woman read the book``
* adverb placement: ``der mann sah oft den hund`` -> ``the man often saw the dog``
* inflected adjectives: ``den grossen hund`` -> ``the big dog``
* compounds that split into several words: ``hundehaus`` -> ``dog house`` (1-to-2; the source
  tokenizer cuts the compound into pieces ``hunde ##haus``, so subword merging is exercised too)
* one word for two: ``suchte`` -> ``looked for``; two words that merge: ``nach hause`` -> ``home``
* inserted and dropped articles: ``er ist lehrer`` -> ``he is a teacher`` (``a`` has only a
  *possible* link to ``teacher``); ``nach dem essen`` -> ``after dinner`` (``dem`` possible to ``dinner``)

Links are ``(source word, target word)`` pairs, 0-indexed over words (compounds count as one
source word). ``sure`` links are certain; ``possible`` holds the sure links plus the ambiguous
ones (the S ⊆ P convention of Och & Ney, which AER assumes).

    >>> from models import aligner_data
    >>> train, held_out = aligner_data.split(seed=13)
    >>> held_out[0].source, held_out[0].target, sorted(held_out[0].sure)[:3]
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# noun: German singular, gender (m/f/n), English
NOUNS = [
    ("mann", "m", "man"),
    ("frau", "f", "woman"),
    ("kind", "n", "child"),
    ("hund", "m", "dog"),
    ("katze", "f", "cat"),
    ("vogel", "m", "bird"),
    ("lehrer", "m", "teacher"),
    ("aerztin", "f", "doctor"),
    ("junge", "m", "boy"),
    ("maedchen", "n", "girl"),
]
OBJECTS = [
    ("buch", "n", "book"),
    ("brief", "m", "letter"),
    ("apfel", "m", "apple"),
    ("brot", "n", "bread"),
    ("ball", "m", "ball"),
    ("tasche", "f", "bag"),
    ("blume", "f", "flower"),
    ("schluessel", "m", "key"),
    ("hund", "m", "dog"),
    ("katze", "f", "cat"),
]
# compound: German first piece, English first word; second piece: German, gender, English
COMPOUND_HEADS = [
    ("hunde", "dog"),
    ("apfel", "apple"),
    ("brief", "mail"),
    ("kinder", "child"),
    ("blumen", "flower"),
]
COMPOUND_TAILS = [
    ("haus", "n", "house"),
    ("baum", "m", "tree"),
    ("kasten", "m", "box"),
    ("garten", "m", "garden"),
]
# verbs: German past, English words (one or two)
VERBS = [
    ("sah", ["saw"]),
    ("fand", ["found"]),
    ("kaufte", ["bought"]),
    ("trug", ["carried"]),
    ("mochte", ["liked"]),
    ("suchte", ["looked", "for"]),
    ("holte", ["fetched"]),
    ("malte", ["painted"]),
]
ADJECTIVES = [
    ("gross", "big"),
    ("klein", "small"),
    ("alt", "old"),
    ("neu", "new"),
    ("rot", "red"),
    ("schoen", "nice"),
]
FREQ_ADVERBS = [("oft", "often"), ("nie", "never"), ("immer", "always"), ("selten", "rarely")]
TIME_ADVERBS = [("gestern", "yesterday"), ("heute", "today"), ("morgens", "mornings"), ("dann", "then")]
CONJUNCTIONS = [("weil", "because"), ("als", "when"), ("obwohl", "although")]
PROFESSIONS = [("lehrer", "teacher"), ("arzt", "doctor"), ("koch", "cook"), ("maler", "painter")]
PRONOUNS = [("er", "he"), ("sie", "she")]

_DEF = {("m", "nom"): "der", ("f", "nom"): "die", ("n", "nom"): "das"}
_DEF.update({("m", "acc"): "den", ("f", "acc"): "die", ("n", "acc"): "das"})
_INDEF = {("m", "nom"): "ein", ("f", "nom"): "eine", ("n", "nom"): "ein"}
_INDEF.update({("m", "acc"): "einen", ("f", "acc"): "eine", ("n", "acc"): "ein"})
_ADJ_END = {("def", "nom"): "e", ("def", "acc"): {"m": "en", "f": "e", "n": "e"}}
_ADJ_END.update(
    {("indef", "nom"): {"m": "er", "f": "e", "n": "es"}, ("indef", "acc"): {"m": "en", "f": "e", "n": "es"}}
)


@dataclass
class Pair:
    """One sentence pair: words on both sides and its gold links (0-indexed, word level)."""

    source: list[str]
    target: list[str]
    sure: set[tuple[int, int]] = field(default_factory=set)
    possible: set[tuple[int, int]] = field(default_factory=set)  # includes every sure link

    def pharaoh(self) -> str:
        """The gold links as one talp line: ``i-j`` sure, ``ipj`` possible-only, 0-indexed."""
        links = [f"{i}-{j}" for i, j in sorted(self.sure)]
        links += [f"{i}p{j}" for i, j in sorted(self.possible - self.sure)]
        return " ".join(links)


class _Builder:
    """Collects words on both sides, each tagged with the abstract slot it realises."""

    def __init__(self):
        self.src: list[tuple[str, str]] = []  # (word, slot)
        self.tgt: list[tuple[str, str]] = []
        self.maybe: list[tuple[str, str]] = []  # (source slot, target slot) possible-only links

    def pair(self) -> Pair:
        sure = {
            (i, j) for i, (_, a) in enumerate(self.src) for j, (_, b) in enumerate(self.tgt) if a == b and a
        }
        possible = set(sure)
        for a, b in self.maybe:
            possible |= {
                (i, j)
                for i, (_, x) in enumerate(self.src)
                if x == a
                for j, (_, y) in enumerate(self.tgt)
                if y == b
            }
        return Pair([w for w, _ in self.src], [w for w, _ in self.tgt], sure, possible)


def _np(rng: random.Random, b: _Builder, slot: str, case: str, *, objects: bool) -> None:
    """A noun phrase: article, optional adjective, noun or compound, realised on both sides."""
    definite = rng.random() < 0.7
    if not objects or rng.random() < 0.75:
        de, gender, en = rng.choice(OBJECTS if objects else NOUNS)
        de_en = [en]
    else:
        (h, hen), (t, gender, ten) = rng.choice(COMPOUND_HEADS), rng.choice(COMPOUND_TAILS)
        de, de_en = h + t, [hen, ten]
    art = (_DEF if definite else _INDEF)[(gender, case)]
    b.src.append((art, f"{slot}.art"))
    b.tgt.append(("the" if definite else "a", f"{slot}.art"))
    if rng.random() < 0.35:
        adj, adj_en = rng.choice(ADJECTIVES)
        end = _ADJ_END[("def" if definite else "indef", case)]
        end = end if isinstance(end, str) else end[gender]
        b.src.append((adj + end, f"{slot}.adj"))
        b.tgt.append((adj_en, f"{slot}.adj"))
    b.src.append((de, f"{slot}.n"))
    for w in de_en:
        b.tgt.append((w, f"{slot}.n"))


def _clause(rng: random.Random, b: _Builder, tag: str, *, order: str) -> None:
    """Subject, verb, object (and maybe a frequency adverb) in German `order` (v2 / final / inv)
    and English SVO; `order == "inv"` leaves the verb to the caller's already placed slot."""
    verb, verb_en = rng.choice(VERBS)
    adv = rng.choice(FREQ_ADVERBS) if rng.random() < 0.3 else None
    pron = rng.choice(PRONOUNS) if rng.random() < 0.2 else None

    subj = _Builder()
    if pron:
        subj.src.append((pron[0], f"{tag}.subj"))
        subj.tgt.append((pron[1], f"{tag}.subj"))
    else:
        _np(rng, subj, f"{tag}.subj", "nom", objects=False)
    obj = _Builder()
    _np(rng, obj, f"{tag}.obj", "acc", objects=True)
    v = [(verb, f"{tag}.v")]
    a = [(adv[0], f"{tag}.adv")] if adv else []
    if order == "v2":
        b.src += subj.src + v + a + obj.src
    elif order == "inv":  # a fronted adverbial is already in place: verb, subject, adverb, object
        b.src += v + subj.src + a + obj.src
    else:  # verb-final subordinate clause
        b.src += subj.src + a + obj.src + v
    b.tgt += (
        subj.tgt + ([(adv[1], f"{tag}.adv")] if adv else []) + [(w, f"{tag}.v") for w in verb_en] + obj.tgt
    )


def _predicative(rng: random.Random, b: _Builder) -> None:
    """`er ist lehrer` -> `he is a teacher` (inserted article) or `der hund ist sehr alt`."""
    if rng.random() < 0.5:
        pron, pron_en = rng.choice(PRONOUNS)
        job, job_en = rng.choice(PROFESSIONS)
        b.src += [(pron, "p.subj"), ("ist", "p.v"), (job, "p.n")]
        b.tgt += [(pron_en, "p.subj"), ("is", "p.v"), ("a", "p.a"), (job_en, "p.n")]
        b.maybe.append(("p.n", "p.a"))  # the inserted article has no source word of its own
    else:
        _np(rng, b, "p.subj", "nom", objects=False)
        b.src.append(("ist", "p.v"))
        b.tgt.append(("is", "p.v"))
        if rng.random() < 0.4:
            b.src.append(("sehr", "p.very"))
            b.tgt.append(("very", "p.very"))
        adj, adj_en = rng.choice(ADJECTIVES)
        b.src.append((adj, "p.adj"))
        b.tgt.append((adj_en, "p.adj"))


def _going_home(rng: random.Random, b: _Builder) -> None:
    """`der junge ging nach dem essen nach hause` -> `the boy went home after dinner`."""
    subj = _Builder()
    _np(rng, subj, "g.subj", "nom", objects=False)
    b.src += subj.src + [("ging", "g.v")]
    after = rng.random() < 0.5
    if after:
        b.src += [("nach", "g.after"), ("dem", "g.dem"), ("essen", "g.dinner")]
        b.maybe.append(("g.dem", "g.dinner"))
    b.src += [("nach", "g.nach"), ("hause", "g.home")]
    b.maybe.append(("g.nach", "g.home"))
    b.tgt += subj.tgt + [("went", "g.v"), ("home", "g.home")]
    if after:
        b.tgt += [("after", "g.after"), ("dinner", "g.dinner")]


def sentence(rng: random.Random) -> Pair:
    """One random sentence pair with its gold links."""
    b = _Builder()
    kind = rng.random()
    if kind < 0.15:
        _predicative(rng, b)
    elif kind < 0.27:
        _going_home(rng, b)
    elif kind < 0.5:  # verb-second inversion after a fronted time adverb
        t, t_en = rng.choice(TIME_ADVERBS)
        b.src.append((t, "t"))
        b.tgt.append((t_en, "t"))
        _clause(rng, b, "m", order="inv")
    else:
        _clause(rng, b, "m", order="v2")
    if kind >= 0.27 and rng.random() < 0.45:  # a verb-final subordinate clause
        c, c_en = rng.choice(CONJUNCTIONS)
        b.src.append((c, "c"))
        b.tgt.append((c_en, "c"))
        _clause(rng, b, "s", order="final")
    return b.pair()


def generate(n: int, *, seed: int = 13) -> list[Pair]:
    """`n` sentence pairs, deterministic for a given seed (duplicates are possible)."""
    rng = random.Random(seed)
    return [sentence(rng) for _ in range(n)]


def split(n_train: int = 6000, n_held_out: int = 300, *, seed: int = 13) -> tuple[list[Pair], list[Pair]]:
    """(train, held_out): held-out pairs are distinct from every training pair (by source text)."""
    rng = random.Random(seed)
    held, seen = [], set()
    while len(held) < n_held_out:
        p = sentence(rng)
        key = " ".join(p.source)
        if key not in seen:
            seen.add(key)
            held.append(p)
    train = []
    while len(train) < n_train:
        p = sentence(rng)
        if " ".join(p.source) not in seen:
            train.append(p)
    return train, held


def compounds() -> dict[str, tuple[str, str]]:
    """Every compound the generator makes, mapped to its two source pieces (head, tail)."""
    return {h + t: (h, t) for h, _ in COMPOUND_HEADS for t, _, _ in COMPOUND_TAILS}


def vocabularies() -> tuple[list[str], list[str]]:
    """(source pieces, target words) the generator can produce, sorted; compound tails as ``##tail``."""
    src = {"der", "die", "das", "den", "ein", "eine", "einen", "ist", "sehr", "ging", "nach", "dem", "essen"}
    src |= {"hause"}
    tgt = {"the", "a", "is", "very", "went", "home", "after", "dinner"}
    for de, _, en in NOUNS + OBJECTS:
        src.add(de)
        tgt.add(en)
    for de, en in ADJECTIVES:
        src |= {de} | {de + end for end in ("e", "en", "er", "es")}
        tgt.add(en)
    for de, ens in VERBS:
        src.add(de)
        tgt.update(ens)
    for de, en in FREQ_ADVERBS + TIME_ADVERBS + CONJUNCTIONS + PROFESSIONS + PRONOUNS:
        src.add(de)
        tgt.add(en)
    for h, en in COMPOUND_HEADS:
        src.add(h)
        tgt.add(en)
    for t, _, en in COMPOUND_TAILS:
        src.add("##" + t)
        tgt.add(en)
    return sorted(src), sorted(tgt)
