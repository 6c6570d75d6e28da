"""The per-row terms of a block of attention weights: one interface, one file per way of computing them.

A streamed attention hands each block of query rows to the backends in order; the first that
takes it writes the block's per-row terms (:mod:`~.base`: :class:`~.base.RowTermsBackend`, the
interface, and what a backend may read and write of the attention). :mod:`~.registry` finds them
(every module here that defines ``BACKEND``) and orders them:

* :mod:`~.triton_fused`: a whole SDPA call from its q and k, the weights never written (CUDA and
  Triton, where ``PROBE_FUSED=1``; its kernel is :mod:`~.kernels.qkkernel`);
* :mod:`~.triton_rows`: a CUDA block, one Triton program per row (:mod:`~.kernels.rowkernel`);
* :mod:`~.numba_rows`: a CPU block, the compiled row loop of :mod:`~.rowloop` (numba: the
  ``fast`` extra);
* :mod:`~.reference`: any block, in plain torch (and the torch pieces the others share).

:mod:`~.workspace` holds the scratch buffers and template pairs one run's backends share. A new
backend (another GPU, another compiler) is one new file here with a ``BACKEND`` class; its kernels,
if it has many, a folder beside :mod:`~.kernels` and :mod:`~.rowloop`.
"""
