"""probe's performance machinery, in one place: what makes capture and caches fast and lean.

None of it changes a stored value; each part pays for itself in the measurements of
``docs/performance.md`` (``benchmarks/switch_ab.py`` switches one on and off in one process):

* :mod:`.direct`: a streamed cache's data written with direct I/O (``O_DIRECT``), so the device
  reads the tensors' memory itself instead of the kernel copying it into the page cache;
* :mod:`.iothread`: a streamed cache's tensors written on a background thread, in order, while
  the model computes the next layer (bounded: about two layers in flight);
* :mod:`.heap`: freed heap memory handed back to the system (glibc's ``malloc_trim``) when a
  capture's tensors are let go.

:data:`OPTIONS` (an :class:`Options`) switches each part; :func:`using` changes them for a
``with`` block.
"""

from probe.cache.perf.options import OPTIONS, Options, using

__all__ = ["OPTIONS", "Options", "using"]
