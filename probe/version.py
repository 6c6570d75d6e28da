"""probe's version, in one module of its own: the package face re-exports it and a cache's metadata
records it, without importing the whole package (which would close an import circle)."""

__version__ = "0.1.0"
