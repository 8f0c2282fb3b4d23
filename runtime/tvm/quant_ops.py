"""Relax lowerings of kiln's weight quantization (Burn's symmetric schemes and NF4): `quantize` and `dequantize`.

`decode` is the one per-element rule (code and its block's scale to a float; `double_scale` first turns a
double-quantized scale code into that scale) and `decoder` applies it to one element of a `dequantize` call's
operands; the plain `dequantize` lowering is a te.compute over it, and a kernel that dequantizes inside a matmul
(`quant_matmul`) calls it on the codes it loads, so a new quantization form is one case here. A block layout views a
tensor [d0, d1, ...] as [d0/b0, b0, d1/b1, b1, ...] for `quantize`'s reductions. Sub-byte codes are int8 in TVM
(see `dtypes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tvm import relax, te, tirx
from tvm.relax import op as R

from kiln.ir import DType
from kiln.ir.ops.quant import (
    LOOKUP_BIAS,
    LOOKUP_TABLES,
    SCALE_GROUP,
    VALUE_RANGES,
    block_dims,
    midpoints,
    scale_ratio,
)

from .dtypes import tvm_dtype
from .rule import OpCall, RelaxResult, relax_rule


def decode(code: tirx.PrimExpr, scale: tirx.PrimExpr, dtype: str = "float32",
           levels: te.Tensor | None = None) -> tirx.PrimExpr:
    """The value of one code given its block's scale, computed in `dtype` (the scales' compute dtype: f32 for
    f16/bf16/f32 and double-quantized scales, f64 for f64): `quant.dequantize` per element. A lookup kind (NF4)
    reads its level from `levels`, its table as a small tensor (one load, where a chain of selects would cost
    one compare per level inside a matmul's inner loop)."""
    if levels is None:
        level = code.astype(dtype)
    else:
        level = levels[code.astype("int32") - tirx.const(LOOKUP_BIAS, "int32")].astype(dtype)
    return level * scale.astype(dtype)


def scale_index(index: Sequence[tirx.PrimExpr], block: Sequence[int]) -> tuple[tirx.PrimExpr, ...]:
    """Where the scale of the element at `index` sits in the scales tensor ([0] when per-tensor)."""
    if not block:
        return (tirx.const(0, "int64"),)
    dims = (1,) * (len(index) - len(block)) + tuple(block)
    return tuple(i if b == 1 else tirx.floordiv(i, b) for i, b in zip(index, dims))


def _layout(call: OpCall) -> tuple[list[tirx.PrimExpr], list[tirx.PrimExpr]] | None:
    """(blocked view shape, scales shape) of operand 0, or None for one per-tensor block."""
    block = call.attrs["block"]
    if not block:
        return None
    shape = call.shape(0)
    dims = block_dims("quantize", [None] * len(shape), block)
    counts = [d if b == 1 else tirx.floordiv(d, b) for d, b in zip(shape, dims)]
    return [s for n, b in zip(counts, dims) for s in (n, b)], counts


def _round_half_away(v: relax.Expr) -> relax.Expr:
    """Rust's `f32::round`: ties away from zero."""
    t = R.trunc(v)
    return R.where(R.greater_equal(R.abs(R.subtract(v, t)), relax.const(0.5, "float32")), R.add(t, R.sign(v)), t)


def _round_up(call: OpCall, scales: relax.Expr, dtype: DType) -> relax.Expr:
    """f32 scales in a narrower float dtype, each the least representable value >= it (`quant.round_up`).

    bf16 is the high half of an f32, so it rounds up in f32 bits (TVM computes bf16 as f32 and cannot bit cast
    it); f16 bumps the nearest half's bits when that is below the scale."""
    narrow = tvm_dtype(dtype)

    def element_bf16(s: tirx.PrimExpr) -> tirx.PrimExpr:
        bits = tirx.reinterpret("uint32", s)
        low = tirx.const(0xFFFF, "uint32")
        up = tirx.Select(tirx.bitwise_and(bits, low) != 0, tirx.bitwise_or(bits, low) + tirx.const(1, "uint32"), bits)
        return tirx.reinterpret("float32", up).astype(narrow)

    def element_f16(s: tirx.PrimExpr) -> tirx.PrimExpr:
        near = s.astype(narrow)
        bump = tirx.Select(near.astype("float32") < s, tirx.const(1, "uint16"), tirx.const(0, "uint16"))
        return tirx.reinterpret(narrow, tirx.reinterpret("uint16", near) + bump)

    element = element_bf16 if dtype is DType.bf16 else element_f16

    def compute(s: te.Tensor) -> te.Tensor:
        return te.compute(s.shape, lambda *i: element(s[i]), name="round_up")

    return call.bb.call_te(compute, scales, primfunc_name_hint="round_up")


def _codes(value: str, ratio: relax.Expr) -> relax.Expr:
    """Burn's clamped rounding of x / scale, or the count of lookup midpoints it exceeds (`quant._code`)."""
    if value in LOOKUP_TABLES:
        ratio = R.where(R.isnan(ratio), relax.const(0.0, "float32"), ratio)
        above = [R.astype(R.greater(ratio, relax.const(float(m), "float32")), "int32") for m in midpoints(value)]
        count = above[0]
        for a in above[1:]:
            count = R.add(count, a)
        return R.add(count, relax.const(LOOKUP_BIAS, "int32"))
    a, b = VALUE_RANGES[value]
    ratio = R.where(R.isnan(ratio), relax.const(0.0, "float32"), ratio)  # a zero block codes as 0
    return R.minimum(R.maximum(_round_half_away(ratio), relax.const(a, "float32")), relax.const(b, "float32"))


@relax_rule("quantize")
def _quantize(call: OpCall) -> RelaxResult:
    """(codes, scales): scale = peak * m / d per block, rounded up when narrower than f32; codes of x / scale."""
    value, scale_dtype = call.attrs["value"], call.attrs["scale_dtype"]
    m, d = scale_ratio(value)
    x = call.emit(R.astype(call.args[0], "float32"))
    layout = _layout(call)
    view = call.emit(R.reshape(x, layout[0])) if layout else x
    axes = list(range(1, 2 * call.types[0].rank, 2)) if layout else None
    reduce = R.mean if call.attrs["calibration"] == "absmean" else R.max  # BitNet's absmean, or min/max
    peak = reduce(R.abs(view), axes, keepdims=True)
    scales = call.emit(R.divide(R.multiply(peak, relax.const(m, "float32")), relax.const(d, "float32")))
    if scale_dtype is not DType.f32:
        scales = call.emit(_round_up(call, scales, scale_dtype))
    ratio = call.emit(R.divide(view, R.astype(scales, "float32")))
    codes = R.astype(_codes(value, ratio), "int8")
    codes = R.reshape(call.emit(codes), call.shape(0)) if layout else codes
    return codes, R.reshape(scales, layout[1] if layout else [1])


def double_scale(code: tirx.PrimExpr, group_scale: tirx.PrimExpr, offset: tirx.PrimExpr) -> tirx.PrimExpr:
    """The f32 scale a double-quantized scale code stands for (`quant.double_scales`)."""
    return code.astype("float32") * group_scale + offset


def flat_index(index: Sequence[tirx.PrimExpr], shape: Sequence[tirx.PrimExpr]) -> tirx.PrimExpr:
    """The row-major position of `index` in a tensor of `shape`."""
    flat = tirx.const(0, "int64")
    for i, n in zip(index, shape):
        flat = flat * n + i
    return flat


@dataclass(frozen=True)
class Decoder:
    """The per-element decode of a `dequantize` call: the operands a kernel passes (the call's, then a lookup
    kind's level table as a constant) and `element(their TE tensors, an index into the codes)`, that element's
    value in the target dtype: `decode` of its code with its block's scale (from the double-quantized form when
    there are second-level operands)."""

    operands: tuple[relax.Expr, ...]
    element: Callable[[Sequence[te.Tensor], Sequence[tirx.Expr]], tirx.Expr]


def decoder(call: OpCall) -> Decoder:
    """The Decoder of one `dequantize` call, which the plain lowering and every fused consumer share."""
    value, block, out = call.attrs["value"], call.attrs["block"], tvm_dtype(call.attrs["dtype"])
    precision = "float32" if len(call.args) > 2 else tvm_dtype(call.types[1].dtype.compute)
    table = LOOKUP_TABLES.get(value)
    levels = () if table is None else (relax.const(np.asarray(table, np.float32)),)

    def element(tensors: Sequence[te.Tensor], index: Sequence[tirx.PrimExpr]) -> tirx.PrimExpr:
        codes, scales, *second = tensors[:len(tensors) - len(levels)]
        at = scale_index(index, block)
        scale = scales[at]
        if second:
            group = tirx.floordiv(flat_index(at, scales.shape), SCALE_GROUP)
            scale = double_scale(scale, second[0][group], second[1][0])
        return decode(codes[tuple(index)], scale, precision, tensors[-1] if levels else None).astype(out)

    return Decoder((*call.args, *levels), element)


@relax_rule("dequantize")
def _dequantize(call: OpCall) -> RelaxResult:
    """`decoder` over every code: one elementwise kernel."""
    dec = decoder(call)

    def compute(*tensors: te.Tensor) -> te.Tensor:
        return te.compute(tensors[0].shape, lambda *i: dec.element(tensors, i), name="dequantize")

    return call.bb.call_te(compute, *dec.operands, primfunc_name_hint="dequantize")
