"""The Triton kernels of the GPU backends: :mod:`~.rowkernel` (every per-row term of a block, one
program per row; :mod:`probe.analysis.focus.backends.triton_rows`) and :mod:`~.qkkernel` (the
statistics of a whole SDPA call from its q and k; :mod:`probe.analysis.focus.backends.triton_fused`)."""
