"""ONNX's Cast to FLOAT8E8M0 (opset 24's `round_mode`) as kiln elementwise ops: kiln's own cast to f8e8m0fnu is
ml_dtypes' conversion, which rounds differently and never saturates, so the importer states ONNX's rule exactly."""

from __future__ import annotations

import math

import numpy as np

from kiln.ir import DType, Value

from .call import NodeCall
from .registry import Unsupported

_LEAST_NORMAL = 2.0**-126  # f32's: below it the f32 exponent field is 0, which ONNX's rule keeps as 2**-127
_TOP = 2.0**127  # f8e8m0fnu's greatest value


def to_e8m0(call: NodeCall, x: Value, saturate: bool, round_mode: str) -> Value:
    """x as f8e8m0fnu: the power of two at or below |x| (the sign dropped; `round_mode` "down"), at or above it
    ("up", the default) or the nearer one, halfway rounding up ("nearest"); NaN and ±inf give NaN, and a rounding
    past 2**127 gives NaN, or 2**127 when `saturate`. Under 2**-126 the result is 2**-127, rounded up to 2**-126
    for any nonzero |x| ("up") or one above 2**-127 ("nearest"), as ONNX's rule reads the f32 exponent field."""
    if round_mode not in ("up", "down", "nearest"):
        raise Unsupported(f"round_mode {round_mode!r}: ONNX's are 'up', 'down' and 'nearest'")
    a = call.emit("abs", x if x.type.dtype is DType.f32 else call.emit("cast", x, dtype=DType.f32))

    def const(v: float) -> Value:
        return call.constant(np.float32(v), like=a)

    def where(cond: Value, yes: Value, no: Value) -> Value:
        return call.emit("where", cond, yes, no)

    exponent = call.emit("floor", call.emit("div", call.emit("log", a), const(math.log(2.0))))
    p = call.emit("pow", const(2.0), exponent)
    # log's rounding can miss by one: step back below |x|, or up to the greatest power of two not above it
    p = where(call.emit("greater", p, a), call.emit("div", p, const(2.0)), p)
    twice = call.emit("mul", p, const(2.0))
    p = where(call.emit("greater", twice, a), p, twice)
    twice = call.emit("mul", p, const(2.0))
    if round_mode == "up":
        p = where(call.emit("greater", a, p), twice, p)
    elif round_mode == "nearest":
        p = where(call.emit("less", a, call.emit("mul", p, const(1.5))), p, twice)
    if saturate:
        p = call.emit("minimum", p, const(_TOP))
    threshold = {"up": 0.0, "nearest": 2.0**-127}.get(round_mode)
    tiny = const(2.0**-127) if threshold is None else where(call.emit("greater", a, const(threshold)),
                                                           const(_LEAST_NORMAL), const(2.0**-127))
    p = where(call.emit("less", a, const(_LEAST_NORMAL)), tiny, p)
    p = where(call.emit("less", a, const(math.inf)), p, const(math.nan))  # NaN and ±inf
    return call.emit("cast", p, dtype=DType.f8e8m0fnu)
