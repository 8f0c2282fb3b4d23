"""Relax lowerings of kiln's elementwise, matrix-product, reduction, scan and constant-source ops."""

from __future__ import annotations

import functools

import numpy as np
from tvm import relax, te, tirx
from tvm.relax import op as R

from kiln.ir import DType, KilnError
from kiln.ir.ops.common import norm_axes, norm_axis

from .dtypes import to_storage, tvm_dtype
from .lowp import lowp_matmul
from .quant_matmul import quant_matmul
from .rule import OpCall, RelaxResult, relax_rule
from .transposed_matmul import transposed_lhs

_UNARY = {"neg": R.negative, "abs": R.abs, "relu": R.nn.relu, "exp": R.exp, "log": R.log, "sqrt": R.sqrt,
          "rsqrt": R.rsqrt, "tanh": R.tanh, "sigmoid": R.sigmoid, "silu": R.nn.silu, "erf": R.erf,
          "floor": R.floor, "ceil": R.ceil, "round": R.round, "sign": R.sign, "logical_not": R.logical_not}
_BINARY = {"add": R.add, "sub": R.subtract, "mul": R.multiply, "pow": R.power, "maximum": R.maximum,
           "minimum": R.minimum, "equal": R.equal, "less": R.less, "greater": R.greater}
_LOGICAL = {"logical_and": R.logical_and, "logical_or": R.logical_or, "logical_xor": R.logical_xor}
_REDUCE = {"sum": R.sum, "mean": R.mean, "max": R.max, "min": R.min, "prod": R.prod}
_ARG = {"argmax": R.argmax, "argmin": R.argmin}
_EXTREME = {"max": (lambda a, b: tirx.max(a, b), -np.inf), "min": (lambda a, b: tirx.min(a, b), np.inf)}


@relax_rule(*_UNARY)
def _unary(call: OpCall) -> RelaxResult:
    return _UNARY[call.kind](call.args[0])


@relax_rule("gelu")
def _gelu(call: OpCall) -> RelaxResult:
    return (R.nn.gelu_tanh if call.attrs["approximate"] == "tanh" else R.nn.gelu)(call.args[0])


@relax_rule("leaky_relu")
def _leaky_relu(call: OpCall) -> RelaxResult:
    return R.nn.leakyrelu(call.args[0], call.attrs["alpha"])


@relax_rule(*_BINARY)
def _binary(call: OpCall) -> RelaxResult:
    args = call.args
    if call.types[0].dtype is DType.bool:  # TVM's LLVM codegen compares i1 values as floats (fcmp): use int8
        args = [R.astype(a, "int8") for a in args]
    return _BINARY[call.kind](*args)


@relax_rule(*_LOGICAL)
def _logical(call: OpCall) -> RelaxResult:
    return _LOGICAL[call.kind](*call.args)


@relax_rule("div")
def _div(call: OpCall) -> RelaxResult:
    """True division for floats; for integers the quotient truncated toward zero (TIR's `Div`), and x/0 = 0."""
    a, b = call.args
    if call.types[0].dtype.is_float:
        return R.divide(a, b)
    dtype = call.dtype()
    zero = relax.const(0, dtype)
    # b + (b == 0), not where(b == 0, 1, b): TVM's simplifier pushes a division into a select's arms, and the
    # vectorized select then divides by zero in the arm it discards. (floor_divide is no way round: its
    # vectorized LLVM codegen fails on a non-constant divisor.)
    safe = call.emit(R.add(b, R.astype(R.equal(b, zero), dtype)))
    return R.where(R.equal(b, zero), zero, R.divide(a, safe))


@relax_rule("where")
def _where(call: OpCall) -> RelaxResult:
    return R.where(*call.args)


@relax_rule("cast")
def _cast(call: OpCall) -> RelaxResult:
    """astype, except that a cast to bool tests for nonzero (astype would truncate 0.5 to false), and one to an
    i4/u4/i2/u2 code follows `DType.to_code` (astype to the code's storage byte would wrap modulo 256, and a float
    outside uint8's range converts to garbage)."""
    x, target = call.args[0], call.attrs["dtype"]
    if target is DType.bool:
        return R.not_equal(x, relax.const(0, call.dtype()))
    if target.is_int_code and call.types[0].dtype is not target:
        x = _to_code(x, call.types[0].dtype, target)
    return R.astype(x, tvm_dtype(target))


def _to_code(x: relax.Expr, source: DType, target: DType) -> relax.Expr:
    """`DType.to_code` in Relax: a float is truncated and reduced modulo the code's span in f64 (exact: the span is
    a power of two), NaN and +-inf give 0; the int32 remainder then wraps into the code's range."""
    low, high = target.int_range
    if source.is_float:
        span = relax.const(float(high - low + 1), "float64")
        wide = R.trunc(R.astype(x, "float64"))
        wide = R.subtract(wide, R.multiply(R.trunc(R.divide(wide, span)), span))
        x = R.where(R.isfinite(wide), wide, relax.const(0.0, "float64"))
    v = R.subtract(R.astype(x, "int32"), relax.const(low, "int32"))
    return R.add(R.bitwise_and(v, relax.const(high - low, "int32")), relax.const(low, "int32"))


def _product(call: OpCall) -> relax.Expr:
    """`args[0] @ args[1]`; a static contraction of length 1 is the broadcast product `[.., m, 1] * [.., 1, n]`.

    As a matmul it has a unit reduction loop, which dlight's block normalization (where every CPU rule starts)
    drops before reverse-inlining an epilogue into the block, init included: `s + a @ b` became `2s + a @ b`.
    """
    a, b = call.types[0], call.types[1]
    if a.rank >= 2 and b.rank >= 2 and a.shape[-1] == 1:
        return R.multiply(call.args[0], call.args[1])
    folded = transposed_lhs(call)  # attention's `p^T @ g` as one kernel
    return folded if folded is not None else R.matmul(call.args[0], call.args[1])


@relax_rule("matmul")
def _matmul(call: OpCall) -> RelaxResult:
    """numpy's matmul; a dequantized weight is decoded inside the kernel (in the build's precision: `lowp`)."""
    fused = lowp_matmul(call)
    fused = quant_matmul(call) if fused is None else fused
    return fused if fused is not None else _product(call)


@relax_rule("linear")
def _linear(call: OpCall) -> RelaxResult:
    """x @ weight (+ bias), weight stored [in, out]; a dequantized weight is decoded inside the kernel."""
    fused = lowp_matmul(call)
    fused = quant_matmul(call) if fused is None else fused
    y = fused if fused is not None else _product(call)
    return y if len(call.args) == 2 else R.add(y, call.args[2])


@relax_rule("lora")
def _lora(call: OpCall) -> RelaxResult:
    """base + scale * (a @ b) (also DoRA's V, whose call has the magnitude as a fourth argument)."""
    base, a, b = call.args[:3]
    return R.add(base, R.multiply(relax.const(call.attrs["scale"], call.dtype()), R.matmul(a, b)))


@relax_rule("dora")
def _dora(call: OpCall) -> RelaxResult:
    """magnitude * V / ||V|| over axis 0, V as LoRA computes it."""
    v = call.emit(_lora(call))
    return R.multiply(call.args[3], R.divide(v, R.sqrt(R.sum(R.multiply(v, v), [0], False))))


@relax_rule(*_REDUCE)
def _reduce(call: OpCall) -> RelaxResult:
    axes = norm_axes(call.kind, call.attrs["axes"], call.types[0].rank)
    if not axes:  # numpy reduces over no axis as the identity
        return call.args[0]
    if call.kind in _EXTREME and call.types[0].dtype.is_float:
        return call.bb.call_te(functools.partial(_extreme, call.kind, axes, call.attrs["keepdims"]), call.args[0],
                               primfunc_name_hint=call.kind)
    return _REDUCE[call.kind](call.args[0], list(axes), call.attrs["keepdims"])


def _extreme(kind: str, axes: tuple[int, ...], keepdims: bool, x: te.Tensor) -> te.Tensor:
    """A float max/min reduction that starts from -inf/+inf: TVM's starts from the lowest/highest finite value,
    so the max of a row of -inf came out -3.4e38 (and a fully masked attention row was not recognized)."""
    combine, start = _EXTREME[kind]
    reducer = te.comm_reducer(combine, lambda dtype: tirx.const(start, dtype), name=kind)
    over = {a: te.reduce_axis((0, x.shape[a]), f"k{a}") for a in axes}
    kept = [i for i in range(len(x.shape)) if i not in over]
    shape = [1 if i in over else d for i, d in enumerate(x.shape)] if keepdims else [x.shape[i] for i in kept]

    def element(*index: tirx.PrimExpr) -> tirx.PrimExpr:
        at = dict(zip(range(len(x.shape)) if keepdims else kept, index))
        return reducer(x(*(over[i] if i in over else at[i] for i in range(len(x.shape)))), axis=list(over.values()))

    return te.compute(shape, element, name=kind)


@relax_rule("softmax", "log_softmax")
def _softmax(call: OpCall) -> RelaxResult:
    fn = R.nn.softmax if call.kind == "softmax" else R.nn.log_softmax
    return fn(call.args[0], call.attrs["axis"])


@relax_rule(*_ARG)
def _arg(call: OpCall) -> RelaxResult:
    """The last extreme index is the first one of the flipped axis, counted from the end."""
    axis = norm_axis(call.kind, call.attrs["axis"], call.types[0].rank)
    if not call.attrs["select_last_index"]:
        return _ARG[call.kind](call.args[0], axis, call.attrs["keepdims"])
    n = call.types[0].shape[axis]
    if n is None:
        raise KilnError(f"{call.kind}: select_last_index needs a static axis {axis} in {call.types[0]}")
    first = _ARG[call.kind](call.emit(R.flip(call.args[0], axis)), axis, call.attrs["keepdims"])
    return R.subtract(relax.const(n - 1, "int64"), R.astype(first, "int64"))


@relax_rule("cumsum")
def _cumsum(call: OpCall) -> RelaxResult:
    """Relax scans forward; reverse flips the axis before and after."""
    axis = norm_axis("cumsum", call.attrs["axis"], call.types[0].rank)
    x = call.args[0]
    if call.attrs["reverse"]:
        x = call.emit(R.flip(x, axis))
    y = R.cumsum(x, axis, call.dtype(), call.attrs["exclusive"])
    return R.flip(call.emit(y), axis) if call.attrs["reverse"] else y


@relax_rule("topk")
def _topk(call: OpCall) -> RelaxResult:
    both = call.emit(R.topk(call.args[0], call.attrs["k"], call.attrs["axis"], "both", call.attrs["largest"], "int64"))
    return relax.TupleGetItem(both, 0), relax.TupleGetItem(both, 1)


@relax_rule("constant")
def _constant(call: OpCall) -> RelaxResult:
    value = call.attrs["value"]
    dtype = DType.from_numpy(value.dtype)
    return relax.const(to_storage(value, dtype), tvm_dtype(dtype))


@relax_rule("zeros", "ones", "full")
def _filled(call: OpCall) -> RelaxResult:
    """A tensor filled with the value the reference uses, converted to the dtype as numpy converts it."""
    dtype: DType = call.attrs["dtype"]
    fill = {"zeros": 0, "ones": 1}.get(call.kind, call.attrs.get("value"))
    scalar = to_storage(np.full((), fill, dtype=dtype.numpy), dtype)
    return R.full(call.attrs["shape"], relax.const(scalar, tvm_dtype(dtype)), tvm_dtype(dtype))
