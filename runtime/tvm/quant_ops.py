"""Relax lowerings of kiln's weight quantization (Burn's symmetric schemes): `quantize` and `dequantize`.

A block layout views a tensor [d0, d1, ...] as [d0/b0, b0, d1/b1, b1, ...]; per-block values live at the even
axes and broadcast over the odd ones. Sub-byte codes are int8 in TVM (see `dtypes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tvm import relax, te, tirx
from tvm.relax import op as R

from kiln.ir.ops.quant import VALUE_RANGES

from .dtypes import tvm_dtype
from .rule import OpCall, RelaxResult, relax_rule


def _layout(call: OpCall) -> tuple[list[tirx.PrimExpr], list[tirx.PrimExpr]] | None:
    """(blocked view shape, scales shape) of operand 0, or None for one per-tensor block."""
    block = call.attrs["block"]
    if not block:
        return None
    shape = call.shape(0)
    dims = (1,) * (len(shape) - len(block)) + tuple(block)
    counts = [d if b == 1 else tirx.floordiv(d, b) for d, b in zip(shape, dims)]
    return [s for n, b in zip(counts, dims) for s in (n, b)], counts


def _round_half_away(v: relax.Expr) -> relax.Expr:
    """Rust's `f32::round`: ties away from zero."""
    t = R.trunc(v)
    return R.where(R.greater_equal(R.abs(R.subtract(v, t)), relax.const(0.5, "float32")), R.add(t, R.sign(v)), t)


@relax_rule("quantize")
def _quantize(call: OpCall) -> RelaxResult:
    """(codes, scales): scale = 2 * peak / (b - a) per block; code = clamp(round_half_away(x / scale), a, b)."""
    a, b = VALUE_RANGES[call.attrs["value"]]
    x = call.emit(R.astype(call.args[0], "float32"))
    layout = _layout(call)
    view = call.emit(R.reshape(x, layout[0])) if layout else x
    axes = list(range(1, 2 * call.types[0].rank, 2)) if layout else None
    reduce = R.mean if call.attrs["calibration"] == "absmean" else R.max  # BitNet's absmean, or min/max
    peak = reduce(R.abs(view), axes, keepdims=True)
    doubled = R.multiply(peak, relax.const(2.0, "float32"))
    scales = call.emit(R.divide(doubled, relax.const(float(b - a), "float32")))  # rounded as the reference
    ratio = call.emit(R.divide(view, scales))
    ratio = R.where(R.isnan(ratio), relax.const(0.0, "float32"), ratio)  # a zero block codes as 0
    codes = R.minimum(R.maximum(_round_half_away(ratio), relax.const(a, "float32")), relax.const(b, "float32"))
    codes = R.astype(R.reshape(call.emit(codes), call.shape(0)) if layout else codes, "int8")
    return codes, R.reshape(scales, layout[1] if layout else [1])


Decode = Callable[[Sequence[te.Tensor], Sequence[tirx.Expr]], tirx.Expr]


def decoder(call: OpCall) -> Decode:
    """The one per-element decode of a `dequantize` call: (its operands as TE tensors, an element index of the codes)
    -> that element's float value. The plain lowering and every fused consumer (`quant_matmul`) read codes through it,
    so a new quantization form is one case here."""
    block = call.attrs["block"]
    rank = call.types[0].rank
    dims = (1,) * (rank - len(block)) + tuple(block) if block else None
    wide, out = call.dtype(1), tvm_dtype(call.attrs["dtype"])

    def decode(tensors: Sequence[te.Tensor], index: Sequence[tirx.PrimExpr]) -> tirx.PrimExpr:
        codes, scales = tensors
        at = [i if b == 1 else tirx.floordiv(i, b) for i, b in zip(index, dims)] if dims else [0]
        return (codes[tuple(index)].astype(wide) * scales[tuple(at)]).astype(out)

    return decode


@relax_rule("dequantize")
def _dequantize(call: OpCall) -> RelaxResult:
    """scale(block of each element) * code, at the scales' precision, as the target dtype: one elementwise kernel."""
    decode = decoder(call)
    return call.bb.call_te(lambda *ts: te.compute(ts[0].shape, lambda *i: decode(ts, i), name="dequantize"), *call.args,
                           primfunc_name_hint="dequantize")
