"""Reports: figures (``probe.plot``, PNG/SVG/PDF via matplotlib) and one self-contained HTML report.

Reads caches and analysis results only; never imports :mod:`probe.capture`.

``probe.report`` is both this package and the function that writes a report: the package module
is made callable (``probe.report(cache, "out/")`` calls :func:`probe.report.html.report`), so
``import probe.report.figures`` and ``probe.report.sections`` keep working beside the call.
"""

from __future__ import annotations

import sys
import types


class _CallableModule(types.ModuleType):
    def __call__(self, cache_or_caches, out_dir, **kwargs):
        """``probe.report(cache_or_caches, out_dir, *, model=None, tokenizer=None) -> Path``.

        Writes ``out_dir/index.html`` (see :func:`probe.report.html.report`).
        """
        from probe.report.html import report

        return report(cache_or_caches, out_dir, **kwargs)


# Module __class__ assignment is supported by Python (3.5+) for exactly this kind of use.
sys.modules[__name__].__class__ = _CallableModule
