"""numba, where it is installed (the ``fast`` extra): the one module of the row loop that imports it.

Everything the compiled loops use of numba and llvmlite comes from here; without numba each name is
None and the loops are not defined (the streamed statistics then sort each row in torch).
"""

from __future__ import annotations

try:  # an optional extra: without numba the rows are sorted instead
    import numba
    from llvmlite import ir
    from numba import njit, types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - depends on the install
    numba = ir = njit = types = cgutils = intrinsic = None

__all__ = ["numba", "njit", "types", "intrinsic", "ir", "cgutils"]
