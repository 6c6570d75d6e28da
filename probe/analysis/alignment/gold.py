"""Gold word alignments in Pharaoh / talp form, and Pharaoh output.

One line per sentence pair, links separated by spaces: ``i-j`` is a *sure* link between source
word i and target word j, ``ipj`` a *possible* one (the talp convention of the RWTH and Hansards
gold sets). Indices count words (not subword pieces), from 0 by default or from 1 with
``one_indexed=True``. Following Och & Ney (2003), every sure link is also possible: S ⊆ P.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from probe.errors import ProbeError
from probe.files import input_file

Links = set[tuple[int, int]]
_LINK = re.compile(r"^(\d+)([-p])(\d+)$")


@dataclass
class Gold:
    """Gold links of one sentence pair (0-indexed): ``sure`` ⊆ ``possible``."""

    sure: Links = field(default_factory=set)
    possible: Links = field(default_factory=set)

    def __post_init__(self) -> None:
        self.sure = {(int(i), int(j)) for i, j in self.sure}
        self.possible = {(int(i), int(j)) for i, j in self.possible} | self.sure


def parse_gold(text: str, *, one_indexed: bool = False, where: str = "gold") -> list[Gold]:
    """The gold links of every line of ``text`` (an empty line is a pair without links)."""
    out = []
    shift = 1 if one_indexed else 0
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for n, line in enumerate(lines, 1):
        g = Gold()
        for link in line.split():
            m = _LINK.match(link)
            if not m:
                raise ProbeError(
                    f"{where} line {n}: {link!r} is not a link; write i-j (sure) or ipj (possible)"
                )
            i, kind, j = int(m.group(1)) - shift, m.group(2), int(m.group(3)) - shift
            if i < 0 or j < 0:
                raise ProbeError(
                    f"{where} line {n}: {link!r} has index 0 but the file is read 1-indexed; "
                    "drop --one-indexed"
                )
            (g.sure if kind == "-" else g.possible).add((i, j))
        out.append(Gold(g.sure, g.possible))
    return out


def read_gold(path: str | os.PathLike, *, one_indexed: bool = False) -> list[Gold]:
    """:func:`parse_gold` of the file at ``path``."""
    p = input_file(path, "gold file", "give a Pharaoh/talp file (one line per pair)")
    return parse_gold(p.read_text(encoding="utf-8"), one_indexed=one_indexed, where=p.name)


def as_gold(gold, *, one_indexed: bool = False) -> list[Gold]:
    """Gold in any accepted form: a path, talp text (contains a link or newline), a list of
    :class:`Gold`, of ``(sure, possible)`` pairs, or of plain link sets (all sure)."""
    if isinstance(gold, (str, os.PathLike)):
        s = str(gold)
        if isinstance(gold, str) and ("\n" in s or _LINK.match(s.split()[0] if s.split() else "")):
            return parse_gold(s, one_indexed=one_indexed)
        return read_gold(gold, one_indexed=one_indexed)
    out = []
    for g in gold:
        if isinstance(g, Gold):
            out.append(g)
        elif isinstance(g, tuple) and len(g) == 2 and all(isinstance(x, (set, frozenset, list)) for x in g):
            out.append(Gold(set(map(tuple, g[0])), set(map(tuple, g[1]))))
        else:
            out.append(Gold(set(map(tuple, g))))
    return out


def pharaoh(links: Links, *, one_indexed: bool = False) -> str:
    """One Pharaoh line ``i-j i-j ...`` (source-target, sorted by target then source)."""
    s = 1 if one_indexed else 0
    return " ".join(f"{i + s}-{j + s}" for i, j in sorted(links, key=lambda x: (x[1], x[0])))
