"""Gradients of matrix products: matmul (numpy semantics), Burn-layout linear, and the LoRA and DoRA derivations."""

from __future__ import annotations

from ..gradients import GradContext, Grads, emit, gradient, matmul_grads, scalar, transpose_last2, unbroadcast
from ..graph import Op


@gradient("matmul")
def _matmul(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    (a, b), (g,) = op.operands, out_grads
    if g is None:
        return (None, None)
    return matmul_grads(ctx, a, b, g, ctx.wanted_float(op, 0), ctx.wanted_float(op, 1))


@gradient("linear")
def _linear(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """x @ weight + bias: the matmul's gradients, and g summed to the bias's shape."""
    (g,) = out_grads
    x, w = op.operands[:2]
    if g is None:
        return (None,) * len(op.operands)
    dx, dw = matmul_grads(ctx, x, w, g, ctx.wanted_float(op, 0), ctx.wanted_float(op, 1))
    if len(op.operands) == 2:
        return (dx, dw)
    return (dx, dw, unbroadcast(ctx, g, op.operands[2].type) if ctx.wanted_float(op, 2) else None)


@gradient("lora")
def _lora(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """base + scale * (a @ b): d base = g, d a = scale * g @ b^T, d b = scale * a^T @ g."""
    (_, a, b), (g,) = op.operands, out_grads
    if g is None:
        return (None, None, None)
    scaled = None
    if ctx.wanted_float(op, 1) or ctx.wanted_float(op, 2):
        scaled = emit(ctx, "mul", g, scalar(ctx, op.attrs["scale"], g.type.dtype))
    return (g if ctx.wanted_float(op, 0) else None,
            emit(ctx, "matmul", scaled, transpose_last2(ctx, b)) if ctx.wanted_float(op, 1) else None,
            emit(ctx, "matmul", transpose_last2(ctx, a), scaled) if ctx.wanted_float(op, 2) else None)


@gradient("dora")
def _dora(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """W' = m * V / n with V = base + scale * (a @ b), n = ||V|| over axis 0, the norm not detached:
    d m = sum(g * V, 0) / n and d V = (m / n) * (g - (sum(g * V, 0) / n^2) * V), which reaches base, a and b
    through the LoRA rule of V (PEFT's optional detach of n would drop the second term)."""
    (base, a, b, m), (g,) = op.operands, out_grads
    want_v = any(ctx.wanted_float(op, i) for i in range(3))
    if g is None or not (want_v or ctx.wanted_float(op, 3)):
        return (None,) * 4
    v = emit(ctx, "lora", base, a, b, scale=op.attrs["scale"])
    n = emit(ctx, "sqrt", emit(ctx, "sum", emit(ctx, "mul", v, v), axes=(0,)))
    vg = emit(ctx, "sum", emit(ctx, "mul", v, g), axes=(0,))
    dm = emit(ctx, "div", vg, n) if ctx.wanted_float(op, 3) else None
    if not want_v:
        return (None, None, None, dm)
    along = emit(ctx, "div", vg, emit(ctx, "mul", n, n))
    dv = emit(ctx, "mul", emit(ctx, "div", m, n), emit(ctx, "sub", g, emit(ctx, "mul", along, v)))
    assert v.owner is not None
    return (*_lora(GradContext(ctx.fb, ctx.wants[:3]), v.owner, (dv,)), dm)
