"""Converters of ONNX ops that are a kiln op or a few: arithmetic and activations, comparisons, Where, Cast,
variadic Sum/Mean/Max/Min, MatMul and Gemm, Softmax, Constant, Identity, Dropout, and `If` on a known condition."""

from __future__ import annotations

import zlib

import numpy as np

from kiln.ir import DType, Value

from ..tensors import kiln_dtype
from .call import NodeCall, Output
from .convert_shape import reshape_to, vector_arithmetic
from .e8m0 import to_e8m0
from .registry import Unsupported, converts
from .symbolic import vector_equal, vector_where

_UNARY = {"Relu": "relu", "Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Neg": "neg", "Abs": "abs", "Tanh": "tanh",
          "Sigmoid": "sigmoid", "Erf": "erf"}
_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "MatMul": "matmul", "Equal": "equal",
           "Less": "less", "Greater": "greater"}
_NEGATED = {"LessOrEqual": "greater", "GreaterOrEqual": "less"}  # a <= b is not (a > b)
_VARIADIC = {"Sum": "add", "Mean": "add", "Max": "maximum", "Min": "minimum"}


@converts(*_UNARY, since=6)
def _unary(call: NodeCall) -> Value:
    return call.emit(_UNARY[call.node.op_type], call.input(0))


_ARITHMETIC = {"Add", "Sub", "Mul", "Div"}


@converts(*_BINARY, since=7)
def _binary(call: NodeCall) -> Output:
    a, b = call.vector(0), call.vector(1)
    if call.node.op_type in _ARITHMETIC and a is not None and b is not None and (a.static() is None or
                                                                                b.static() is None):
        return vector_arithmetic(call.node.op_type, a, b)  # arithmetic on a shape with run-time dims
    if call.node.op_type == "Equal" and a is not None and b is not None and (a.static() is None or
                                                                             b.static() is None):
        decided = vector_equal(a, b)  # torch's expand(-1) tests its shape vector for -1
        if decided is not None:
            return decided
    return call.emit(_BINARY[call.node.op_type], call.input(0), call.input(1))


@converts(*_NEGATED, since=12)
def _negated(call: NodeCall) -> Value:
    flipped = call.emit(_NEGATED[call.node.op_type], call.input(0), call.input(1))
    return call.emit("where", flipped, np.asarray(False), np.asarray(True))


@converts(*_VARIADIC, since=8)
def _variadic(call: NodeCall) -> Value:
    kind = _VARIADIC[call.node.op_type]
    out = call.input(0)
    for i in range(1, len(call.node.input)):
        out = call.emit(kind, out, call.input(i))
    if call.node.op_type == "Mean":
        out = call.emit("div", out, call.constant(len(call.node.input), like=out))
    return out


@converts("Reciprocal", since=6)
def _reciprocal(call: NodeCall) -> Value:
    x = call.input(0)
    return call.emit("div", call.constant(1, like=x), x)


@converts("Pow", since=7)
def _pow(call: NodeCall) -> Value:
    base, exponent = call.input(0), call.input(1)
    dtype = base.type.dtype
    wide = dtype if dtype.is_float else DType.f64  # kiln's pow is floating; an integer power is exact in f64
    if base.type.dtype != wide:
        base = call.emit("cast", base, dtype=wide)
    if exponent.type.dtype != wide:
        exponent = call.emit("cast", exponent, dtype=wide)
    out = call.emit("pow", base, exponent)
    return out if dtype == wide else call.emit("cast", out, dtype=dtype)


@converts("LeakyRelu", since=6)
def _leaky_relu(call: NodeCall) -> Value:
    return call.emit("leaky_relu", call.input(0), alpha=float(call.attr("alpha", 0.01)))


@converts("Gelu", since=20)
def _gelu(call: NodeCall) -> Value:
    return call.emit("gelu", call.input(0), approximate=call.attr("approximate", "none"))


@converts("Where", since=9)
def _where(call: NodeCall) -> Output:
    cond, a, b = call.known[0], call.vector(1), call.vector(2)
    if cond is not None and a is not None and b is not None and (a.static() is None or b.static() is None):
        picked = vector_where(cond, a, b)  # a shape vector with run-time dims stays one
        if picked is not None:
            return picked
    return call.emit("where", call.input(0), call.input(1), call.input(2))


@converts("Cast", since=6)
def _cast(call: NodeCall) -> Output:
    dtype = kiln_dtype(call.attr("to"))
    vector = call.vector(0)
    if vector is not None and dtype in (DType.i64, DType.i32) and call.known[0] is None:
        return vector  # a run-time shape stays one through an integer cast
    return cast_to(call, call.input(0), dtype)


@converts("CastLike", since=15, type_only=(1,))
def _cast_like(call: NodeCall) -> Value:
    return cast_to(call, call.input(0), call.input(1).type.dtype)


def cast_to(call: NodeCall, x: Value, dtype: DType) -> Value:
    """x as dtype under the node's `saturate` attribute (opset 19, default 1): a float cast to a float8 saturates
    to its finite range (NaN stays NaN); `saturate=0` leaves kiln's cast, whose overflow is NaN (inf for f8e5m2);
    to f8e8m0fnu, ONNX's own rounding (`to_e8m0`)."""
    if x.type.dtype == dtype:
        return x
    if dtype is DType.f8e8m0fnu:
        return to_e8m0(call, x, bool(call.attr("saturate", 1)), call.attr("round_mode", "up"))
    if dtype.is_float8 and x.type.dtype.is_float and call.attr("saturate", 1):
        top = dtype.finite_max
        x = call.emit("minimum", call.emit("maximum", x, call.constant(-top, like=x)), call.constant(top, like=x))
    return call.emit("cast", x, dtype=dtype)


@converts("Gemm", since=7)
def _gemm(call: NodeCall) -> Value:
    a, b = call.input(0), call.input(1)
    if call.attr("transA", 0):
        a = call.emit("transpose", a, perm=[1, 0])
    if call.attr("transB", 0):
        b = call.emit("transpose", b, perm=[1, 0])
    out = call.emit("matmul", a, b)
    alpha, beta = float(call.attr("alpha", 1.0)), float(call.attr("beta", 1.0))
    if alpha != 1.0:
        out = call.emit("mul", out, call.constant(alpha, like=out))
    c = call.optional(2)
    if c is not None and beta != 0.0:
        if beta != 1.0:
            c = call.emit("mul", c, call.constant(beta, like=c))
        out = call.emit("add", out, c)
    return out


def _softmax(call: NodeCall, kind: str) -> Value:
    x = call.input(0)
    rank = x.type.rank
    axis = call.attr("axis", -1 if call.opset >= 13 else 1)
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < max(rank, 1):
        raise Unsupported(f"axis {call.attr('axis')} is out of range for {x.type}")
    if call.opset >= 13 or axis == rank - 1:
        return call.emit(kind, x, axis=axis)
    # before opset 13 the input is taken as 2-D, flattened at axis: the normalization runs over all trailing dims
    inner = x.type.shape[axis:]
    if None in inner:
        raise Unsupported(f"opset {call.opset} {call.node.op_type} over dims {list(inner)} known only at run time")
    flat = reshape_to(call, x, [*x.type.shape[:axis], int(np.prod(inner))] if None not in x.type.shape[:axis]
                      else [-1, int(np.prod(inner))])
    y = call.emit(kind, flat, axis=-1)
    return reshape_to(call, y, [-1 if d is None else d for d in x.type.shape])


@converts("Softmax", since=1)
def _softmax_op(call: NodeCall) -> Value:
    return _softmax(call, "softmax")


@converts("LogSoftmax", since=1)
def _log_softmax(call: NodeCall) -> Value:
    return _softmax(call, "log_softmax")


@converts("Constant", since=1)
def _constant(call: NodeCall) -> Output:
    for key, dtype in (("value", None), ("value_float", np.float32), ("value_int", np.int64),
                       ("value_floats", np.float32), ("value_ints", np.int64)):
        if key in call.attrs:
            return np.asarray(call.attrs[key], dtype)
    raise Unsupported(f"a Constant of {', '.join(call.attrs) or 'no value'}; kiln imports numeric tensors only")


@converts("Identity", since=1)
def _identity(call: NodeCall) -> Output:
    """The input itself; a parameter passed on becomes a value through a no-op cast (canonicalize drops it)."""
    vector = call.vector(0)
    if vector is not None and call.known[0] is None:
        return vector
    x = call.input(0)
    return x if isinstance(x, Value) else call.emit("cast", x, dtype=x.type.dtype)


@converts("Dropout", since=7)
def _dropout(call: NodeCall) -> Output:
    """The identity in inference mode; in training mode (opset 12+: training_mode a constant, or a bool scalar
    known at run time, which kiln's dropout takes as its training operand) kiln's dropout with the ratio as `p`.
    The mask is a second dropout of ones under the same seed: a dropout's mask depends only on its seed, the run
    seed and the shape, so both draw the same one. kiln's generator is not numpy's, so the masks are not ONNX's."""
    x = call.input(0)
    mask = len(call.node.output) > 1 and bool(call.node.output[1])
    if mask and not x.type.is_static:
        raise Unsupported(f"Dropout's mask output of {x.type}, whose dims are known only at run time")
    training = _training_flag(call) if call.opset >= 12 else None
    if training is None:
        return (x, np.ones(x.type.shape, bool)) if mask else x
    ratio = call.value(1, "the ratio")
    p = 0.5 if ratio is None else float(np.asarray(ratio).reshape(-1)[0])
    if not 0.0 <= p < 1.0:
        raise Unsupported(f"Dropout ratio {p} is outside [0, 1)")
    # ONNX's seed is any int64, kiln's non-negative; without one, the output's name: stable across imports
    seed = int(call.attr("seed", zlib.crc32(call.node.output[0].encode()))) % 2**63
    y = call.emit("dropout", x, training, p=p, seed=seed)
    if not mask:
        return y
    kept = call.emit("dropout", np.ones(x.type.shape, x.type.dtype.numpy), training, p=p, seed=seed)
    return y, call.emit("greater", kept, call.constant(0, like=kept))


def _training_flag(call: NodeCall) -> Value | None:
    """Dropout's training_mode input as kiln's training operand; None where it is absent or constantly false."""
    if not call.present(2):
        return None
    known = call.known[2] if len(call.known) > 2 else None
    if known is not None:
        return call.constant(np.asarray(True)) if bool(np.asarray(known).reshape(-1)[0]) else None
    flag = call.input(2)
    if flag.type.dtype is not DType.bool or flag.type.rank != 0:
        raise Unsupported(f"Dropout's training_mode {flag.type} known at run time; kiln's takes a bool scalar")
    return flag


@converts("If", since=1)
def _if(call: NodeCall) -> Output:
    condition = call.value(0, "the If condition")
    if call.inline is None:
        raise Unsupported("If inside a folded sub-graph")
    return tuple(call.inline(call.attr("then_branch" if bool(np.reshape(condition, -1)[0]) else "else_branch")))
