"""The house's map holds: capture -> cache -> analysis -> report, no back imports, short functions.

Oracle: the import statements and function spans read from the source with :mod:`ast`, not from
probe at run time. Imports inside functions count too (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

PROBE = Path(__file__).resolve().parent.parent / "probe"

# package -> the probe packages it must never import
FORBIDDEN = {
    "cache": {"capture", "analysis", "report", "cli", "corpus", "export", "explore"},
    "capture": {"analysis", "report", "cli", "corpus", "export", "explore"},
    # analysis: model calls go through probe.forward
    "analysis": {"capture", "intervene", "report", "cli", "corpus", "export", "explore"},
    "report": {"capture", "intervene", "cli", "corpus", "explore"},  # reads caches and analysis results only
    # probe serve's app: reads corpus runs, caches, analyses and the report; only cli imports it
    "explore": {"capture", "intervene", "cli", "export"},
}
# (file, package) imports that are meant: Cache.to_bertviz()/to_circuitsvis() are conveniences the
# issue asked for, delegating lazily to probe.export (no cycle when modules load)
ALLOWED = {("cache/queries.py", "export")}
MAX_FUNCTION_LINES = 80


def _sources():
    return sorted(PROBE.rglob("*.py"))


def _imported(source: str, relpath: str) -> list[tuple[str, int]]:
    """Every ``probe...`` name the module at ``relpath`` (under probe/) imports, with its line
    (a ``from x import y`` gives ``x`` and ``x.y``)."""
    module = ["probe", *Path(relpath).with_suffix("").parts]
    if module[-1] == "__init__":
        module = module[:-1] + ["_"]  # relative imports resolve against the package itself
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = module[: -node.level] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            out.append((name, node.lineno))
            out += [(f"{name}.{a.name}", node.lineno) for a in node.names]
    return [(n, line) for n, line in out if n.split(".")[0] == "probe"]


def test_no_back_imports():
    bad = []
    for path in _sources():
        parts = path.relative_to(PROBE).parts
        if len(parts) < 2 or parts[0] not in FORBIDDEN:
            continue
        rel = "/".join(parts)
        for name, line in _imported(path.read_text(encoding="utf-8"), rel):
            target = name.split(".")[1] if name.count(".") else ""
            if target in FORBIDDEN[parts[0]] and (rel, target) not in ALLOWED:
                bad.append(f"probe/{'/'.join(parts)}:{line} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_back_imports():
    # the oracle itself, on written sources: lazy, absolute and relative imports are all seen
    lazy = _imported("def f():\n    from probe.capture import capture\n", "analysis/x.py")
    assert ("probe.capture.capture", 2) in lazy
    assert ("probe.capture", 1) in _imported("from ...capture import engine\n", "analysis/focus/x.py")
    assert ("probe.report.figures", 1) in _imported("import probe.report.figures\n", "cache/x.py")


def test_no_function_over_80_lines():
    long = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"probe/{path.relative_to(PROBE)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "split these into named steps:\n" + "\n".join(long)
