"""The HTML report host: discovers the sections, builds them in order, renders one ``index.html``.

A section is one module in :mod:`probe.report.sections` (``TITLE``, ``ORDER``, ``build(ctx)``)
plus one template ``templates/sections/<name>.html.j2`` (see probe/report/REPORT_CONTRACT.md). The page is
self-contained: CSS, JavaScript, data and figures are inline, and a Content-Security-Policy
forbids every network request, so it opens from ``file://`` offline.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any

import jinja2
from markupsafe import Markup

from probe.cache import Cache, load
from probe.errors import ProbeError
from probe.files import check_writable_dir, write_text_atomic
from probe.report.context import ReportContext

SECTIONS_PACKAGE = "probe.report.sections"


@dataclass
class Section:
    """A discovered section module: its short ``name`` (module and template name), title and order."""

    name: str
    title: str
    order: float
    module: ModuleType


def discover() -> list[Section]:
    """Every section module in :mod:`probe.report.sections`, sorted by ``ORDER`` then name.

    Modules whose name starts with ``_`` are helpers, not sections. A module missing ``TITLE``,
    ``ORDER`` or ``build`` is a bug in probe and raises ``TypeError``.
    """
    pkg = importlib.import_module(SECTIONS_PACKAGE)
    found = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{SECTIONS_PACKAGE}.{info.name}")
        missing = [a for a in ("TITLE", "ORDER", "build") if not hasattr(mod, a)]
        if missing:
            raise TypeError(f"report section {mod.__name__} lacks {', '.join(missing)}")
        found.append(Section(info.name, str(mod.TITLE), float(mod.ORDER), mod))
    return sorted(found, key=lambda s: (s.order, s.name))


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("probe.report", "templates"),
        autoescape=True,  # every template, whatever its file name
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["json"] = lambda obj: Markup(_safe_json(obj))
    return env


def _safe_json(obj: Any) -> str:
    from probe.report.context import safe_json

    return safe_json(obj)


def _static(name: str) -> str:
    return resources.files("probe.report").joinpath("static", name).read_text(encoding="utf-8")


def _as_caches(cache_or_caches: Any) -> list[Cache]:
    items = cache_or_caches if isinstance(cache_or_caches, (list, tuple)) else [cache_or_caches]
    caches = []
    for c in items:
        if isinstance(c, Cache):
            caches.append(c)
        elif isinstance(c, (str, os.PathLike)):
            caches.append(load(c))
        else:
            raise ProbeError(
                f"probe.report takes a probe.Cache or a cache file path (or a list of them), "
                f"not {type(c).__name__}"
            )
    if not caches:
        raise ProbeError("probe.report got no caches; give at least one probe.Cache or cache file")
    return caches


def render(ctx: ReportContext, sections: list[Section] | None = None, *, bar: Any = None) -> str:
    """The report's HTML text for ``ctx``: every applicable section, in order, with a contents list.

    A section whose ``build`` raises :class:`ProbeError` appears as a short note; any other
    exception propagates.
    """
    sections = discover() if sections is None else sections
    env = _environment()
    rendered = []
    for sec in sections:
        if bar is not None:
            bar.set_postfix_str(sec.title)
        try:
            data = sec.module.build(ctx)
        except ProbeError as e:
            rendered.append({"name": sec.name, "title": sec.title, "note": str(e), "html": ""})
        else:
            if data is not None:
                body = env.get_template(f"sections/{sec.name}.html.j2").render(s=data, ctx=ctx)
                rendered.append({"name": sec.name, "title": sec.title, "note": None, "html": Markup(body)})
        if bar is not None:
            bar.update(1)
    from probe.report.labels import model_title

    meta = ctx.cache.metadata
    model = model_title(str((meta.get("model") or {}).get("name") or "model"))
    from probe.report.fonts import css_font_face

    # the CJK characters the page shows, drawn from the font probe ships where the system has none
    shown = "".join(f"{r['title']}{r['note'] or ''}{r['html']}" for r in rendered)
    return env.get_template("base.html.j2").render(
        title=f"probe report: {model}",
        sections=rendered,
        css=Markup(css_font_face(shown) + "\n" + _static("report.css")),
        js=Markup(_static("report.js")),
        version=_version(),
    )


def _version() -> str:
    from probe.version import __version__

    return __version__


def check_report_dir(out_dir: str | os.PathLike) -> Path:
    """``out_dir`` as a Path when a report can be written there; else a one-line :class:`ProbeError`
    (a file, a file on the way, no permission), raised before any work is done."""
    return check_writable_dir(out_dir, "index.html", "the report (index.html goes inside)")


def _interventions(importance: Any, patching: Any) -> dict[str, Any]:
    """``importance=`` and ``patching=`` of :func:`report` as results (files read, and refused with
    a one-line :class:`ProbeError`, before any section runs)."""
    from probe.analysis.interventions import HeadImportance, Patching, load_result

    def one(x: Any, cls: type, arg: str) -> Any:
        r = load_result(x) if isinstance(x, (str, os.PathLike)) else x
        if not isinstance(r, cls):
            raise ProbeError(f"{arg}= takes a probe.{cls.__name__} or the JSON file its save() wrote")
        return r

    out: dict[str, Any] = {}
    if importance is not None:
        out["importance"] = one(importance, HeadImportance, "importance")
    if patching is not None:
        items = patching if isinstance(patching, (list, tuple)) else [patching]
        out["patching"] = [one(p, Patching, "patching") for p in items]
    return out


def report(
    cache_or_caches: Any,
    out_dir: str | os.PathLike,
    *,
    model: Any = None,
    tokenizer: Any = None,
    progress: bool = True,
    gold: Any = None,
    tutorial: Any = None,
    importance: Any = None,
    patching: Any = None,
    circuit: Any = None,
    circuit_curve: Any = None,
) -> Path:
    """Write a self-contained HTML report of ``cache_or_caches`` to ``out_dir/index.html``.

    ``cache_or_caches`` is a :class:`probe.Cache`, a cache file path, or a list of them; ``model``
    and ``tokenizer`` are passed to sections that can use them (e.g. to run an analysis). ``gold``:
    gold word alignments of the cached sentence pairs for the alignment section (a Pharaoh/talp
    file or text, 0-indexed, or a list of :class:`probe.analysis.alignment.Gold`, e.g. from
    ``read_gold(path, one_indexed=True)``): its heatmap then marks them and its map shows AER.
    ``tutorial``: for a zoo model that re-creates a tutorial, a cache of it on the tutorial's text
    (or ``probe.plot.seed_caches()``'s dict) for the tutorial's own figures; the report never
    captures, and without it uses its first cache when that is the tutorial's text.
    ``importance``: a :class:`probe.HeadImportance` (or the JSON file its ``save`` wrote) for the
    section "Which heads matter"; ``patching``: a :class:`probe.Patching`, a saved one, or a list of
    them, shown there as maps. ``circuit``: a :func:`probe.circuit` result, a circuit chosen from it
    (``c.greedy(8)``) or the JSON file ``c.to_json(path)`` wrote, for the section "Circuit" (the
    graph, the faithfulness curve, the edges); ``circuit_curve``: its ``c.evaluate([...])`` (else
    computed here when the result still has its model). The file is
    written atomically; returns its path. ``progress`` shows a tqdm bar on stderr.
    """
    from tqdm import tqdm

    results: dict[str, Any] = {}
    if gold is not None:  # read (and refused) before any section runs
        from probe.analysis.alignment.gold import as_gold
        from probe.report.sections.audio import timings_of

        if timings_of(gold) is not None:  # word timings of an audio cache, per input
            results["audio_gold"] = timings_of(gold)
        else:
            results["alignment_gold"] = as_gold(gold)
    if tutorial is not None:
        # a Cache is itself a Mapping (of tensors): test for it first
        given = (
            [tutorial]
            if isinstance(tutorial, Cache) or not isinstance(tutorial, Mapping)
            else tutorial.values()
        )
        if not all(isinstance(c, Cache) for c in given):
            raise ProbeError(
                "tutorial= takes a probe.Cache captured on the tutorial's text, or the dict "
                "probe.plot.seed_caches() returns"
            )
        results["tutorial"] = tutorial
    results.update(_interventions(importance, patching))
    caches = _as_caches(cache_or_caches)
    out = check_report_dir(out_dir)
    if circuit is not None or circuit_curve is not None:  # read (and refused), its curve run, first
        from probe.report.sections.circuit import circuit_input

        results["circuit"] = circuit_input(circuit, circuit_curve)
    sections = discover()
    with tqdm(total=len(sections) + 1, desc="report", unit="step", disable=not progress) as bar:

        def on_progress(text: str) -> None:
            bar.total += 1
            bar.set_postfix_str(text)
            bar.update(1)

        ctx = ReportContext(
            caches=caches, model=model, tokenizer=tokenizer, results=results, on_progress=on_progress
        )
        text = render(ctx, sections, bar=bar)
        bar.set_postfix_str("writing")
        path = write_text_atomic(out / "index.html", text)
        bar.update(1)
    return path


__all__ = ["report", "render", "discover", "Section"]
