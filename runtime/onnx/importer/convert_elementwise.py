"""Converters of ONNX's elementwise ops kiln has no one op for, or one op under another name: rounding, logic,
Clip, Mod, PRelu and the activations, composed from kiln ops where the composition is exact."""

from __future__ import annotations

import numpy as np

from kiln.ir import Value

from .call import NodeCall
from .registry import Unsupported, converts

_UNARY = {"Floor": "floor", "Ceil": "ceil"}
_LOGIC = {"And": "logical_and", "Or": "logical_or", "Xor": "logical_xor"}


@converts(*_UNARY, since=6)
def _unary(call: NodeCall) -> Value:
    return call.emit(_UNARY[call.node.op_type], call.input(0))


@converts("Sign", since=9)
def _sign(call: NodeCall) -> Value:
    return call.emit("sign", call.input(0))


@converts("Not", since=1)
def _not(call: NodeCall) -> Value:
    return call.emit("logical_not", call.input(0))


@converts("Round", since=11)
def _round(call: NodeCall) -> Value:
    """Halves to even, as kiln's round."""
    return call.emit("round", call.input(0))


@converts(*_LOGIC, since=7)
def _logic(call: NodeCall) -> Value:
    return call.emit(_LOGIC[call.node.op_type], call.input(0), call.input(1))


def _clamp(call: NodeCall, x: Value, low: Value | None, high: Value | None) -> Value:
    """max(x, low) then min(., high), ONNX's order: with low > high every element becomes high."""
    y = x if low is None else call.emit("maximum", x, low)
    return y if high is None else call.emit("minimum", y, high)


@converts("Clip", since=6, until=10)
def _clip_attrs(call: NodeCall) -> Value:
    """min and max as attributes; absent is unbounded."""
    x = call.input(0)
    low, high = call.attr("min"), call.attr("max")
    return _clamp(call, x, None if low is None else call.constant(low, like=x),
                  None if high is None else call.constant(high, like=x))


@converts("Clip", since=11)
def _clip_inputs(call: NodeCall) -> Value:
    """min and max as optional scalar inputs, which may be computed at run time."""
    return _clamp(call, call.input(0), call.optional(1), call.optional(2))


def _affine(call: NodeCall, x: Value, alpha: float, beta: float) -> Value:
    return call.emit("add", call.emit("mul", x, call.constant(alpha, like=x)), call.constant(beta, like=x))


def _unit_clamp(call: NodeCall, x: Value) -> Value:
    return _clamp(call, x, call.constant(0.0, like=x), call.constant(1.0, like=x))


@converts("HardSigmoid", since=6)
def _hard_sigmoid(call: NodeCall) -> Value:
    """max(0, min(1, alpha * x + beta))."""
    x = call.input(0)
    return _unit_clamp(call, _affine(call, x, call.attr("alpha", 0.2), call.attr("beta", 0.5)))


@converts("HardSwish", since=14)
def _hard_swish(call: NodeCall) -> Value:
    """x * HardSigmoid(x) with alpha = 1/6, beta = 0.5."""
    x = call.input(0)
    return call.emit("mul", x, _unit_clamp(call, _affine(call, x, 1 / 6, 0.5)))


def softplus(call: NodeCall, x: Value) -> Value:
    """log(1 + exp(x)) as max(x, 0) + log(1 + exp(-|x|)), which never overflows."""
    tail = call.emit("log", call.emit("add", call.constant(1.0, like=x), call.emit("exp", call.emit("neg", call.emit(
        "abs", x)))))
    return call.emit("add", call.emit("relu", x), tail)


@converts("Softplus", since=1)
def _softplus(call: NodeCall) -> Value:
    return softplus(call, call.input(0))


@converts("Mish", since=18)
def _mish(call: NodeCall) -> Value:
    """x * tanh(softplus(x))."""
    x = call.input(0)
    return call.emit("mul", x, call.emit("tanh", softplus(call, x)))


@converts("Softsign", since=1)
def _softsign(call: NodeCall) -> Value:
    """x / (1 + |x|)."""
    x = call.input(0)
    return call.emit("div", x, call.emit("add", call.constant(1.0, like=x), call.emit("abs", x)))


def _expm1_negative(call: NodeCall, x: Value, scale: float) -> Value:
    """scale * (exp(min(x, 0)) - 1): the negative branch of the ELU family, finite (and with a finite gradient)
    where the positive branch is chosen."""
    e = call.emit("exp", call.emit("minimum", x, call.constant(0.0, like=x)))
    return call.emit("mul", call.emit("sub", e, call.constant(1.0, like=x)), call.constant(scale, like=x))


@converts("Elu", since=6)
def _elu(call: NodeCall) -> Value:
    """x for x >= 0, alpha * (exp(x) - 1) below."""
    x = call.input(0)
    negative = call.emit("less", x, call.constant(0.0, like=x))
    return call.emit("where", negative, _expm1_negative(call, x, call.attr("alpha", 1.0)), x)


@converts("Selu", since=6)
def _selu(call: NodeCall) -> Value:
    """gamma * x for x > 0, gamma * alpha * (exp(x) - 1) otherwise."""
    x = call.input(0)
    alpha, gamma = call.attr("alpha", 1.67326319217681884765625), call.attr("gamma", 1.05070102214813232421875)
    positive = call.emit("greater", x, call.constant(0.0, like=x))
    y = call.emit("where", positive, x, _expm1_negative(call, x, alpha))
    return call.emit("mul", y, call.constant(gamma, like=x))


@converts("Celu", since=12)
def _celu(call: NodeCall) -> Value:
    """max(0, x) + min(0, alpha * (exp(x / alpha) - 1))."""
    x = call.input(0)
    alpha = call.attr("alpha", 1.0)
    scaled = call.emit("div", x, call.constant(alpha, like=x))
    return call.emit("add", call.emit("relu", x), _expm1_negative(call, scaled, alpha))


@converts("PRelu", since=7)
def _prelu(call: NodeCall) -> Value:
    """x where x >= 0, slope * x below; slope broadcasts to x."""
    x, slope = call.input(0), call.input(1)
    negative = call.emit("less", x, call.constant(0, like=x))
    return call.emit("where", negative, call.emit("mul", x, slope), x)


@converts("Mod", since=10)
def _mod(call: NodeCall) -> Value:
    """Integer remainders: fmod = 1 takes the dividend's sign (C's %), fmod = 0 the divisor's (Python's %).
    kiln's integer div truncates toward zero, so a - div(a, b) * b is C's remainder exactly."""
    a, b = call.input(0), call.input(1)
    if not a.type.dtype.is_int:
        raise Unsupported(f"Mod of {a.type.dtype.value} tensors: kiln composes only the integer remainder exactly")
    rem = call.emit("sub", a, call.emit("mul", call.emit("div", a, b), b))
    if call.attr("fmod", 0):
        return rem
    zero = call.constant(np.zeros((), a.type.dtype.numpy))
    signs_differ = call.emit("logical_xor", call.emit("less", rem, zero), call.emit("less", b, zero))
    wrong = call.emit("logical_and", signs_differ, call.emit("logical_not", call.emit("equal", rem, zero)))
    return call.emit("where", wrong, call.emit("add", rem, b), rem)
