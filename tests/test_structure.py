"""The house's map holds: stages import one way, no import circle, no borrowed private names,
short functions and classes.

Oracle: the import statements, attribute reads and spans read from the source text with :mod:`ast`,
never from probe at run time. Every import counts: at module level, inside a function (a lazy
import is still a dependency) and under ``if TYPE_CHECKING:`` (a type is a dependency too).

The rules, as checked here:

- **Stages.** The top-level folders and modules of probe/ stand on the lines of ``LAYERS`` (the
  figure of docs/architecture.md): each imports only names on lines below its own (``files``
  importing ``errors`` the one pair on a line). A module under ``probe/<stage>/`` never imports a
  stage listed in ``FORBIDDEN`` for it (capture -> cache -> analysis -> intervene -> report;
  corpus, export, explore and cli beside them), nor the package face ``probe/__init__.py`` (it
  imports every stage), except the pairs in ``ALLOWED``. ``errors``, ``files``, ``interrupt`` and
  ``version`` are the floor: they import only each other.
- **No circle.** The graph of probe's modules has no cycle. An edge ``a -> b`` is an import in
  ``a`` that loads ``b``: ``import probe.x.b``, ``from probe.x import b`` when ``b`` is a module,
  else ``from probe.x.b import name`` (``b`` a module, or a package's ``__init__``), plus the
  packages' ``__init__`` run on the way to ``b`` that are not ``a``'s own packages (importing
  ``probe.p.q.r`` from outside ``probe.p`` runs ``probe/p/__init__.py`` and
  ``probe/p/q/__init__.py`` first). The imports that probe makes with
  :func:`importlib.import_module` (plugins found in a folder) are edges too, declared in
  ``DYNAMIC``; a module that calls ``import_module`` and is not declared there fails the test.
- **No borrowed private names.** A private name is one with a leading underscore that is not a
  dunder (``_stack``; ``__version__`` is public). A module never takes a private name from
  another module, neither by ``from m import _name`` nor by reading ``m._name`` off an imported
  module, unless that other module is **the same package's helper**: a module whose own file
  name starts with ``_`` (``probe/report/sections/_image_hover.py``), read from a module in the
  same folder (``probe/report/sections/images.py``; the folder's ``__init__.py`` included,
  subfolders not). A helper module is private to its folder: importing it, or any name from it,
  from another folder counts as taking a private name. A package's ``__init__.py`` is its public
  face, never a helper. Importing a public name under a private alias (``import x as _x``) is fine.
- **Sizes.** No function over 80 lines, no class over 250 lines (a longer one is two ideas).
- **The map.** Every module of probe/ is named in the first cell of a table row of
  docs/architecture.md (its path under probe/, a folder ``x/`` naming ``x/__init__.py``), exactly
  once, or, under probe/capture/, of docs/architecture-capture.md (its path under probe/capture/; a
  bare file name after a path in the same cell is in that path's folder); no row names a module
  that is not there.
"""

from __future__ import annotations

import ast
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

PROBE = Path(__file__).resolve().parent.parent / "probe"

# package -> the probe packages it must never import
FORBIDDEN = {
    "cache": {"capture", "analysis", "intervene", "report", "cli", "corpus", "export", "explore"},
    "capture": {"analysis", "intervene", "report", "cli", "corpus", "export", "explore"},
    # analysis: model calls go through probe.forward
    "analysis": {"capture", "intervene", "report", "cli", "corpus", "export", "explore"},
    # intervene runs the model and reads analyses; what it finds is drawn by report, run by cli
    "intervene": {"report", "cli", "corpus", "export", "explore"},
    "report": {"capture", "intervene", "cli", "corpus", "explore"},  # reads caches and analysis results only
    "corpus": {"intervene", "report", "cli", "export", "explore"},  # runs captures over many texts
    "export": {"capture", "analysis", "intervene", "report", "cli", "corpus", "explore"},  # converts caches
    # probe serve's app: reads corpus runs, caches, analyses and the report; only cli imports it
    "explore": {"capture", "intervene", "cli", "export"},
}
# the figure of docs/architecture.md, top to bottom: a name imports only names on lines below it
LAYERS = [
    {"__main__"},
    {"cli"},
    {"__init__"},
    {"explore", "plot"},
    {"report", "corpus", "intervene", "generation"},
    {"entry"},
    {"analysis", "export"},
    {"forward"},
    {"capture"},
    {"cache"},
    {"errors", "files", "interrupt", "version"},
]
BESIDE = {("files", "errors")}  # the one import between names on one line
# the modules at the bottom: they import nothing of probe but each other
FLOOR = {"errors", "files", "interrupt", "version"}
# the packages that never import the face probe/__init__.py (it imports every stage)
NO_FACE = set(FORBIDDEN)
# (file, package) imports that are meant despite FORBIDDEN: none now (Cache.to_bertviz() reads
# probe/cache/viewers.py, which probe.export re-exports)
ALLOWED: set[tuple[str, str]] = set()
# modules that import others by name at run time (importlib.import_module) -> what they load;
# "pkg.*" is every module and subpackage directly in pkg's folder
DYNAMIC = {
    "probe": ("probe.plot",),  # probe.plot on first use (module __getattr__)
    "probe.capture.layouts": ("probe.capture.layouts.*",),  # every layout file
    "probe.report.html": ("probe.report.sections.*",),  # every report section
    "probe.analysis.focus.backends.registry": ("probe.analysis.focus.backends.*",),  # every backend
}
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 250


def _module_name(relpath: str) -> str:
    """``analysis/focus/x.py`` -> ``probe.analysis.focus.x``; ``cache/__init__.py`` -> ``probe.cache``."""
    parts = ["probe", *Path(relpath).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _tree() -> dict[str, str]:
    """Every module of probe/ -> its path relative to probe/ (``probe.cache`` -> ``cache/__init__.py``)."""
    return {
        _module_name(p.relative_to(PROBE).as_posix()): p.relative_to(PROBE).as_posix()
        for p in sorted(PROBE.rglob("*.py"))
    }


MODULES = _tree()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _folder(module: str, modules: dict[str, str]) -> str:
    """The package whose folder holds ``module``'s file (a package's face: the package itself)."""
    return module if modules[module].endswith("__init__.py") else module.rpartition(".")[0]


@dataclass(frozen=True)
class Import:
    """``module`` (the importer) loads ``target`` (a probe module) at ``line`` and takes ``name``
    from it (None: the module itself), by an import statement or (``read=True``) an attribute read
    ``target.name`` on a module it imported."""

    module: str
    target: str
    name: str | None
    line: int
    read: bool = False


def _as_module(dotted: str, modules: dict[str, str]) -> str:
    """The longest leading part of ``dotted`` that is a module (``dotted`` itself if none is)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return dotted


def _imports(source: str, relpath: str, modules: dict[str, str] | None = None) -> list[Import]:
    """Every import of a probe module in the module at ``relpath`` (under probe/), wherever it
    stands, and every private attribute read off an imported probe module."""
    modules = MODULES if modules is None else modules
    me = _module_name(relpath)
    package = me.split(".") if relpath.endswith("__init__.py") else me.split(".")[:-1]
    out: list[Import] = []
    bound: dict[str, str] = {}  # a name in this module -> the probe module it is
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "probe":
                    out.append(Import(me, _as_module(a.name, modules), None, node.lineno))
                    bound[a.asname or "probe"] = a.name if a.asname else "probe"
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            source_module = ".".join(base + ([node.module] if node.module else []))
            if source_module.split(".")[0] != "probe":
                continue
            for a in node.names:
                full = f"{source_module}.{a.name}"
                if full in modules:
                    out.append(Import(me, full, None, node.lineno))
                    bound[a.asname or a.name] = full
                else:
                    out.append(Import(me, _as_module(source_module, modules), a.name, node.lineno))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = []
            while isinstance(node, ast.Attribute):
                chain.append(node.attr)
                node = node.value
            if not (isinstance(node, ast.Name) and node.id in bound):
                continue
            target = bound[node.id]
            for attr in reversed(chain):
                if _is_private(attr):
                    out.append(Import(me, target, attr, node.lineno, read=True))
                    break
                if f"{target}.{attr}" not in modules:
                    break
                target = f"{target}.{attr}"
    return out


def _all_imports() -> list[Import]:
    return [i for rel in MODULES.values() for i in _imports((PROBE / rel).read_text(encoding="utf-8"), rel)]


def _where(i: Import, modules: dict[str, str] | None = None) -> str:
    return f"probe/{(MODULES if modules is None else modules)[i.module]}:{i.line}"


# ---- stages


def _stage(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def _stage_breaks(imports: list[Import], modules: dict[str, str]) -> list[str]:
    bad = []
    for i in imports:
        rel, src, dst = modules[i.module], _stage(i.module), _stage(i.target)
        what = i.target + (f".{i.name}" if i.name else "")
        if src in FORBIDDEN and dst in FORBIDDEN[src] and (rel, dst) not in ALLOWED:
            bad.append(f"{_where(i, modules)} imports {what}: {src} never imports {dst}")
        elif src in NO_FACE and i.target == "probe" and not i.read:
            bad.append(
                f"{_where(i, modules)} imports the package face probe/__init__.py ({what}), which "
                f"imports every stage: import the module that defines what it uses"
            )
        elif src in FLOOR and dst not in FLOOR:
            bad.append(f"{_where(i, modules)} imports {what}: {src} is at the floor ({sorted(FLOOR)})")
    return bad


def test_no_back_imports():
    bad = _stage_breaks(_all_imports(), MODULES)
    assert not bad, "\n".join(bad)


def test_the_checker_sees_back_imports():
    # the oracle itself, on written sources: lazy, absolute and relative imports are all seen
    lazy = _imports("def f():\n    from probe.capture import capture\n", "analysis/x.py")
    assert Import("probe.analysis.x", "probe.capture", "capture", 2) in lazy
    up = _imports("from ...capture import engine\n", "analysis/focus/x.py")
    assert [i.target for i in up] == ["probe.capture.engine"]
    plain = _imports("import probe.report.figures\n", "cache/x.py")
    assert [i.target for i in plain] == ["probe.report.figures"]
    modules = {**MODULES, "probe.analysis.x": "analysis/x.py", "probe.cache.x": "cache/x.py"}
    assert len(_stage_breaks(lazy + plain, modules)) == 2
    face = _imports("def f():\n    import probe\n    return probe.head_stats\n", "report/x.py")
    assert _stage_breaks(face, {**modules, "probe.report.x": "report/x.py"})
    floor = _imports("from probe.cache import Cache\n", "errors.py")
    assert _stage_breaks(floor, MODULES)


def _top(module: str) -> str:
    """The name of ``module``'s line in LAYERS: its top-level folder or module (the face: __init__)."""
    return module.split(".")[1] if module.count(".") else "__init__"


def _layer_breaks(imports: list[Import], modules: dict[str, str]) -> list[str]:
    line = {name: n for n, names in enumerate(LAYERS) for name in names}
    bad, unplaced = [], set()
    for i in imports:
        src, dst = _top(i.module), _top(i.target)
        unplaced |= {name for name in (src, dst) if name not in line}
        if i.read or src == dst or src not in line or dst not in line or (src, dst) in BESIDE:
            continue
        if line[dst] <= line[src]:
            where = "beside it" if line[dst] == line[src] else "above it"
            bad.append(
                f"{_where(i, modules)} imports {i.target}: {dst} stands {where}, "
                f"{src} imports only lower lines"
            )
    bad += [
        f"probe/{name} is on no line of LAYERS: place it there (tests/test_structure.py) and in the "
        "figure of docs/architecture.md"
        for name in sorted(unplaced)
    ]
    return bad


def test_stages_import_downward():
    bad = _layer_breaks(_all_imports(), MODULES)
    unplaced = {_top(m) for m in MODULES} - set().union(*LAYERS)
    bad += [
        f"probe/{name} is on no line of LAYERS: place it there and in docs/architecture.md"
        for name in unplaced
    ]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_upward_imports():
    modules = {
        **MODULES,
        "probe.corpus.x": "corpus/x.py",
        "probe.cache.x": "cache/x.py",
        "probe.serve": "serve.py",
    }
    beside = _layer_breaks(
        _imports("def f():\n    from probe.report import figures\n", "corpus/x.py"), modules
    )
    assert len(beside) == 1 and "report stands beside it, corpus imports only lower lines" in beside[0]
    above = _layer_breaks(_imports("import probe.cli\n", "cache/x.py"), modules)
    assert len(above) == 1 and "cli stands above it" in above[0]
    assert not _layer_breaks(_imports("from probe.errors import ProbeError\n", "files.py"), modules)
    assert _layer_breaks(_imports("from probe.cache import Cache\n", "serve.py"), modules) == [
        "probe/serve is on no line of LAYERS: place it there (tests/test_structure.py) and in the figure of "
        "docs/architecture.md"
    ]


# ---- circles


def _edges(imports: list[Import], modules: dict[str, str]) -> dict[str, dict[str, int]]:
    """module -> {module it loads: the first line that loads it} (see the module docstring)."""
    edges: dict[str, dict[str, int]] = {m: {} for m in modules}
    for i in imports:
        if i.read or i.target not in modules:
            continue
        parts = i.target.split(".")
        own = {".".join(i.module.split(".")[:n]) for n in range(1, i.module.count(".") + 2)}
        # the packages run on the way (not the importer's own: they are running already), then
        # the target itself (even the importer's own package face: what it takes from there)
        on_the_way = [".".join(parts[:n]) for n in range(2, len(parts))]
        for t in [*(t for t in on_the_way if t not in own), i.target]:
            if t != i.module:
                edges[i.module].setdefault(t, i.line)
    for loader, patterns in DYNAMIC.items():
        for pattern in patterns:
            if pattern.endswith(".*"):
                folder = pattern[:-2]
                found = [m for m in modules if m.rpartition(".")[0] == folder]
            else:
                found = [pattern]
            for t in found:
                if loader in modules and t in modules and t != loader:
                    edges[loader].setdefault(t, 0)
    return edges


def _circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest cycle through each strongly connected set of modules (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    group = set()
                    while True:
                        u = stack.pop()
                        on.discard(u)
                        group.add(u)
                        if u == v:
                            break
                    if len(group) > 1:
                        groups.append(group)
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on.add(w)
                work.append((w, iter(edges.get(w, ()))))
            elif w in on:
                low[v] = min(low[v], index[w])
    cycles = []
    for group in groups:
        start = min(group)
        prev: dict[str, str] = {}
        queue = deque([start])
        while queue:
            v = queue.popleft()
            if start in edges[v]:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                cycles.append([start, *reversed(path[:-1]), start])
                break
            for w in edges[v]:
                if w in group and w not in prev and w != start:
                    prev[w] = v
                    queue.append(w)
    return cycles


def _circle_report(cycles: list[list[str]], edges: dict[str, dict[str, int]], modules: dict[str, str]) -> str:
    lines = []
    for cycle in cycles:
        steps = []
        for a, b in zip(cycle[:-1], cycle[1:], strict=True):
            line = edges[a][b]
            how = f"probe/{modules[a]}:{line}" if line else f"probe/{modules[a]} (import_module)"
            steps.append(f"  {how} loads {b}")
        lines.append("import circle:\n" + "\n".join(steps))
    return (
        "\n".join(lines) + "\nbreak each circle: move what both sides need into a module below both (or "
        "into the one imported), so the arrows run one way; an import inside a function or under "
        "TYPE_CHECKING does not break a circle (one circle is shown per tangle of modules: rerun after each)"
    )


def test_no_import_circle():
    edges = _edges(_all_imports(), MODULES)
    cycles = _circles(edges)
    assert not cycles, _circle_report(cycles, edges, MODULES)


def test_dynamic_imports_are_declared():
    # a module that imports by name at run time is an edge the ast cannot see: it must be declared
    calls = {
        m
        for m, rel in MODULES.items()
        if any(
            isinstance(n, ast.Attribute) and n.attr == "import_module"
            for n in ast.walk(ast.parse((PROBE / rel).read_text(encoding="utf-8")))
        )
    }
    assert calls == set(DYNAMIC), (
        f"declare each module that calls importlib.import_module in DYNAMIC (tests/test_structure.py) "
        f"with what it loads: undeclared {sorted(calls - set(DYNAMIC))}, stale {sorted(set(DYNAMIC) - calls)}"
    )


def test_the_checker_sees_circles():
    modules = {
        "probe": "__init__.py",
        "probe.p": "p/__init__.py",
        "probe.p.a": "p/a.py",
        "probe.p.b": "p/b.py",
        "probe.p.c": "p/c.py",
        "probe.q": "q/__init__.py",
        "probe.q.d": "q/d.py",
        "probe.q.e": "q/e.py",
    }
    sources = {
        "p/a.py": "from probe.p.b import x\n",
        "p/b.py": "def f():\n    from . import c\n",  # lazy
        "p/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from probe.p.a import y\n",
        "q/__init__.py": "from probe.q.e import z\n",  # the face imports e ...
        "q/d.py": "import probe.q.e\n",
        "q/e.py": "from probe.p import a\n",
    }
    imports = [i for rel, src in sources.items() for i in _imports(src, rel, modules)]
    edges = _edges(imports, modules)
    assert _circles(edges) == [["probe.p.a", "probe.p.b", "probe.p.c", "probe.p.a"]]
    # without c's import of a, c importing q.d runs q's face, which imports e, which imports a
    imports = [i for i in imports if i.module != "probe.p.c"] + _imports(
        "import probe.q.d\n", "p/c.py", modules
    )
    edges = _edges(imports, modules)
    cycles = _circles(edges)
    assert cycles == [["probe.p.a", "probe.p.b", "probe.p.c", "probe.q", "probe.q.e", "probe.p.a"]]
    assert "probe/p/c.py:1 loads probe.q\n" in _circle_report(cycles, edges, modules)
    # a module taking a name from its own package's face is an edge to that face
    face = _imports(sources["q/__init__.py"], "q/__init__.py", modules)
    face += _imports("from probe.q import z\n", "q/e.py", modules)
    assert _circles(_edges(face, modules)) == [["probe.q", "probe.q.e", "probe.q"]]
    # a module of q importing q's other modules does not run q's face again: no circle
    q_only = _imports("import probe.q.e\n", "q/d.py", modules) + _imports(
        "import probe.q.d\n", "q/e.py", modules
    )
    assert _circles(_edges(q_only, modules)) == [["probe.q.d", "probe.q.e", "probe.q.d"]]
    assert _circles(_edges(_imports("import probe.q.e\n", "q/d.py", modules), modules)) == []


# ---- private names


def _private_breaks(imports: list[Import], modules: dict[str, str]) -> list[str]:
    bad = []
    for i in imports:
        if i.target == i.module:
            continue
        target_folder = i.target.rpartition(".")[0]
        helper = _is_private(i.target.rpartition(".")[2]) and target_folder == _folder(i.module, modules)
        if helper:
            continue
        hidden = [p for p in i.target.split(".") if _is_private(p)]
        name = i.name if i.name and _is_private(i.name) else None
        if not hidden and not name:
            continue
        home = f"probe/{modules.get(i.target, i.target)}"
        if name:
            what = f"{'reads' if i.read else 'imports'} the private {name} of {i.target} ({home})"
        else:
            what = f"imports {i.target} ({home}), a helper private to {target_folder}"
        bad.append(
            f"{_where(i, modules)} {what}: make it public there (drop the underscore, update its users) "
            f"or move it where it belongs (a helper _module.py is shared only within its folder)"
        )
    return bad


def test_no_private_imports():
    bad = _private_breaks(_all_imports(), MODULES)
    assert not bad, "\n".join(bad)


def test_the_checker_sees_private_imports():
    modules = {
        "probe.p": "p/__init__.py",
        "probe.p.a": "p/a.py",
        "probe.p._h": "p/_h.py",
        "probe.p.s": "p/s/__init__.py",
        "probe.p.s.b": "p/s/b.py",
    }
    seen = _private_breaks(_imports("from probe.p.a import _x, y\n", "p/s/b.py", modules), modules)
    assert len(seen) == 1 and "imports the private _x of probe.p.a" in seen[0]
    lazy = "def f():\n    from ..a import _x\n"
    assert _private_breaks(_imports(lazy, "p/s/b.py", modules), modules)
    read = "from probe.p import a\nimport probe.p.a as aa\nimport probe\nf = a._x, aa._y, probe.p.a._z\n"
    assert len(_private_breaks(_imports(read, "p/s/b.py", modules), modules)) == 3
    # the same folder's helper: its private names are for that folder (the face included) ...
    ok = "from probe.p._h import _x\nfrom probe.p import _h\nv = _h._y\n"
    assert not _private_breaks(_imports(ok, "p/a.py", modules), modules)
    assert not _private_breaks(_imports(ok, "p/__init__.py", modules), modules)
    # ... and for no other folder; a package's face is no helper; a private alias is fine
    assert len(_private_breaks(_imports(ok, "p/s/b.py", modules), modules)) == 3
    assert _private_breaks(_imports("from probe.p import _f\n", "p/a.py", modules), modules)
    fine = "from probe.p import a as _a\nfrom probe.p.a import __version__\nv = _a.y\n"
    assert not _private_breaks(_imports(fine, "p/s/b.py", modules), modules)


# ---- sizes


def _spans(kinds: tuple[type, ...], limit: int) -> list[str]:
    long = []
    for rel in MODULES.values():
        for node in ast.walk(ast.parse((PROBE / rel).read_text(encoding="utf-8"))):
            if isinstance(node, kinds):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    long.append(f"probe/{rel}:{node.lineno} {node.name} ({n} lines)")
    return long


def test_no_function_over_80_lines():
    long = _spans((ast.FunctionDef, ast.AsyncFunctionDef), MAX_FUNCTION_LINES)
    assert not long, "split these into named steps:\n" + "\n".join(long)


def test_no_class_over_250_lines():
    long = _spans((ast.ClassDef,), MAX_CLASS_LINES)
    assert not long, "split these by responsibility (a class past 250 lines is two ideas):\n" + "\n".join(
        long
    )


# ---- the map


DOCS = PROBE.parent / "docs"


def _named(page: str, root: str) -> list[tuple[str, int]]:
    """The modules a page names in the first cell of its table rows, as paths under probe/, with
    the line: ``x/y.py``, a folder ``x/`` (its ``__init__.py``), and after a path in the same cell a
    bare ``z.py`` in that path's folder; ``root`` is the folder the page's paths are under."""
    out = []
    for n, text in enumerate(page.splitlines(), 1):
        if not text.startswith("| `"):
            continue
        folder = ""
        for name in re.findall(r"`([^`]+)`", text.split(" | ")[0]):
            if not re.fullmatch(r"[\w/]+(\.py|/)", name):
                continue
            if "/" in name.rstrip("/"):
                folder = name.rstrip("/").rpartition("/")[0] + "/"
            path = name if "/" in name.rstrip("/") else folder + name
            out.append((root + (path + "__init__.py" if path.endswith("/") else path), n))
    return out


def _map_breaks(main: str, capture: str, files: set[str]) -> list[str]:
    bad = []
    named = _named(main, "")
    names = [p for p, _ in named]
    in_capture = {p for p, _ in _named(capture, "capture/")}
    for path, line in named:
        if path not in files:
            bad.append(
                f"docs/architecture.md:{line} names {path}, which is no module of probe/: "
                "rename or remove its row"
            )
        elif path.startswith("capture/"):
            bad.append(
                f"docs/architecture.md:{line} names {path}: "
                "capture's modules are named on architecture-capture.md"
            )
        elif names.count(path) > 1:
            bad.append(f"docs/architecture.md:{line} names {path} again: name each module once")
    for path in sorted(in_capture - files):
        bad.append(
            f"docs/architecture-capture.md names {path}, which is no module of probe/: "
            "rename or remove its row"
        )
    for path in sorted(files):
        if path.startswith("capture/") and path not in in_capture:
            rel = path[len("capture/") :]
            rel = rel[: -len("__init__.py")] if rel.endswith("/__init__.py") else rel
            bad.append(
                f"probe/{path} is not named on docs/architecture-capture.md: add a row | `{rel}` | what "
                "lives there | what it talks to | to the table 'Every module, by room'"
            )
        elif not path.startswith("capture/") and path not in names:
            shown = path[: -len("__init__.py")] if path.endswith("/__init__.py") else path
            bad.append(
                f"probe/{path} is not named on docs/architecture.md: add a row | `{shown}` | what lives "
                "there | to its stage's table under 'Every module, by stage'"
            )
    return bad


def test_the_map_names_every_module_once():
    main = (DOCS / "architecture.md").read_text(encoding="utf-8")
    capture = (DOCS / "architecture-capture.md").read_text(encoding="utf-8")
    bad = _map_breaks(main, capture, set(MODULES.values()))
    assert not bad, "\n".join(bad)


def test_the_checker_sees_what_the_map_leaves_out():
    files = {
        "__init__.py",
        "a/__init__.py",
        "a/b.py",
        "a/c.py",
        "capture/__init__.py",
        "capture/d/e.py",
        "capture/d/f.py",
    }
    main = "| `__init__.py` | face |\n| `a/` | a |\n| `a/b.py` | b |\n"
    main += "| `a/b.py` | b again |\n| `a/x.py` | gone |\n"
    capture = "| `__init__.py` | face |\n| `d/e.py`, `f.py` | e and f |\n"
    assert _map_breaks(main, capture, files) == [
        "docs/architecture.md:3 names a/b.py again: name each module once",
        "docs/architecture.md:4 names a/b.py again: name each module once",
        "docs/architecture.md:5 names a/x.py, which is no module of probe/: rename or remove its row",
        "probe/a/c.py is not named on docs/architecture.md: add a row | `a/c.py` | what lives there | to its "
        "stage's table under 'Every module, by stage'",
    ]
    fixed = main.replace("| `a/b.py` | b again |\n", "").replace("`a/x.py` | gone", "`a/c.py` | c")
    assert _map_breaks(fixed, capture, files) == []
    left_out = _map_breaks(fixed, "| `__init__.py` | face |\n| `d/e.py` | e |\n", files)
    assert len(left_out) == 1 and left_out[0].startswith(
        "probe/capture/d/f.py is not named on docs/architecture-capture.md"
    )
    assert _map_breaks(fixed, capture + "| `d/g.py` | gone |\n", files) == [
        "docs/architecture-capture.md names capture/d/g.py, which is no module of probe/: "
        "rename or remove its row"
    ]


def test_tests_import_their_helpers_as_top_level_modules():
    """tests/ is not a package: `pytest` (not `python -m pytest`) cannot import `tests.x`."""
    bad = []
    for path in sorted((PROBE.parent / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            bad += [f"{path.name}:{node.lineno} {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert not bad, "import the helper by its module name (from hf_fixtures import ...): " + ", ".join(bad)
