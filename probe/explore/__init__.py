"""The explorer: a corpus run's heads and texts in a local web app (``probe serve RUN_DIR``).

* :mod:`.data`: :class:`~.data.Explorer`, what the pages show, read from the run (its per-text
  store through DuckDB, its merged statistics, its examples; the model when at hand);
* :mod:`.views`: grids, histograms and marked texts as plain data for the templates;
* :mod:`.app`: the Starlette application (pages, the one JSON route, the static files);
* :mod:`.server`: :func:`~.server.serve`, the app on uvicorn, bound to 127.0.0.1.

It reads corpus runs, caches, analyses and the report; only the command line imports it.
Needs the ``explore`` extra (duckdb, pyarrow, starlette, uvicorn).
"""

from probe.explore.data import Explorer
from probe.explore.server import serve

__all__ = ["Explorer", "serve"]
