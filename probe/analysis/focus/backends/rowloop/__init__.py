"""The compiled CPU row loop (numba): every per-row term of a block from one read of each row.

:mod:`~.rowfused` is the loop and its entry (:func:`~.rowfused.row_terms`); :mod:`~.rowpass`
reads a row for its sums (and takes a softmax of scores); :mod:`~.spanselect` selects the effective
span without a sort; :mod:`~.compress` compacts eight weights a step (AVX-512VL); :mod:`~.rowparts`
cuts a block into tasks and holds what the loop writes; :mod:`~.workers` holds the threads;
:mod:`~.jit` is the one module that imports numba. Used through
:mod:`probe.analysis.focus.backends.numba_rows`.
"""
