"""Converters of ONNX ops that are one kiln op each: the elementwise family and matrix products."""

from __future__ import annotations

import numpy as np

from kiln.ir import Value

from .call import NodeCall
from .registry import Unsupported, converts

_UNARY = {"Relu": "relu", "Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Neg": "neg", "Abs": "abs", "Tanh": "tanh",
          "Sigmoid": "sigmoid", "Erf": "erf"}
_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow", "MatMul": "matmul"}


@converts(*_UNARY, since=6)
def _unary(call: NodeCall) -> Value:
    return call.emit(_UNARY[call.node.op_type], call.input(0))


@converts(*_BINARY, since=7)
def _binary(call: NodeCall) -> Value:
    return call.emit(_BINARY[call.node.op_type], call.input(0), call.input(1))


@converts("Constant", since=1)
def _constant(call: NodeCall) -> Value:
    for key, dtype in (("value", None), ("value_float", np.float32), ("value_int", np.int64),
                       ("value_floats", np.float32), ("value_ints", np.int64)):
        if key in call.attrs:
            return call.constant(np.asarray(call.attrs[key], dtype))
    raise Unsupported("a Constant with neither value, value_float(s) nor value_int(s)")


@converts("Identity", since=1)
def _identity(call: NodeCall) -> Value:
    """The input itself; a parameter passed on becomes a value through a no-op cast (canonicalize drops it)."""
    x = call.input(0)
    return x if isinstance(x, Value) else call.emit("cast", x, dtype=x.type.dtype)
