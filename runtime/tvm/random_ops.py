"""The Relax lowering of `dropout`, with a counter-based hash RNG computed in TIR.

Each element's uniform draw is a pure function of (op seed, run seed, flat element index mod 2^32): the index and
the seeds go through Chris Wellons' `lowbias32` integer hash, and the top 24 bits become u in [0, 1); the
element is kept when u >= p. So a compiled dropout is reproducible for a given run seed, independent of
threads and of the other ops, and needs no RNG state. It draws different masks than the interpreter (numpy's
PCG64), so it matches the reference in distribution (keep rate 1 - p, kept values scaled by 1 / (1 - p)), not
element for element.
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.relax import op as R

from .rule import OpCall, RelaxResult, relax_rule

_MASK32 = 0xFFFFFFFF


def _u32(v: int) -> tirx.PrimExpr:
    return tirx.const(v & _MASK32, "uint32")


def mix32(h: tirx.PrimExpr) -> tirx.PrimExpr:
    """lowbias32: a bijective 32-bit integer hash with low bias (uint32 arithmetic wraps)."""
    h = h ^ (h >> _u32(16))
    h = h * _u32(0x7FEB352D)
    h = h ^ (h >> _u32(15))
    h = h * _u32(0x846CA68B)
    return h ^ (h >> _u32(16))


def mix32_int(h: int) -> int:
    """`mix32` on a Python int, for the compile-time part of the key."""
    h &= _MASK32
    h ^= h >> 16
    h = (h * 0x7FEB352D) & _MASK32
    h ^= h >> 15
    h = (h * 0x846CA68B) & _MASK32
    return h ^ (h >> 16)


def _uniform(op_seed: int, run_seed: tirx.PrimExpr, index: tirx.PrimExpr) -> tirx.PrimExpr:
    """u in [0, 1) for one element: 24 bits of hash(op seed, run seed, index)."""
    key = mix32_int(op_seed ^ mix32_int((op_seed >> 32) ^ 0x9E3779B9))
    k1 = mix32(run_seed.astype("uint32") ^ _u32(key))
    k2 = mix32((run_seed >> tirx.const(32, "int64")).astype("uint32") ^ k1)
    h = mix32(mix32(index.astype("uint32") ^ k1) ^ k2)  # the index's low 32 bits: GPU code narrows indices to i32
    return (h >> _u32(8)).astype("float32") * tirx.const(1.0 / (1 << 24), "float32")


@relax_rule("dropout")
def _dropout(call: OpCall) -> RelaxResult:
    """x while not training (or p = 0); else x / (1 - p) where u >= p and 0 elsewhere. A flag known only at run
    time selects between the two."""
    x, training, p = call.args[0], call.flag(1), call.attrs["p"]
    if training is False or p == 0.0:
        return x
    op_seed, dtype = call.attrs["seed"], call.dtype()

    def compute(x: te.Tensor, seed: te.Tensor) -> te.Tensor:
        def element(*i: tirx.PrimExpr) -> tirx.PrimExpr:
            index = tirx.const(0, "int64")
            for v, n in zip(i, x.shape):
                index = index * n + v
            keep = _uniform(op_seed, seed[()], index) >= tirx.const(p, "float32")
            return tirx.Select(keep, x[i] / tirx.const(1.0 - p, dtype), tirx.const(0, dtype))
        return te.compute(x.shape, element, name="dropout")

    dropped = call.bb.call_te(compute, x, call.seed(), primfunc_name_hint="dropout")
    return dropped if training else R.where(call.args[1], call.emit(dropped), x)
