"""ONNX lowerings of kiln's weight quantization (Burn's symmetric schemes): `quantize` and `dequantize`.

A block layout views a static tensor [d0, d1, ...] as [d0/b0, b0, d1/b1, b1, ...] (a per-tensor block is the
whole tensor); per-block values live at the even axes and broadcast over the odd ones. i4 codes are ONNX INT4.
"""

from __future__ import annotations

import numpy as np

from kiln.ir import DType
from kiln.ir.ops.quant import VALUE_RANGES, block_dims, scales_shape

from .rule import OnnxCall, OnnxResult, onnx_rule


def _layout(call: OnnxCall) -> tuple[list[int], list[int]]:
    """Operand 0's blocked view shape, and the shape of one scale per block kept for broadcasting against it."""
    shape, block = call.static_shape(0), call.attrs["block"]
    counts = scales_shape(call.kind, shape, block) if block else (1,) * len(shape)
    dims = block_dims(call.kind, shape, block)
    return [s for n, b in zip(counts, dims) for s in (n, b)], [s for n in counts for s in (n, 1)]


def _f32(call: OnnxCall, value: float) -> str:
    """An f32 scalar constant: quantization computes in f32 whatever the input's float dtype."""
    return call.const(np.float32(value))


def _round_half_away(call: OnnxCall, v: str) -> str:
    """Rust's `f32::round` (ties away from zero): ONNX's Round rounds them to even."""
    sign = call.node("Sign", v)
    t = call.node("Mul", sign, call.node("Floor", call.node("Abs", v)))
    tie_or_more = call.node("GreaterOrEqual", call.node("Abs", call.node("Sub", v, t)), _f32(call, 0.5))
    return call.node("Where", tie_or_more, call.node("Add", t, sign), t)


@onnx_rule("quantize")
def _quantize(call: OnnxCall) -> OnnxResult:
    """(codes, scales): scale = 2 * peak / (b - a) per block; code = clamp(round_half_away(x / scale), a, b)."""
    a, b = VALUE_RANGES[call.attrs["value"]]
    x = call.cast(call.inputs[0], DType.f32)
    view_shape, _ = _layout(call)
    view = call.node("Reshape", x, call.ints(view_shape))
    within = call.ints(range(1, 2 * call.types[0].rank, 2))
    reduce = "ReduceMean" if call.attrs["calibration"] == "absmean" else "ReduceMax"
    peak = call.node(reduce, call.node("Abs", view), within, keepdims=1)
    scales = call.node("Div", call.node("Mul", peak, _f32(call, 2)), _f32(call, b - a))
    ratio = call.node("Div", view, scales)
    ratio = call.node("Where", call.node("IsNaN", ratio), _f32(call, 0), ratio)  # a zero block codes as 0
    clamped = call.node("Clip", _round_half_away(call, ratio), _f32(call, a), _f32(call, b))
    codes = call.node("Reshape", clamped, call.ints(call.static_shape(0)))
    scales_out = call.ints(scales_shape(call.kind, call.static_shape(0), call.attrs["block"]))
    return call.cast(codes, call.results[0].dtype), call.node("Reshape", scales, scales_out)


@onnx_rule("dequantize")
def _dequantize(call: OnnxCall) -> OnnxResult:
    """scale(block of each element) * code, at the scales' precision, as the result dtype."""
    codes, scales = call.inputs
    view_shape, grid_shape = _layout(call)
    view = call.node("Reshape", call.cast(codes, call.types[1].dtype), call.ints(view_shape))
    product = call.node("Mul", view, call.node("Reshape", scales, call.ints(grid_shape)))
    out = call.node("Reshape", product, call.ints(call.static_shape(0)))
    return call.cast(out, call.results[0].dtype)
