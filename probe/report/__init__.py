"""Reports: figures (``probe.plot``, PNG/SVG/PDF via matplotlib) and one self-contained HTML report.

Reads caches and analysis results only; never imports :mod:`probe.capture`.
"""
