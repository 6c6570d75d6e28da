"""Report sections: one module each (``TITLE``, ``ORDER``, ``build(ctx)``) plus one template.

The host (:mod:`probe.report.html`) discovers every module here; names starting with ``_`` are
shared helpers, not sections. See probe/report/REPORT_CONTRACT.md.
"""
