"""int8 x int8 -> int32 matmuls of a constant weight on VNNI CPUs: `vpdpbusd` (AVX512-VNNI, 16 lanes, or AVX-VNNI,
8 lanes) multiplies 4 unsigned bytes of the activation by 4 signed bytes of each of a vector's weight columns.

`lowp.int8_matmul` emits `R.matmul(x int8, W int8, out_dtype=int32)` (W a bound weight's codes, batched per scale
block). This pass, for a target with VNNI, replaces each by one scheduled kernel (`vnni_kernel`): the weight is
packed at build time in numpy as [parts, N/L, K/4, L, 4] (zero codes pad N and K), so one vector load feeds the
instruction's L lanes x 4 K; each activation quad is offset to unsigned (x + 128, an xor of its sign bits) and
broadcast; the offset's share, 128 x the weight's column sums, is subtracted as the sums are stored, so the result is
the exact signed product the plain matmul computes. A register tile of `rows` x `groups` vectors of sums (from the
CPU model's accumulators) runs over all of K; tiles run in parallel on TVM's thread pool. Without VNNI the plain
matmul stays (LLVM widens it to vpmulld).
"""

from __future__ import annotations

import functools
import operator

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax import op as R
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.script import tirx as T
from tvm.target import Target

from .cpu import CPUModel, cpu_model
from .relax_rewrite import rewrite_functions, static_shape

_MATMUL = tvm.ir.Op.get("relax.matmul")
_RESHAPE = tvm.ir.Op.get("relax.reshape")
QUAD = 4  # bytes of K one vpdpbusd lane multiplies and adds
OFFSET = 128  # added to a signed activation code to make it the unsigned byte vpdpbusd reads
KERNEL_NAME = "vnni_matmul"


def vnni_lanes(model: CPUModel) -> int | None:
    """int32 lanes of the target's vpdpbusd (16 with AVX512-VNNI on 512-bit vectors, 8 with AVX-VNNI), or None."""
    if "avx512vnni" in model.features and model.vector_bits == 512:
        return model.lanes()
    return 8 if "avxvnni" in model.features else None


def register_tile(model: CPUModel, rows: int | None, groups: int) -> tuple[int, int]:
    """(activation rows, weight vectors) of the register tile: the CPU's accumulators shared between up to 4
    vectors of columns (one load each per quad, beside one broadcast per row) and the rows; fewer rows when the
    product has fewer (batch 1), the columns then taking the accumulators."""
    width = min(groups, max(1, model.accumulators // QUAD))
    if rows is not None and rows < model.accumulators // width:
        width = min(groups, max(width, model.accumulators // rows))
        return rows, width
    return model.accumulators // width, width


def pack_codes(codes: np.ndarray, lanes: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes [parts, K, N] packed as [parts, G, K/4, lanes, 4] with zero codes padding K to quads and N to G
    vectors, G a multiple of `width`; 128 x each padded column's code sum, int32 [parts, G * lanes])."""
    parts, depth, n = codes.shape
    quads, vectors = -(-depth // QUAD), -(-n // lanes)
    groups = -(-vectors // width) * width
    padded = np.zeros((parts, quads * QUAD, groups * lanes), np.int8)
    padded[:, :depth, :n] = codes
    packed = padded.reshape(parts, quads, QUAD, groups, lanes).transpose(0, 3, 1, 4, 2)
    return np.ascontiguousarray(packed), OFFSET * padded.sum(axis=1, dtype=np.int32)


def vnni_kernel(parts: int, depth: int, n: int, lanes: int, rows: int, width: int, groups: int) -> tirx.PrimFunc:
    """The scheduled kernel `out[p, m, :n] = x[p, m, :] @ W[p]` (int32) from x int8 [parts, M, depth] (M symbolic),
    W packed by `pack_codes` into `groups` vectors of `lanes` columns, and its offset correction."""
    quads, full = -(-depth // QUAD), depth // QUAD
    tiles_n, cols = groups // width, groups * lanes
    vec, wide, accs = f"int32x{lanes}", f"int8x{lanes * QUAD}", rows * width * lanes
    intrin = f"llvm.x86.avx512.vpdpbusd.{lanes * 32}"
    sign = -0x7F7F7F80  # 0x80808080 as int32: xor flips each byte's sign bit, adding 128 to it as unsigned

    @T.prim_func(private=True, check_well_formed=False)
    def kernel(x_handle: T.handle, w: T.Buffer((parts, groups, quads, lanes, QUAD), "int8"),
               corr: T.Buffer((parts, cols), "int32"), out_handle: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(x_handle, (parts, m, depth), "int8")
        out = T.match_buffer(out_handle, (parts, m, n), "int32")
        tiles_m = (m + rows - 1) // rows
        for tile in T.parallel(parts * tiles_n * tiles_m):
            acc = T.decl_buffer((accs,), "int32", scope="local")
            p = T.bind(tile // (tiles_n * tiles_m))
            g0 = T.bind(tile % (tiles_n * tiles_m) // tiles_m * width)
            m0 = T.bind(tile % tiles_m * rows)
            for i in T.unroll(rows * width):
                acc[T.ramp(i * lanes, 1, lanes)] = T.broadcast(T.int32(0), lanes)
            for q in range(quads):
                for r in T.unroll(rows):
                    row = T.bind(T.min(m0 + r, m - 1))
                    quad = T.bind(T.if_then_else(
                        q < full,
                        T.reinterpret(x.vload([p, row, T.min(q, full - 1) * QUAD], "int8x4"), dtype="int32"),
                        T.bitwise_or(T.bitwise_or(
                            T.bitwise_and(T.Cast("int32", x[p, row, T.min(q * QUAD, depth - 1)]), 255),
                            T.shift_left(T.bitwise_and(T.Cast("int32", x[p, row, T.min(q * QUAD + 1, depth - 1)]),
                                                       255), 8)),
                            T.shift_left(T.bitwise_and(T.Cast("int32", x[p, row, T.min(q * QUAD + 2, depth - 1)]),
                                                       255), 16))))
                    a = T.bind(T.reinterpret(T.broadcast(T.bitwise_xor(quad, sign), lanes), dtype=wide))
                    for g in T.unroll(width):
                        at = T.bind((r * width + g) * lanes)
                        acc[T.ramp(at, 1, lanes)] = T.call_llvm_pure_intrin(
                            vec, T.llvm_lookup_intrinsic_id(intrin), acc[T.ramp(at, 1, lanes)], a,
                            w.vload([p, g0 + g, q, 0, 0], wide))
            for r in T.unroll(rows):
                if m0 + r < m:
                    for g in T.unroll(width):
                        at = T.bind((r * width + g) * lanes)
                        col = T.bind((g0 + g) * lanes)
                        if col + lanes <= n:
                            out[p, m0 + r, T.ramp(col, 1, lanes)] = \
                                acc[T.ramp(at, 1, lanes)] - corr[p, T.ramp(col, 1, lanes)]
                        else:
                            for lane in T.unroll(lanes):
                                if col + lane < n:
                                    out[p, m0 + r, col + lane] = acc[at + lane] - corr[p, col + lane]



    return kernel


def _bound_codes(rewriter: PyExprMutator, expr: relax.Expr) -> np.ndarray | None:
    """The int8 values of `expr` where it is a constant, a var bound to one, or a static reshape of one."""
    if isinstance(expr, relax.Var):
        bound = rewriter.lookup_binding(expr)
        return None if bound is None else _bound_codes(rewriter, bound)
    if isinstance(expr, tvm.ir.Constant):
        value = expr.value.numpy()
        return value if value.dtype == np.int8 else None
    if isinstance(expr, relax.Call) and expr.op == _RESHAPE:
        shape, codes = static_shape(expr.ty), _bound_codes(rewriter, expr.args[0])
        return None if shape is None or codes is None else codes.reshape(shape)
    return None


@mutator
class _VNNIMatmuls(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, model: CPUModel, lanes: int) -> None:
        super().__init__(mod)
        self.model, self.lanes = model, lanes

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != _MATMUL or str(call.attrs.out_dtype) != "int32":
            return call
        x, w = call.args
        codes = _bound_codes(self, w)
        dims = list(x.ty.shape.values) if isinstance(x.ty, relax.TensorType) and x.ty.dtype == "int8" else None
        if codes is None or dims is None or codes.ndim not in (2, 3) or len(dims) < 2:
            return call
        if codes.ndim == 3 and (len(dims) != 3 or not isinstance(dims[0], tirx.IntImm)
                                or int(dims[0]) != codes.shape[0]):
            return call  # a batched product broadcasting its batch stays as it is
        weights = codes if codes.ndim == 3 else codes[None]
        parts, depth, n = weights.shape
        count = dims[1] if codes.ndim == 3 else functools.reduce(operator.mul, dims[:-1])
        count = tvm.sym.Analyzer().simplify(count)
        rows, width = register_tile(self.model, int(count) if isinstance(count, tirx.IntImm) else None,
                                    -(-n // self.lanes))
        packed, corr = pack_codes(weights, self.lanes, width)
        kernel = self.builder_.add_func(vnni_kernel(parts, depth, n, self.lanes, rows, width, packed.shape[1]),
                                        KERNEL_NAME)
        flat = self.builder_.emit(R.reshape(x, [parts, count, depth]))
        out = self.builder_.emit(relax.call_tir(kernel, [flat, relax.const(packed), relax.const(corr)],
                                                relax.TensorType([parts, count, n], "int32")))
        return R.reshape(out, [*dims[:-1], n])


def vnni_int8_matmuls(target: Target) -> tvm.transform.Pass:
    """The module pass computing every int8 x int8 -> int32 matmul of a bound weight with `vnni_kernel` where the
    target's CPU has VNNI; elsewhere it changes nothing."""
    model = cpu_model(target)
    lanes = vnni_lanes(model) if target.kind.name == "llvm" else None

    @tvm.transform.module_pass(opt_level=0, name="KilnVNNIMatmuls")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return mod if lanes is None else rewrite_functions(mod, _VNNIMatmuls(mod, model, lanes))

    return _pass
