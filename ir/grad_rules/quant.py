"""Gradients of weight quantization. Codes are integers: no gradient reaches them or flows from them.

- dequantize (scale * level(code) per block): d scales = sum over each block of g * level(code), computed in
  the scales' compute dtype (none for double-quantized scales, which are integer codes as well);
- quantize: only its scales result is differentiable, scale = peak * m / d per block (`scale_ratio`) with peak = max |x|
  (`minmax`, the gradient split evenly over tied maxima as torch's amax) or mean |x| (`absmean`). There is no
  straight-through estimator here: the codes, being piecewise constant, have none.

Both work on the blocked view [n0, b0, n1, b1, ...] of the tensor (a reshape, so at most one dynamic dim).
"""

from __future__ import annotations

from ..dtypes import DType
from ..gradients import Emitter, GradContext, Grads, emit, gradient, is_float, reshape_to, scalar
from ..graph import Op, Operand
from ..ops.quant import LOOKUP_BIAS, LOOKUP_TABLES, block_dims, scale_ratio


def _views(shape, block):
    """(blocked shape [n0, b0, n1, b1, ...], within-block axes, per-block kept shape [n0, 1, n1, 1, ...])."""
    dims = block_dims("quantize", shape, block)  # the op's own layout rule (already checked at inference)
    counts = [None if d is None else (d // b if b else 1) for d, b in zip(shape, dims)]
    blocked = tuple(s for n, b in zip(counts, dims) for s in (n, b))
    inner = tuple(range(1, 2 * len(shape), 2))
    kept = tuple(s for n in counts for s in (n, 1))
    return blocked, inner, kept


def _cast(fb: Emitter, v: Operand, dtype: DType) -> Operand:
    return v if v.type.dtype is dtype else emit(fb, "cast", v, dtype=dtype)


def _levels(ctx: GradContext, codes: Operand, value: str, dtype: DType) -> Operand:
    """The level of each code in `dtype` (`quant.levels` in IR): the code, or its lookup-table entry."""
    if value not in LOOKUP_TABLES:
        return _cast(ctx, codes, dtype)
    index = emit(ctx, "sub", _cast(ctx, codes, DType.i32), scalar(ctx, LOOKUP_BIAS, DType.i32))
    table = LOOKUP_TABLES[value].astype(dtype.numpy)
    return emit(ctx, "take", emit(ctx, "constant", value=table), index)


@gradient("dequantize")
def _dequantize(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    (codes, scales), (g,) = op.operands[:2], out_grads
    if g is None or not is_float(scales) or not ctx.wanted(1):  # double-quantized scales are codes too
        return (None,) * len(op.operands)
    blocked, inner, _ = _views(codes.type.shape, op.attrs["block"])
    dt = scales.type.dtype.compute
    prod = emit(ctx, "mul", _cast(ctx, g, dt), _levels(ctx, codes, op.attrs["value"], dt))
    per_block = emit(ctx, "sum", reshape_to(ctx, prod, blocked, "dequantize"), axes=inner)
    return (None, _cast(ctx, reshape_to(ctx, per_block, scales.type.shape, "dequantize"), scales.type.dtype))


@gradient("quantize")
def _quantize(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    (x,), (_, gs) = op.operands, out_grads
    if gs is None or not is_float(x) or not ctx.wanted(0):
        return (None,)
    f32 = DType.f32  # quantize computes in f32
    m, d = scale_ratio(op.attrs["value"])
    blocked, inner, kept = _views(x.type.shape, op.attrs["block"])
    xb = reshape_to(ctx, _cast(ctx, x, f32), blocked, "quantize")
    zero = scalar(ctx, 0.0, f32)
    sign = emit(ctx, "where", emit(ctx, "greater", xb, zero), scalar(ctx, 1.0, f32),
                emit(ctx, "where", emit(ctx, "less", xb, zero), scalar(ctx, -1.0, f32), zero))
    share = emit(ctx, "mul", _cast(ctx, reshape_to(ctx, gs, kept, "quantize"), f32), scalar(ctx, m / d, f32))
    if op.attrs["calibration"] == "absmean":
        size = 1
        for i in inner:
            size *= blocked[i]
        weight = emit(ctx, "div", sign, scalar(ctx, float(size), f32))
    else:
        mag = emit(ctx, "abs", xb)
        hit = emit(ctx, "cast", emit(ctx, "equal", mag, emit(ctx, "max", mag, axes=inner, keepdims=True)), dtype=f32)
        weight = emit(ctx, "div", emit(ctx, "mul", sign, hit), emit(ctx, "sum", hit, axes=inner, keepdims=True))
    dx = reshape_to(ctx, emit(ctx, "mul", weight, share), x.type.shape, "quantize")
    return (_cast(ctx, dx, x.type.dtype),)
