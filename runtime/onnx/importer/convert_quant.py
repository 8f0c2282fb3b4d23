"""Converters of ONNX's affine integer quantization: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear,
MatMulInteger, ConvInteger, QLinearMatMul and QLinearConv.

ONNX codes `q = saturate(round_half_even(x / scale) + zero_point)` and decodes `x = (q - zero_point) * scale`,
per tensor, per axis (a [C] scale along `axis`) or per block (`block_size` along `axis`). kiln's own `quantize` /
`dequantize` ops are Burn's symmetric schemes (no zero point, round half away from zero, scales computed by the
op), so they cannot state an ONNX code exactly; every converter here is an exact composition of elementwise ops
(`div`, `round`, `cast`, `maximum`/`minimum`, `sub`, `mul`) instead. A DequantizeLinear of a constant int8 weight (a
QDQ model's initializer) with a zero point of 0 is a kiln quantized parameter instead (`quant_weights`); one with
another zero point the driver folds into a float parameter, which `quantize_weights` can code again.
Integer products accumulate exactly: MatMulInteger in i32 as ONNX states, the convolutions in f64 (kiln's conv
is float only; f64 holds every i32 sum exactly), and QLinear* rescale in f64 as the ONNX reference does.
"""

from __future__ import annotations

import numpy as np

from kiln.ir import DType, Value

from ..tensors import kiln_dtype
from .call import NodeCall
from .convert_basic import cast_to
from .convert_nn import convolve
from .registry import Unsupported, converts

# ONNX's integer code types (i4/u4/i2/u2 codes held one per byte, see `DType.holds_values`); float codes are
# cast to, not rounded and clamped
_CODE_DTYPES = (DType.i8, DType.u8, DType.i16, DType.u16, DType.i4, DType.u4, DType.i2, DType.u2)


def _code_range(dtype: DType) -> tuple[int, int]:
    if dtype not in _CODE_DTYPES:
        raise Unsupported(f"{dtype.value} codes: kiln quantizes to {', '.join(d.value for d in _CODE_DTYPES)} "
                          "and the float8s")
    return dtype.int_range


def _along(call: NodeCall, v: Value, x: Value, axis: int, block: int = 0) -> Value:
    """A scale or zero point shaped to broadcast over x: one element as a scalar, a [C] vector along `axis`, or
    (blocked) each element repeated `block` times along `axis`, the last block cut to x's dim."""
    if v.type.shape and all(d == 1 for d in v.type.shape):
        return call.emit("reshape", v, shape=())
    if not v.type.shape:
        return v
    axis %= x.type.rank
    if not block:
        if v.type.rank != 1:
            raise Unsupported(f"a per-axis scale or zero point of shape {list(v.type.shape)} is not 1-D")
        return call.emit("reshape", v, shape=tuple(-1 if i == axis else 1 for i in range(x.type.rank)))
    n = x.type.shape[axis]
    if n is None:
        raise Unsupported(f"blocked quantization along the dynamic axis {axis} of {x.type}")
    return call.emit("take", v, call.constant(np.arange(n, dtype=np.int64) // block), axis=axis)


def _as(call: NodeCall, v: Value, dtype: DType) -> Value:
    return v if v.type.dtype is dtype else call.emit("cast", v, dtype=dtype)


def _saturate(call: NodeCall, y: Value, zero_point: Value | None, dtype: DType) -> Value:
    """Rounded y plus the zero point, clamped to dtype's range and cast to it (computed in y's float type, so a
    value outside the range saturates instead of wrapping)."""
    low, high = _code_range(dtype)
    if zero_point is not None:
        y = call.emit("add", y, _as(call, zero_point, y.type.dtype))
    y = call.emit("minimum", call.emit("maximum", y, call.constant(float(low), like=y)),
                  call.constant(float(high), like=y))
    return call.emit("cast", y, dtype=dtype)


def _quantize(call: NodeCall, x: Value, scale: Value, zero_point: Value | None, dtype: DType, axis: int = 1,
             block: int = 0) -> Value:
    """saturate(round_half_even(x / scale) + zero_point), the division in x's type as ONNX's reference does; a
    float8 code is x / scale cast to it (rounding to nearest even, saturating unless `saturate=0`), its zero point
    zero (checked by the caller), so -0 stays -0 as in ONNX's reference; a float4 code is x / scale + zero_point
    cast to it (the zero point zero too, its addition taking -0 to +0 as in ONNX's reference; float4 has no inf or
    NaN: ml_dtypes' cast, as ONNX's reference, saturates)."""
    ratio = call.emit("div", x, _as(call, _along(call, scale, x, axis, block), x.type.dtype))
    if dtype.is_float8:
        return cast_to(call, ratio, dtype)
    zero = None if zero_point is None else _along(call, _as(call, zero_point, DType.f32), x, axis, block)
    if dtype is DType.f4e2m1fn:
        return cast_to(call, ratio if zero is None else call.emit("add", _as(call, ratio, DType.f32), zero), dtype)
    _code_range(dtype)  # refuse a code type kiln cannot compute on before its zero point is touched
    rounded = _as(call, call.emit("round", ratio), DType.f32)
    return _saturate(call, rounded, zero, dtype)


def _output_dtype(call: NodeCall, zero_point: Value | None) -> DType:
    """The zero point's type, else the `output_dtype` attribute (opset 21), else u8."""
    if zero_point is not None:
        return zero_point.type.dtype
    given = call.attr("output_dtype", 0)
    return kiln_dtype(given) if given else DType.u8


@converts("QuantizeLinear", since=10)
def _quantize_linear(call: NodeCall) -> Value:
    """Per tensor and per axis (`axis`, opset 13), per block (`block_size`, opset 21); `saturate` concerns only
    float8 codes."""
    x, scale, zero_point = call.input(0), call.input(1), call.optional(2)
    dtype = _output_dtype(call, zero_point)
    if dtype.is_float and zero_point is not None:
        _zero_float_zero_point(call, dtype)
    return _quantize(call, x, scale, zero_point, dtype, call.attr("axis", 1), call.attr("block_size", 0))


def _zero_float_zero_point(call: NodeCall, dtype: DType) -> None:
    """ONNX's float8 zero point must be zero (its reference refuses any other in DequantizeLinear); a float4 one
    kiln requires zero too, as ONNX's reference adds it in QuantizeLinear but ignores it in DequantizeLinear."""
    known = call.value(2, f"a {dtype.value} zero point")
    if known is not None and np.any(known.astype(np.float32) != 0):
        raise Unsupported(f"a {dtype.value} zero point of {known.astype(np.float32).tolist()}: kiln's, as ONNX's "
                          "float8 ones, must be zero")


@converts("DequantizeLinear", since=10)
def _dequantize_linear(call: NodeCall) -> Value:
    """(x - zero_point) * scale in f32, given in the scale's type (or `output_dtype`, opset 23); x may be i32
    codes (a QDQ model's bias) as well as 8- and 16-bit ones."""
    x, scale, zero_point = call.input(0), call.input(1), call.optional(2)
    axis, block = call.attr("axis", 1), call.attr("block_size", 0)
    codes = _as(call, x, DType.f32)
    if zero_point is not None and x.type.dtype.is_float:
        _zero_float_zero_point(call, x.type.dtype)
    elif zero_point is not None:
        codes = call.emit("sub", codes, _along(call, _as(call, zero_point, DType.f32), x, axis, block))
    y = call.emit("mul", codes, _as(call, _along(call, scale, x, axis, block), DType.f32))
    given = call.attr("output_dtype", 0)
    return _as(call, y, kiln_dtype(given) if given else scale.type.dtype)


@converts("DynamicQuantizeLinear", since=11)
def _dynamic_quantize_linear(call: NodeCall) -> tuple[Value, Value, Value]:
    """u8 codes of x with scale = (max(x, 0) - min(x, 0)) / 255 (1 / 255 for an all-zero x) and the zero point
    that maps min(x, 0) to 0."""
    x = _as(call, call.input(0), DType.f32)
    zero = call.constant(0.0, like=x)
    low = call.emit("minimum", call.emit("min", x), zero)
    high = call.emit("maximum", call.emit("max", x), zero)
    span = call.emit("sub", high, low)
    span = call.emit("where", call.emit("equal", span, zero), call.constant(1.0, like=x), span)
    scale = call.emit("div", span, call.constant(255.0, like=x))
    start = call.emit("sub", zero, call.emit("div", low, scale))
    zero_point = _saturate(call, call.emit("round", start), None, DType.u8)
    return _quantize(call, x, scale, zero_point, DType.u8), scale, zero_point


def _centered(call: NodeCall, codes: Value, zero_point: Value | None, dtype: DType, axis: int) -> Value:
    """codes - zero_point in `dtype`, a [C] zero point lying along `axis`."""
    out = _as(call, codes, dtype)
    return out if zero_point is None else call.emit("sub", out, _as(call, _along(call, zero_point, codes, axis), dtype))


@converts("MatMulInteger", since=10)
def _matmul_integer(call: NodeCall) -> Value:
    """(a - a_zero_point) @ (b - b_zero_point) in i32; a [M] a_zero_point is per row, a [N] b_zero_point per
    column."""
    a, b = call.input(0), call.input(1)
    return _integer_matmul(call, a, call.optional(2), b, call.optional(3))


def _integer_matmul(call: NodeCall, a: Value, a_zp: Value | None, b: Value, b_zp: Value | None) -> Value:
    return call.emit("matmul", _centered(call, a, a_zp, DType.i32, -2), _centered(call, b, b_zp, DType.i32, -1))


def _requantize(call: NodeCall, acc: Value, multiplier: Value, zero_point: Value | None, dtype: DType) -> Value:
    """saturate(round_half_even(acc * multiplier) + zero_point), in f64 as ONNX's reference rescales."""
    y = call.emit("mul", _as(call, acc, DType.f64), _as(call, multiplier, DType.f64))
    return _saturate(call, call.emit("round", y), zero_point, dtype)


@converts("QLinearMatMul", since=10)
def _qlinear_matmul(call: NodeCall) -> Value:
    """requantize((a - a_zp) @ (b - b_zp), a_scale * b_scale / y_scale, y_zp): the product exact in i32, the
    multiplier in the scales' type."""
    a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp = (call.input(i) for i in range(8))
    acc = _integer_matmul(call, a, a_zp, b, b_zp)
    multiplier = call.emit("div", call.emit("mul", _along(call, a_scale, acc, -2), _along(call, b_scale, acc, -1)),
                           _along(call, y_scale, acc, -1))
    return _requantize(call, acc, multiplier, y_zp, y_zp.type.dtype)


def _integer_conv(call: NodeCall, x: Value, x_zp: Value | None, w: Value, w_zp: Value | None,
                  bias: Value | None) -> Value:
    """conv(x - x_zp, w - w_zp) + bias, exact in f64; a [O] w_zp is per output channel."""
    xc, wc = _centered(call, x, x_zp, DType.f64, 1), _centered(call, w, w_zp, DType.f64, 0)
    return convolve(call, xc, wc, None if bias is None else _as(call, bias, DType.f64))


@converts("ConvInteger", since=10)
def _conv_integer(call: NodeCall) -> Value:
    acc = _integer_conv(call, call.input(0), call.optional(2), call.input(1), call.optional(3), None)
    return call.emit("cast", acc, dtype=DType.i32)


@converts("QLinearConv", since=10)
def _qlinear_conv(call: NodeCall) -> Value:
    """requantize(conv(x - x_zp, w - w_zp) + B, x_scale * w_scale / y_scale, y_zp); a [O] w_scale is per output
    channel."""
    x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp = (call.input(i) for i in range(8))
    acc = _integer_conv(call, x, x_zp, w, w_zp, call.optional(8))
    multiplier = call.emit("div", call.emit("mul", _along(call, x_scale, acc, 1), _along(call, w_scale, acc, 1)),
                           _along(call, y_scale, acc, 1))
    return _requantize(call, acc, multiplier, y_zp, y_zp.type.dtype)

