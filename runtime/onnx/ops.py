"""ONNX lowerings (opset 20 and later) of kiln's elementwise, matrix-product, reduction, source and stochastic ops."""

from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from kiln.ir import DType, registry
from kiln.ir.ops.common import norm_axes

from .rule import OnnxCall, OnnxResult, onnx_rule

_UNARY = {"neg": "Neg", "abs": "Abs", "relu": "Relu", "exp": "Exp", "log": "Log", "sqrt": "Sqrt", "tanh": "Tanh",
          "sigmoid": "Sigmoid", "erf": "Erf", "floor": "Floor", "ceil": "Ceil", "round": "Round", "sign": "Sign",
          "logical_not": "Not"}
_BINARY = {"add": "Add", "sub": "Sub", "mul": "Mul", "pow": "Pow", "maximum": "Max", "minimum": "Min",
           "equal": "Equal", "matmul": "MatMul", "where": "Where", "logical_and": "And", "logical_or": "Or",
           "logical_xor": "Xor"}
_ORDER = {"less": "Less", "greater": "Greater"}
_REDUCE = {"sum": "ReduceSum", "mean": "ReduceMean", "max": "ReduceMax", "min": "ReduceMin", "prod": "ReduceProd"}
_ARG = {"argmax": "ArgMax", "argmin": "ArgMin"}
_NORMALIZED = {"softmax": "Softmax", "log_softmax": "LogSoftmax"}


@onnx_rule(*_UNARY)
def _unary(call: OnnxCall) -> OnnxResult:
    return call.node(_UNARY[call.kind], call.inputs[0])


@onnx_rule("rsqrt")
def _rsqrt(call: OnnxCall) -> OnnxResult:
    return call.node("Reciprocal", call.node("Sqrt", call.inputs[0]))


@onnx_rule("silu")
def _silu(call: OnnxCall) -> OnnxResult:
    x = call.inputs[0]
    return call.node("Mul", x, call.node("Sigmoid", x))


@onnx_rule("gelu")
def _gelu(call: OnnxCall) -> OnnxResult:
    """Gelu-20 names its exact ("none") and tanh forms as kiln does."""
    return call.node("Gelu", call.inputs[0], approximate=call.attrs["approximate"])


@onnx_rule("leaky_relu")
def _leaky_relu(call: OnnxCall) -> OnnxResult:
    return call.node("LeakyRelu", call.inputs[0], alpha=call.attrs["alpha"])


@onnx_rule(*_BINARY)
def _binary(call: OnnxCall) -> OnnxResult:
    return call.node(_BINARY[call.kind], *call.inputs)


@onnx_rule(*_ORDER)
def _order(call: OnnxCall) -> OnnxResult:
    """Less and Greater; bool operands compare as 0 and 1, since ONNX orders only numbers."""
    inputs = call.inputs
    if call.types[0].dtype is DType.bool:
        inputs = [call.cast(n, DType.i32) for n in inputs]
    return call.node(_ORDER[call.kind], *inputs)


@onnx_rule("div")
def _div(call: OnnxCall) -> OnnxResult:
    """True division for floats; for integers the quotient truncated toward zero, and x/0 = 0.

    ONNX leaves integer Div's rounding to the runtime, so the dividend is first made an exact multiple of the
    divisor (a - fmod(a, b)), whose quotient every rounding agrees on.
    """
    a, b = call.inputs
    if call.types[0].dtype.is_float:
        return call.node("Div", a, b)
    zero = call.scalar(0)
    by_zero = call.node("Equal", b, zero)
    safe = call.node("Where", by_zero, call.scalar(1), b)
    multiple = call.node("Sub", a, call.node("Mod", a, safe, fmod=1))
    return call.node("Where", by_zero, zero, call.node("Div", multiple, safe))


@onnx_rule("cast")
def _cast(call: OnnxCall) -> OnnxResult:
    """Cast truncates floats toward zero and maps nonzero (NaN included) to true, as kiln's cast does."""
    return call.cast(call.inputs[0], call.attrs["dtype"])


@onnx_rule("linear")
def _linear(call: OnnxCall) -> OnnxResult:
    """x @ weight (+ bias), the weight stored [in, out] as Burn stores it."""
    y = call.node("MatMul", call.inputs[0], call.inputs[1])
    return y if len(call.inputs) == 2 else call.node("Add", y, call.inputs[2])


@onnx_rule("lora")
def _lora(call: OnnxCall) -> OnnxResult:
    """base + scale * (a @ b) (also DoRA's V, whose call has the magnitude as a fourth input)."""
    base, a, b = call.inputs[:3]
    delta = call.node("Mul", call.scalar(call.attrs["scale"]), call.node("MatMul", a, b))
    return call.node("Add", base, delta)


@onnx_rule("dora")
def _dora(call: OnnxCall) -> OnnxResult:
    """magnitude * V / ||V|| over axis 0, V as LoRA computes it."""
    v = _lora(call)
    norm = call.node("Sqrt", call.node("ReduceSum", call.node("Mul", v, v), call.ints((0,)), keepdims=0))
    return call.node("Mul", call.inputs[3], call.node("Div", v, norm))


@onnx_rule(*_REDUCE)
def _reduce(call: OnnxCall) -> OnnxResult:
    """Axes as an input (opset 18); reducing no axis (a scalar, or `axes = []`) is the identity, as in numpy."""
    axes = norm_axes(call.kind, call.attrs["axes"], call.types[0].rank)
    return call.node(_REDUCE[call.kind], call.inputs[0], call.ints(axes), keepdims=int(call.attrs["keepdims"]),
                     noop_with_empty_axes=1)


@onnx_rule(*_NORMALIZED)
def _normalized(call: OnnxCall) -> OnnxResult:
    return call.node(_NORMALIZED[call.kind], call.inputs[0], axis=call.attrs["axis"])


@onnx_rule(*_ARG)
def _arg(call: OnnxCall) -> OnnxResult:
    return call.node(_ARG[call.kind], call.inputs[0], axis=call.attrs["axis"], keepdims=int(call.attrs["keepdims"]),
                     select_last_index=int(call.attrs["select_last_index"]))


@onnx_rule("cumsum")
def _cumsum(call: OnnxCall) -> OnnxResult:
    return call.node("CumSum", call.inputs[0], call.const(np.int64(call.attrs["axis"])),
                     exclusive=int(call.attrs["exclusive"]), reverse=int(call.attrs["reverse"]))


@onnx_rule("topk")
def _topk(call: OnnxCall) -> OnnxResult:
    """TopK sorted, its ties ordered lower index first as kiln's are."""
    return call.sink.node("TopK", [call.inputs[0], call.ints((call.attrs["k"],))],
                          [call.sink.fresh("TopK_values"), call.sink.fresh("TopK_indices")], axis=call.attrs["axis"],
                          largest=int(call.attrs["largest"]), sorted=1)


@onnx_rule("constant")
def _constant(call: OnnxCall) -> OnnxResult:
    return call.const(call.attrs["value"])


@onnx_rule("zeros", "ones", "full")
def _filled(call: OnnxCall) -> OnnxResult:
    """ConstantOfShape holding the op's own one-element value, so `full` converts its value as the op does."""
    (one,) = registry.lookup(call.kind).reference([], {**call.attrs, "shape": (1,)})
    return call.node("ConstantOfShape", call.ints(call.attrs["shape"]), value=numpy_helper.from_array(one))


@onnx_rule("all_reduce", "all_reduce_start", "all_reduce_wait", "broadcast")
def _collective(call: OnnxCall) -> OnnxResult:
    """An exported model runs on one process; a collective in it is a training step's, which ONNX cannot hold."""
    raise call.unsupported("it is a collective of data-parallel training; export the model, not its training step")


@onnx_rule("dropout")
def _dropout(call: OnnxCall) -> OnnxResult:
    """A dropout still here after valid-mode canonicalization is live: its random mask has no ONNX equivalent."""
    raise call.unsupported("its training flag is not known to be false at export (a function input, say), and "
                           "kiln's seeded random mask has no ONNX equivalent; export a module in valid mode")
