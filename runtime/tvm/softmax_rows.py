"""Fast-math softmax over the last axis as one hand-scheduled CPU kernel: each row's maximum, exps, sum and scaled
store in vectors, the exps kept in a buffer on the stack between the sum and the store.

The row rule (`schedules/row_reduction.py`) takes vector partial sums only of a row some vector width divides, so a
row of 197 (ViT-B/16's tokens) or 77 ran as a copy padded to whole vectors, its last element repeated (memcpy and a
permute a row, then five passes over the copy): 610 us for the 48x197x197 attention softmax on Zen 4, where rows of
208 took 365. Here a row's last vector overlaps the one before it (`row_vectors`): its repeated lanes change no
maximum, a select that is constant per lane keeps them out of the sum, and they are stored twice with the same
value. That kernel takes 340 us, and rows a vector divides gain too (6x8x197x208: 365 -> 327; 1024x244, whose
partial sums were 4 lanes: 140 -> 44; bench/RESULTS.md, session 29).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable

import tvm
from tvm import relax, tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import tirx as ib

from .relax_rewrite import call_on_rows
from .row_vectors import RowSplit, across, at, splat

KERNEL_NAME = "softmax_rows"
_SOFTMAX = tvm.ir.Op.get("relax.nn.softmax")
# exp(t) = 2^k exp(r) with k = round(t / ln 2) and r = t - k ln 2 in [-ln2/2, ln2/2], ln 2 split in two so k ln 2_hi
# is exact for the k a float32 exp can have; exp(r) a polynomial of degree 5 fitted to exp's relative error on that
# interval (least squares reweighted toward equal ripple: 7.7e-8 in float64, 2.4e-7 in float32 arithmetic, as the
# degree-6 Taylor polynomial it replaced, one FMA fewer)
_LN2_HI, _LN2_LO = 0.693145751953125, 1.4286068203094173e-06
_POLYNOMIAL = [0.00829172134399414, 0.04191504791378975, 0.1666766256093979, 0.49998900294303894, 0.9999996423721313,
               1.0000001192092896]  # highest power first, for Horner's rule
AVX512_LANES = 16  # a float32 vector of 16 lanes exists only on AVX-512 (`CPUModel.lanes`)
_SCALEF = "llvm.x86.avx512.mask.scalef.ps.512"  # x * 2^floor(y) in one instruction, all lanes, current rounding
_SMALLEST = -87.33654  # ln of float32's least normal: below it 2^k has no exponent field, so t is clamped there


def exp_nonpositive(t: tirx.PrimExpr, lanes: int) -> tirx.PrimExpr:
    """exp(t) for float32 `t` <= 0 in `lanes` lanes, within 4e-7 relative of exp for t >= -87.3 (at or below that,
    the least normal float32, 1.2e-38: a softmax's smallest weights, not its sums); about 15 vector operations, 12
    on AVX-512, where 2^k times the polynomial is one `vscalefps` (a convert, an add, a shift and a multiply
    elsewhere: the 1024 x 336 softmax 48 -> 45 us, Zen 4)."""
    def const(value: float) -> tirx.PrimExpr:
        return splat(value, lanes)

    t = tirx.max(t, const(_SMALLEST))
    k = tirx.floor(t * const(1 / math.log(2)) + const(0.5))
    r = t - k * const(_LN2_HI) - k * const(_LN2_LO)
    poly = functools.reduce(lambda p, c: p * r + const(c), _POLYNOMIAL[1:], const(_POLYNOMIAL[0]))
    if lanes == AVX512_LANES:
        return tirx.call_llvm_pure_intrin(f"float32x{lanes}", _SCALEF, poly, k, poly, tirx.const(-1, "int16"),
                                          tirx.const(4, "int32"))
    ints = "int32" if lanes == 1 else f"int32x{lanes}"
    exponent = (tirx.Cast(ints, k) + splat(127, lanes, "int32")) << splat(23, lanes, "int32")
    return poly * tirx.call_intrin("float32" if lanes == 1 else f"float32x{lanes}", "tirx.reinterpret", exponent)


Read = Callable[[tirx.Expr], tirx.Expr]  # a row's vector from a start
ROW_CHAINS = 4  # partial maxima of a row (`row_maximum`): its accumulator buffer holds this many vectors


def row_maximum(split: RowSplit, acc: tirx.Buffer, read: Read) -> tirx.PrimExpr:
    """Emit the loop leaving the row's maximum in `acc` (`ROW_CHAINS` vectors), in the kernel being parsed; the
    maximum as a scalar. The row's vectors go to `chains` partial maxima in turn, the last vector first (the lanes it
    shares with the one before it are simply read twice): one chain of dependent maxima took 2 cycles a vector where
    the loads allow 2 vectors a cycle."""
    step, chains = split.step, min(ROW_CHAINS, split.whole + 1)

    def fold(chain: int, vector: tirx.PrimExpr) -> None:
        ib.buffer_store(acc, tirx.max(acc[at(chain * step, step)], read(vector * step)), [at(chain * step, step)])

    ib.buffer_store(acc, read(split.tail), [at(0, step)])
    for chain in range(1, chains):
        ib.buffer_store(acc, read((chain - 1) * step), [at(chain * step, step)])
    first = chains - 1  # the whole vectors not read yet
    groups, extra = divmod(split.whole - first, chains)
    with ib.serial(0, groups) as g:
        for chain in range(chains):
            fold(chain, first + g * chains + chain)
    for chain in range(extra):
        fold(chain, first + groups * chains + chain)
    partials = [acc[at(chain * step, step)] for chain in range(chains)]
    return across(functools.reduce(tirx.max, partials), step, tirx.max)


def row_exps(split: RowSplit, acc: tirx.Buffer, read: Read, top: tirx.PrimExpr, exps: tirx.Buffer,
             base: tirx.PrimExpr, last: int) -> None:
    """Emit the loop storing the row's exps, exp(read(start) - `top`), into `exps` from `base` (each whole vector at
    its start, the last at `last`: its own start where the exps overwrite the row they read, else past the whole
    ones) and leaving their sum in `acc`'s first vector (the last vector's lanes the one before it covered left
    out), summed as they are stored: a second pass over them was one chain of dependent adds. The last vector is
    read first and stored last, so an in-place row is read before any exp overwrites it."""
    step = split.step
    tail = ib.bind(exp_nonpositive(read(split.tail) - top, step))
    ib.buffer_store(acc, split.fresh(tail), [at(0, step)])
    with ib.serial(0, split.whole) as v:
        ib.buffer_store(exps, exp_nonpositive(read(v * step) - top, step), [at(base + v * step, step)])
        ib.buffer_store(acc, acc[at(0, step)] + exps[at(base + v * step, step)], [at(0, step)])
    ib.buffer_store(exps, tail, [at(base + last, step)])


def softmax_rows_kernel(width: int, lanes: int, scale: float = 1.0) -> tirx.PrimFunc:
    """The scheduled kernel of softmax(`scale` x) over the rows of float32 [rows, `width`] (rows symbolic), in
    vectors of at most `lanes` (`RowSplit`); `scale` > 0, so max(scale x) = scale max(x) and x is read as is."""
    split = RowSplit.of(width, lanes)
    step, whole, tail = split.step, split.whole, split.tail

    def scaled(value: tirx.PrimExpr, lanes: int = step) -> tirx.PrimExpr:
        return value if scale == 1.0 else value * splat(scale, lanes)

    @T.prim_func(private=True, check_well_formed=False)
    def softmax(x_handle: T.handle, out_handle: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        rows = T.int64()
        x = T.match_buffer(x_handle, (rows, width), "float32")
        out = T.match_buffer(out_handle, (rows, width), "float32")
        with T.sblock("root"):  # TVM's reshape detection (RewriteDataflowReshape) reads a kernel's root block
            for row in T.parallel(rows):
                exps = T.decl_buffer(((whole + 1) * step,), "float32", scope="local")
                sums = T.decl_buffer((ROW_CHAINS * step,), "float32", scope="local")
                top = T.bind(scaled(row_maximum(split, sums, lambda start, row=row: x[row, at(start, step)]), 1))
                row_exps(split, sums, lambda start, row=row: scaled(x[row, at(start, step)]), splat(top, step), exps, 0,
                         whole * step)
                inverse = T.bind(T.float32(1) / across(sums[at(0, step)], step, operator.add))
                for v in range(whole):
                    out[row, at(v * step, step)] = exps[at(v * step, step)] * splat(inverse, step)
                out[row, at(tail, step)] = exps[at(whole * step, step)] * splat(inverse, step)

    return softmax


def is_row_softmax(call: relax.Call) -> bool:
    """Whether `call` is a float32 softmax over a last axis of static, non-zero width."""
    if call.op != _SOFTMAX or call.ty.dtype != "float32" or call.ty.ndim < 1:
        return False
    width = call.ty.shape[-1]
    return int(call.attrs.axis) in (-1, call.ty.ndim - 1) and isinstance(width, tirx.IntImm) and int(width) > 0


def softmax_rows(builder: relax.BlockBuilder, x: relax.Expr, scale: float, lanes: int) -> relax.Expr:
    """softmax(`scale` `x`) over its last axis (a call `is_row_softmax` takes) as `softmax_rows_kernel`."""
    kernel = softmax_rows_kernel(int(x.ty.shape[-1]), lanes, scale)
    return call_on_rows(builder, builder.add_func(kernel, KERNEL_NAME), x)
