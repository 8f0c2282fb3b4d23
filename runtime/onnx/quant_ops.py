"""ONNX lowerings of kiln's weight quantization (Burn's symmetric schemes and NF4): `quantize` and `dequantize`.

A block layout views a static tensor [d0, d1, ...] as [d0/b0, b0, d1/b1, b1, ...] (a per-tensor block is the
whole tensor); per-block values live at the even axes and broadcast over the odd ones. i4 codes are ONNX INT4;
an NF4 code's level is a Gather from the table. `quantize` exports f32 scales only: Burn's round-up to f16/bf16
needs a bit cast, which ONNX lacks.
"""

from __future__ import annotations

import numpy as np

from kiln.ir import DType, KilnError
from kiln.ir.ops.quant import (
    LOOKUP_BIAS,
    LOOKUP_TABLES,
    SCALE_GROUP,
    VALUE_RANGES,
    block_dims,
    midpoints,
    scale_ratio,
    scales_shape,
)

from .rule import OnnxCall, OnnxResult, onnx_rule
from .tensors import onnx_dtype


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


def _codes(call: OnnxCall, ratio: str) -> str:
    """Burn's clamped rounding of x / scale, or the count of lookup midpoints it exceeds (`quant._code`)."""
    value = call.attrs["value"]
    ratio = call.node("Where", call.node("IsNaN", ratio), _f32(call, 0), ratio)  # a zero block codes as 0
    if value in LOOKUP_TABLES:
        above = call.node("Cast", call.node("Greater", call.node("Unsqueeze", ratio, call.ints([-1])),
                                            call.const(midpoints(value))), to=onnx_dtype(DType.f32))
        count = call.node("ReduceSum", above, call.ints([-1]), keepdims=0)
        return call.node("Add", count, _f32(call, LOOKUP_BIAS))
    a, b = VALUE_RANGES[value]
    return call.node("Clip", _round_half_away(call, ratio), _f32(call, a), _f32(call, b))


def _levels(call: OnnxCall, codes: str, dtype: DType) -> str:
    """Each code's level in `dtype`: the code, or its entry of the lookup table."""
    table = LOOKUP_TABLES.get(call.attrs["value"])
    if table is None:
        return call.cast(codes, dtype)
    index = call.node("Sub", call.cast(codes, DType.i32), call.const(np.int32(LOOKUP_BIAS)))
    return call.node("Gather", call.const(table.astype(dtype.numpy)), index)


@onnx_rule("quantize")
def _quantize(call: OnnxCall) -> OnnxResult:
    """(codes, scales): scale = peak * m / d per block; codes of x / scale."""
    if call.attrs["scale_dtype"] is not DType.f32:
        raise KilnError(f"quantize: ONNX export supports f32 scales only, not scale_dtype = "
                        f"{call.attrs['scale_dtype'].value} (Burn's round-up needs a bit cast ONNX lacks)")
    m, d = scale_ratio(call.attrs["value"])
    x = call.cast(call.inputs[0], DType.f32)
    view_shape, _ = _layout(call)
    view = call.node("Reshape", x, call.ints(view_shape))
    within = call.ints(range(1, 2 * call.types[0].rank, 2))
    reduce = "ReduceMean" if call.attrs["calibration"] == "absmean" else "ReduceMax"
    peak = call.node(reduce, call.node("Abs", view), within, keepdims=1)
    scales = call.node("Div", call.node("Mul", peak, _f32(call, m)), _f32(call, d))
    codes = call.node("Reshape", _codes(call, call.node("Div", view, scales)), call.ints(call.static_shape(0)))
    scales_out = call.ints(scales_shape(call.kind, call.static_shape(0), call.attrs["block"]))
    return call.cast(codes, call.results[0].dtype), call.node("Reshape", scales, scales_out)


@onnx_rule("dequantize")
def _dequantize(call: OnnxCall) -> OnnxResult:
    """scale(block of each element) * level(code), in the scales' compute dtype, as the result dtype."""
    codes, scales = call.inputs[:2]
    if len(call.inputs) > 2:  # double-quantized: q * scale_scales[group] + offset, groups by row-major position
        scales_type = call.types[1]
        groups = np.arange(int(np.prod(scales_type.shape))).reshape(scales_type.shape) // SCALE_GROUP
        group_scales = call.node("Gather", call.inputs[2], call.const(groups.astype(np.int64)))
        scales = call.node("Add", call.node("Mul", call.cast(scales, DType.f32), group_scales), call.inputs[3])
    compute = DType.f32 if len(call.inputs) > 2 else call.types[1].dtype.compute
    view_shape, grid_shape = _layout(call)
    view = call.node("Reshape", _levels(call, codes, compute), call.ints(view_shape))
    grid = call.node("Reshape", call.cast(scales, compute), call.ints(grid_shape))
    product = call.node("Mul", view, grid)
    out = call.node("Reshape", product, call.ints(call.static_shape(0)))
    return call.cast(out, call.results[0].dtype)
