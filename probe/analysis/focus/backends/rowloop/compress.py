"""Compaction eight weights a step, with the CPU's compress instruction (numba, AVX-512VL).

The effective span's selection (:mod:`~.spanselect`) collects the weights of
one first-level bin from a whole row: a compaction, ``cand[a] = x[j]; a += x[j] in the bin``,
which LLVM leaves scalar (about 0.37 ns a weight on an AVX-512 machine, an eighth of the row
loop's time). Where the CPU has AVX-512VL, :func:`pack8` compacts eight weights at once:
``vcompressps`` into a register (not into memory, which some CPUs run as microcode), a store of
all eight lanes at the end of what is kept so far (lanes past the kept ones are overwritten by
the next step), and the count of kept lanes added: about 0.1 ns a weight on a row in cache.

:data:`AVAILABLE` says whether numba compiles for a CPU with AVX-512VL (the host's features, or
``NUMBA_CPU_FEATURES`` where set): only then may :func:`pack8` be compiled, and the callers
choose their loop when they are defined (``spanselect.collect``).
"""

from __future__ import annotations

from probe.analysis.focus.backends.rowloop.jit import cgutils, intrinsic, ir, numba, types


def _features() -> set[str]:
    """The CPU features numba compiles for: ``NUMBA_CPU_FEATURES`` where set, else the host's."""
    if numba is None:
        return set()
    given = numba.config.CPU_FEATURES
    if given is not None:
        return {f[1:] for f in str(given).split(",") if f.startswith("+")}
    import llvmlite.binding as llvm

    try:
        return {k for k, on in llvm.get_host_cpu_features().items() if on}
    except RuntimeError:  # pragma: no cover - a host whose features LLVM cannot read
        return set()


AVAILABLE = {"avx512f", "avx512vl"} <= _features()

if numba is not None:

    @intrinsic
    def pack8(typingctx, cand, a, x, j, lo, width):  # pragma: no cover - compiled
        """Of the eight weights ``x[j:j + 8]``, those whose bit pattern ``b`` has ``uint32(b −
        lo) < width`` go to ``cand[a:]``, in order; returns ``a`` + how many. Writes all of
        ``cand[a:a + 8]`` (the lanes past the kept ones hold whatever): the caller keeps ``a <=
        j`` and ``j + 8 <= len(cand)``. Only where :data:`AVAILABLE`. ``x`` and ``cand``:
        contiguous float32 arrays."""
        if not (isinstance(x, types.Array) and isinstance(cand, types.Array)):
            return None
        if x.dtype != types.float32 or cand.dtype != types.float32 or x.layout != "C" or cand.layout != "C":
            return None
        sig = types.intp(cand, types.intp, x, types.intp, types.uint32, types.uint32)

        def codegen(context, builder, signature, args):
            cand_, a_, x_, j_, lo_, w_ = args
            ca = context.make_array(signature.args[0])(context, builder, cand_)
            xa = context.make_array(signature.args[2])(context, builder, x_)
            i32, i1, fl = ir.IntType(32), ir.IntType(1), ir.FloatType()
            v8f, v8i, v8b = ir.VectorType(fl, 8), ir.VectorType(i32, 8), ir.VectorType(i1, 8)

            def splat(s):
                one = builder.insert_element(ir.Constant(v8i, ir.Undefined), s, ir.Constant(i32, 0))
                return builder.shuffle_vector(one, ir.Constant(v8i, ir.Undefined), ir.Constant(v8i, [0] * 8))

            v = builder.load(builder.bitcast(builder.gep(xa.data, [j_]), v8f.as_pointer()), align=4)
            keep = builder.icmp_unsigned("<", builder.sub(builder.bitcast(v, v8i), splat(lo_)), splat(w_))
            mod = builder.module
            squeeze = cgutils.get_or_insert_function(
                mod, ir.FunctionType(v8f, [v8f, v8f, v8b]), "llvm.x86.avx512.mask.compress.v8f32"
            )
            # (lanes past the kept ones zeroed: an undefined fill made LLVM 14, numba 0.60's, abort)
            packed = builder.call(squeeze, [v, ir.Constant(v8f, [0.0] * 8), keep])
            builder.store(packed, builder.bitcast(builder.gep(ca.data, [a_]), v8f.as_pointer()), align=4)
            i8 = ir.IntType(8)
            pop = cgutils.get_or_insert_function(mod, ir.FunctionType(i8, [i8]), "llvm.ctpop.i8")
            return builder.add(a_, builder.zext(builder.call(pop, [builder.bitcast(keep, i8)]), a_.type))

        return sig, codegen


__all__ = ["AVAILABLE", "pack8"]
