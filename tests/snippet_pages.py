"""Extract and run the code snippets of README.md and docs/*.md; compare what they print.

The convention (written for authors in docs/writing-docs.md):

- Every fenced ```python block runs. The blocks of one page run in order in one namespace and one
  temporary working directory, like the cells of a notebook; shell blocks of the page share that
  directory, which links to the checkout's examples/, models/, benchmarks/, tests/ and
  constraints.txt so that commands written for the repository root run as written. A block
  whose only line is ``--8<-- "FILE"`` (pymdownx.snippets) shows FILE and runs it as a script.
- Output of a Python block: a fenced ```text block that directly follows it (blank lines only in
  between) is what the block prints to stdout. A line ``expr  # -> VALUE`` checks ``repr(expr)``
  against VALUE (whitespace runs count as one space).
- Shell: every ```bash / ```console / ```sh / ```shell block runs, and a ```text block does when a
  line starts with ``$ ``. With ``$ `` prompts, the prompt lines are commands (a trailing ``\\``
  continues one) and the lines under a command are its expected output (stdout and stderr
  together); without prompts every line is a command and nothing is compared. A command must exit
  0, unless its trailing comment says ``exit N``.
- ``...`` in an expected line matches any text within the line; a line of just ``...`` matches any
  number of lines.
- Normalised before comparing, nothing else: progress bars (tqdm) are dropped, trailing spaces and
  leading/trailing blank lines ignored, and the page's working directory and probe's model cache
  folder are written ``...``. A float shown on the page (decimal point or exponent) matches a
  printed number within a relative 1e-3 or one unit of its last shown digit; integers exactly.
- ``<!-- no-run -->`` (or ``<!-- no-run: why -->``) on the line before a block skips it: only for
  what cannot run here (apt-get, torchrun across machines).
- A command that is only ``probe ARGS`` (no pipes, redirections or variables) runs in the test
  process through ``probe.cli.main``, the console script's own entry point (set
  ``PROBE_SNIPPETS_SUBPROCESS=1`` to run every command in bash instead); everything else runs in bash
  with this checkout first on ``PYTHONPATH``, offline (``HF_HUB_OFFLINE=1``).
- ``PROBE_SNIPPETS_UPDATE=1`` rewrites every expected block and ``# ->`` value that no longer
  matches from the real run (keeping the ``...`` lines that still match), so drifted output is
  regenerated with one command: ``PROBE_SNIPPETS_UPDATE=1 pytest tests/test_snippets.py``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHELL_LANGS = {"bash", "console", "sh", "shell"}
OUTPUT_LANGS = {"text", ""}
NO_RUN = re.compile(r"^<!--\s*no-run(?::.*)?\s*-->$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
PROGRESS = re.compile(r"\d+%\|.*\||\d+\w*\s*\[\d\d:\d\d|\bit/s\]|\?\w*/s[,\]]")
ARROW = "# -> "
INCLUDE = re.compile(r'^\s*-{2}8<-{2}\s+"([^"]+)"\s*$')  # pymdownx.snippets: a file shown in a block
# what the working directory links to, so commands written for the repository root run as written
LINKED = ("examples", "models", "benchmarks", "tests", "constraints.txt", "pyproject.toml")
SHELL_META = {"|", "||", "&", "&&", ";", ">", ">>", "<", "<<", "(", ")"}


def update_mode() -> bool:
    return os.environ.get("PROBE_SNIPPETS_UPDATE", "") not in ("", "0")


# -- extraction --------------------------------------------------------------------------------------------
@dataclass
class Block:
    """One fenced block: its language, its body lines (indent removed) and where they sit (0-based)."""

    lang: str
    lines: list[str]
    first: int  # index of the first body line in the file
    fence_line: int  # index of the opening fence
    indent: str
    no_run: str | None = None  # the marker's text, when the line before says no-run


@dataclass
class Command:
    code: str  # the command (continuations joined), prompt removed
    line: int  # 1-based line in the file
    expected: list[str] | None  # lines shown under it, None when none are
    span: tuple[int, int] | None  # where those lines sit in the file (0-based, end exclusive)
    exit: int = 0


@dataclass
class Snippet:
    path: Path
    line: int  # 1-based line of the opening fence
    kind: str  # "python" or "shell"
    code: str = ""
    indent: str = ""
    body_first: int = 0  # 0-based index of the first code line in the file
    expected: list[str] | None = None  # python: the output block's lines
    span: tuple[int, int] | None = None  # python: the output block's body lines in the file
    commands: list[Command] = field(default_factory=list)
    skip: str | None = None
    source: Path | None = None  # the file a block shows with --8<-- "FILE" (then its code is that file)

    @property
    def id(self) -> str:
        return f"{_rel(self.path)}:{self.line}"


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def blocks(lines: list[str]) -> list[Block]:
    """Every fenced block of a Markdown file, in order."""
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        lang = m["info"].strip().split()[0].lower() if m["info"].strip() else ""
        j = i + 1
        while j < len(lines):
            s = lines[j].strip()
            if s.startswith(fence[0] * len(fence)) and set(s) == {fence[0]}:
                break
            j += 1
        body = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1 : j]]
        prev = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = prev if NO_RUN.match(prev) else None
        out.append(Block(lang, body, i + 1, i, indent, marker))
        i = j + 1
    return out


def _adjacent(lines: list[str], a: Block, b: Block) -> bool:
    """True when only blank lines separate block a's closing fence from block b's opening fence."""
    end = a.first + len(a.lines)  # a's closing fence
    return all(not lines[k].strip() for k in range(end + 1, b.fence_line))


def _shell_commands(block: Block) -> list[Command]:
    body = block.lines
    prompted = any(ln.startswith("$ ") or ln == "$" for ln in body)
    cmds: list[Command] = []
    i = 0
    while i < len(body):
        ln = body[i]
        if prompted and not (ln.startswith("$ ") or ln == "$"):
            i += 1
            continue
        if not prompted and (not ln.strip() or ln.lstrip().startswith("#")):
            i += 1
            continue
        start = i
        code = ln[2:] if prompted else ln
        while code.rstrip().endswith("\\") and i + 1 < len(body):
            i += 1
            code = code.rstrip()[:-1] + " " + body[i].strip()
        i += 1
        expected, span = None, None
        if prompted:
            j = i
            while j < len(body) and not (body[j].startswith("$ ") or body[j] == "$"):
                j += 1
            if j > i:
                expected, span = body[i:j], (block.first + i, block.first + j)
            i = j
        _, comment = split_comment(code)
        m = re.search(r"\bexit (\d+)\b", comment)
        cmds.append(Command(code.strip(), block.first + start + 1, expected, span, int(m[1]) if m else 0))
    return cmds


def extract(path: Path) -> list[Snippet]:
    """The runnable snippets of one Markdown file, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    bs = blocks(lines)
    out: list[Snippet] = []
    used: set[int] = set()
    for n, b in enumerate(bs):
        if n in used:
            continue
        snip = Snippet(path, b.fence_line + 1, "", indent=b.indent, body_first=b.first)
        if b.no_run:
            snip.skip = b.no_run
        if b.lang == "python":
            snip.kind, snip.code = "python", "\n".join(b.lines)
            included = [INCLUDE.match(ln) for ln in b.lines if ln.strip()]
            if len(included) == 1 and included[0]:
                snip.source = ROOT / included[0][1]
                snip.code = snip.source.read_text(encoding="utf-8")
            nxt = bs[n + 1] if n + 1 < len(bs) else None
            if nxt and nxt.lang in OUTPUT_LANGS and _adjacent(lines, b, nxt):
                if not any(ln.startswith("$ ") for ln in nxt.lines):
                    snip.expected, snip.span = nxt.lines, (nxt.first, nxt.first + len(nxt.lines))
                    used.add(n + 1)
        elif b.lang in SHELL_LANGS or (b.lang in OUTPUT_LANGS and any(ln.startswith("$ ") for ln in b.lines)):
            snip.kind, snip.commands = "shell", _shell_commands(b)
        else:
            continue
        out.append(snip)
    return out


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/, in a fixed order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


# -- comparison --------------------------------------------------------------------------------------------
def normalise(text: str, replace: dict[str, str]) -> list[str]:
    """Text as lines: progress bars dropped, trailing space stripped, blank ends removed, paths masked."""
    for old, new in sorted(replace.items(), key=lambda kv: -len(kv[0])):
        if old:
            text = text.replace(old, new)
    out = []
    for ln in text.split("\n"):
        segs = [s for s in ln.split("\r") if s.strip()]
        keep = [s for s in segs if not PROGRESS.search(s)]
        if segs and not keep:
            continue  # a line that only drew a progress bar
        out.append((keep[-1] if keep else "").rstrip())
    while out and not out[0]:
        out.pop(0)
    while out and not out[-1]:
        out.pop()
    return out


# A number shown with a decimal point or an exponent (not a part of a version such as 0.1.0): it
# matches a printed number within REL_TOL of it, or within one unit of its last shown digit (float32
# results differ in their last digits between machines: CPU kernels, thread counts). Integers,
# counts and sizes in bytes, must match exactly.
SHOWN_FLOAT = re.compile(r"(?<![\d.])[-+]?(?:\d+\.\d+(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)(?![\d.])")
ANY_NUMBER = r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)"
REL_TOL = 1e-3


def _line_regex(line: str, shown: list[str] | None = None) -> str:
    """A regex for one expected line (``...`` matches any text); with ``shown``, each float on the
    line becomes a group matching any number and is appended to ``shown``."""
    parts = []
    for part in line.rstrip().split("..."):
        if shown is None:
            parts.append(re.escape(part))
            continue
        pieces, pos = [], 0
        for m in SHOWN_FLOAT.finditer(part):
            pieces += [re.escape(part[pos : m.start()]), ANY_NUMBER]
            shown.append(m.group())
            pos = m.end()
        parts.append("".join(pieces) + re.escape(part[pos:]))
    return ".*?".join(parts)


def close(shown: str, printed: str) -> bool:
    """Whether a printed number agrees with the float a page shows (see SHOWN_FLOAT)."""
    mantissa = re.split("[eE]", shown)[0]
    digits = len(mantissa.split(".")[1]) if "." in mantissa else 0
    exponent = int(re.split("[eE]", shown)[1]) if re.search("[eE]", shown) else 0
    unit = 10.0 ** (exponent - digits)
    a, b = float(shown), float(printed)
    return abs(a - b) <= max(REL_TOL * abs(a), unit * (1 + 1e-9))


def _block_regex(lines: list[str], shown: list[str] | None = None) -> str:
    return "".join("(?:[^\n]*\n)*?" if e.strip() == "..." else _line_regex(e, shown) + "\n" for e in lines)


def _fullmatch(lines: list[str], text: str) -> bool:
    """Match the expected lines against the text: as written, else with its floats within tolerance."""
    if re.fullmatch(_block_regex(lines), text, re.S) is not None:
        return True
    shown: list[str] = []
    pattern = _block_regex(lines, shown)
    m = re.fullmatch(pattern, text, re.S) if shown else None
    return m is not None and all(close(s, p) for s, p in zip(shown, m.groups(), strict=True))


def matches(expected: list[str], actual: list[str]) -> bool:
    """Whether actual lines match the expected ones (``...`` wildcards; a ``...`` line spans lines;
    floats within tolerance, see SHOWN_FLOAT)."""
    exp = [e.rstrip() for e in expected]
    while exp and not exp[0]:
        exp.pop(0)
    while exp and not exp[-1]:
        exp.pop()
    return _fullmatch(exp, "".join(a + "\n" for a in actual))


def same_value(expected: str, actual: str) -> bool:
    squash = " ".join
    return _fullmatch([squash(expected.split())], squash(actual.split()) + "\n")


def regenerate(expected: list[str], actual: list[str]) -> list[str]:
    """The new expected lines: the actual ones, keeping each old ``...`` line that still matches one."""
    new = list(actual)
    start = 0
    for e in expected:
        if "..." not in e or e.strip() == "...":
            continue
        for k in range(start, len(new)):
            if re.fullmatch(_line_regex(e), new[k]):
                new[k], start = e.rstrip(), k + 1
                break
    return new


def diff(expected: list[str], actual: list[str]) -> str:
    import difflib

    return "\n".join(difflib.unified_diff(expected, actual, "shown on the page", "printed", lineterm=""))


def split_comment(code: str) -> tuple[str, str]:
    """(command, trailing comment) of a shell line: the first `` #`` outside quotes starts the comment."""
    quote = None
    for i, ch in enumerate(code):
        if quote:
            if ch == quote:
                quote = None
            elif ch == "\\" and quote == '"':
                continue
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or code[i - 1].isspace()):
            return code[:i].rstrip(), code[i:]
    return code, ""
