"""Run the snippets that tests/snippet_pages.py extracts: one page at a time, in order, in one
namespace and one temporary working directory; compare what they print; in update mode
(``PROBE_SNIPPETS_UPDATE=1``) rewrite the expected output that drifted. The convention is in
tests/snippet_pages.py and docs/writing-docs.md."""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tokenize
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

from snippet_pages import (  # noqa: F401  (re-exported: the test module uses snippets.* only)
    ARROW,
    LINKED,
    ROOT,
    SHELL_META,
    Snippet,
    _rel,
    blocks,
    diff,
    extract,
    matches,
    normalise,
    pages,
    regenerate,
    same_value,
    split_comment,
    update_mode,
)


# -- running -----------------------------------------------------------------------------------------------
class SnippetFailure(AssertionError):
    pass


@dataclass
class Edit:
    path: Path
    start: int  # 0-based, end exclusive: lines replaced
    end: int
    lines: list[str]  # as they go into the file (indent included)


EDITS: list[Edit] = []


def _arrow_comments(code: str) -> dict[int, str]:
    """{1-based line: expected repr} for every ``# -> VALUE`` comment in the block."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.COMMENT and tok.string.startswith(ARROW):
            out[tok.start[0]] = tok.string[len(ARROW) :].strip()
    return out


@contextlib.contextmanager
def _in(workdir: Path, env: dict[str, str]):
    old_cwd, old_env = os.getcwd(), {k: os.environ.get(k) for k in env}
    os.chdir(workdir)
    os.environ.update(env)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.showwarning = warnings._showwarning_orig  # to stderr, as outside pytest
            yield
    finally:
        os.chdir(old_cwd)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Page:
    """The snippets of one page, run in order in one namespace and one working directory."""

    def __init__(self, path: Path, workdir: Path):
        self.path, self.workdir = path, workdir
        self.snippets = extract(path)
        for name in LINKED:
            if (ROOT / name).exists() and not (workdir / name).exists():
                (workdir / name).symlink_to(ROOT / name)
        self.ns: dict = {"__name__": "__main__"}
        self.done = 0
        self.broken: str | None = None

    def env(self) -> dict[str, str]:
        path = os.environ.get("PYTHONPATH", "")
        return {
            "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "MPLBACKEND": "Agg",
            "COLUMNS": "100",
        }

    def masks(self) -> dict[str, str]:
        out = {str(self.workdir): "...", os.path.realpath(self.workdir): "..."}
        cache = os.environ.get("PROBE_CACHE_DIR")
        if cache:
            out[cache] = "..."
        return out

    def run_through(self, index: int) -> None:
        """Run every snippet up to and including `index` that has not run yet; raise on the last."""
        while self.done <= index:
            snip = self.snippets[self.done]
            self.done += 1
            if self.broken:
                raise SnippetSkipped(f"an earlier snippet of this page failed ({self.broken})")
            if snip.skip:
                if self.done - 1 == index:
                    raise SnippetSkipped(f"marked {snip.skip}")
                continue
            try:
                if snip.kind == "python":
                    self.run_python(snip)
                else:
                    self.run_shell(snip)
            except SnippetSkipped:
                raise
            except BaseException:
                self.broken = snip.id
                raise

    # python -------------------------------------------------------------------------------------
    def run_python(self, snip: Snippet) -> None:
        filename = str(snip.source or snip.path)
        tree = ast.parse(snip.code, filename)
        arrows = {} if snip.source else _arrow_comments(snip.code)
        offset = 0 if snip.source else snip.body_first
        ast.increment_lineno(tree, offset)  # tracebacks point into the Markdown file (or the shown file)
        out = io.StringIO()
        problems = []
        argv = sys.argv
        sys.argv = [filename]  # a script shown on the page sees no pytest arguments
        try:
            with _in(self.workdir, self.env()), contextlib.redirect_stdout(out):
                self._exec(tree, snip, filename, offset, arrows, problems)
        finally:
            sys.argv = argv
        if snip.expected is not None:
            actual = normalise(out.getvalue(), self.masks())
            if not matches(snip.expected, actual):
                if update_mode():
                    EDITS.append(
                        Edit(snip.path, *snip.span, _indented(snip, regenerate(snip.expected, actual)))
                    )
                else:
                    problems.append(f"the output differs from the page:\n{diff(snip.expected, actual)}")
        if problems:
            raise SnippetFailure(f"{snip.id}: " + "\n".join(problems))

    def _exec(self, tree, snip: Snippet, filename: str, offset: int, arrows: dict, problems: list) -> None:
        for stmt in tree.body:
            rel = stmt.end_lineno - offset
            if isinstance(stmt, ast.Expr) and rel in arrows:
                value = eval(compile(ast.Expression(stmt.value), filename, "eval"), self.ns)
                problems += self._check_arrow(snip, rel, arrows[rel], repr(value))
            else:
                exec(compile(ast.Module([stmt], []), filename, "exec"), self.ns)

    def _check_arrow(self, snip: Snippet, rel: int, expected: str, actual: str) -> list[str]:
        actual = normalise(actual, self.masks())
        text = " ".join(actual)
        if same_value(expected, text):
            return []
        line = snip.body_first + rel - 1  # 0-based line in the file
        if update_mode() and len(actual) == 1:
            old = snip.path.read_text(encoding="utf-8").splitlines()[line]
            EDITS.append(Edit(snip.path, line, line + 1, [old[: old.index(ARROW) + len(ARROW)] + text]))
            return []
        return [f"line {line + 1}: shown `# -> {expected}`, the value is {text}"]

    # shell --------------------------------------------------------------------------------------
    def run_shell(self, snip: Snippet) -> None:
        problems = []
        for cmd in snip.commands:
            if re.search(r"\b(pip|apt-get|apt)\s+install\b", cmd.code):
                # installing from a page's temporary folder would re-point the editable install
                raise SnippetFailure(
                    f"{snip.id}: line {cmd.line}: `{cmd.code}` installs packages; mark the block "
                    "<!-- no-run: installs packages --> (the set-up commands run in CI as .ci/run)"
                )
            code, output = self.run_command(cmd.code)
            actual = normalise(output, self.masks())
            if code != cmd.exit:
                problems.append(
                    f"line {cmd.line}: `{cmd.code}` exited {code}, expected {cmd.exit}:\n" + "\n".join(actual)
                )
                break
            if cmd.expected is not None and not matches(cmd.expected, actual):
                if update_mode():
                    EDITS.append(
                        Edit(snip.path, *cmd.span, _indented(snip, regenerate(cmd.expected, actual)))
                    )
                else:
                    problems.append(f"line {cmd.line}: `{cmd.code}` printed:\n{diff(cmd.expected, actual)}")
        if problems:
            raise SnippetFailure(f"{snip.id}: " + "\n".join(problems))

    def run_command(self, line: str) -> tuple[int, str]:
        """(exit code, stdout and stderr together) of one shell command."""
        code, _ = split_comment(line)
        argv = _plain_probe(code)
        if argv is not None and not os.environ.get("PROBE_SNIPPETS_SUBPROCESS"):
            return self._in_process(argv)
        env = {**os.environ, **self.env()}
        r = subprocess.run(
            ["bash", "-c", code],
            cwd=self.workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=600,
        )
        return r.returncode, r.stdout

    def _in_process(self, argv: list[str]) -> tuple[int, str]:
        from probe.cli import main

        buf = io.StringIO()
        with _in(self.workdir, self.env()), contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse: --help, usage errors
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:
                traceback.print_exc(file=buf)
                code = 1
        return code, buf.getvalue()


def _indented(snip: Snippet, lines: list[str]) -> list[str]:
    return [snip.indent + ln if ln else ln for ln in lines]


def _plain_probe(code: str) -> list[str] | None:
    """argv after ``probe`` when the command is only ``probe ARGS``; None when it needs a shell."""
    if any(ch in code for ch in "$`*?~{}[]!"):
        return None
    try:
        lex = shlex.shlex(code, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        tokens = list(lex)
    except ValueError:
        return None
    if not tokens or tokens[0] != "probe" or any(t in SHELL_META for t in tokens):
        return None
    return tokens[1:]


class SnippetSkipped(Exception):
    pass


def apply_edits() -> list[str]:
    """Write the pending updates into the pages; returns 'file:line' for each block rewritten."""
    done = []
    by_path: dict[Path, list[Edit]] = {}
    for e in EDITS:
        by_path.setdefault(e.path, []).append(e)
    for path, edits in by_path.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        for e in sorted(edits, key=lambda e: -e.start):
            lines[e.start : e.end] = e.lines
            done.append(f"{_rel(path)}:{e.start + 1}")
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    EDITS.clear()
    return done


if __name__ == "__main__":  # list the snippets: python tests/snippets.py
    for p in pages():
        for s in extract(p):
            print(s.id, s.kind, "(skipped)" if s.skip else "", len(s.commands) or "")
    sys.exit(0)
