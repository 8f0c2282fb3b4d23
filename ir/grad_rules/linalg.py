"""Gradients of matrix products: matmul (numpy semantics), Burn-layout linear, and the LoRA derivation."""

from __future__ import annotations

from ..builder import FunctionBuilder
from ..gradients import emit, gradient, is_float, matmul_grads, scalar, transpose_last2, unbroadcast, wanted
from ..graph import Op, Value

Grads = tuple[Value | None, ...]


def _want(fb: FunctionBuilder, op: Op, i: int) -> bool:
    return i < len(op.operands) and is_float(op.operands[i]) and wanted(fb, i)


@gradient("matmul")
def _matmul(fb: FunctionBuilder, op: Op, out_grads: Grads) -> Grads:
    (a, b), (g,) = op.operands, out_grads
    if g is None:
        return (None, None)
    return matmul_grads(fb, a, b, g, _want(fb, op, 0), _want(fb, op, 1))


@gradient("linear")
def _linear(fb: FunctionBuilder, op: Op, out_grads: Grads) -> Grads:
    """x @ weight + bias: the matmul's gradients, and g summed to the bias's shape."""
    (g,) = out_grads
    x, w = op.operands[:2]
    if g is None:
        return (None,) * len(op.operands)
    dx, dw = matmul_grads(fb, x, w, g, _want(fb, op, 0), _want(fb, op, 1))
    if len(op.operands) == 2:
        return (dx, dw)
    return (dx, dw, unbroadcast(fb, g, op.operands[2].type) if _want(fb, op, 2) else None)


@gradient("lora")
def _lora(fb: FunctionBuilder, op: Op, out_grads: Grads) -> Grads:
    """base + scale * (a @ b): d base = g, d a = scale * g @ b^T, d b = scale * a^T @ g."""
    (_, a, b), (g,) = op.operands, out_grads
    if g is None:
        return (None, None, None)
    scaled = None
    if _want(fb, op, 1) or _want(fb, op, 2):
        scaled = emit(fb, "mul", g, scalar(fb, op.attrs["scale"], g.type.dtype))
    return (g if _want(fb, op, 0) else None,
            emit(fb, "matmul", scaled, transpose_last2(fb, b)) if _want(fb, op, 1) else None,
            emit(fb, "matmul", transpose_last2(fb, a), scaled) if _want(fb, op, 2) else None)
