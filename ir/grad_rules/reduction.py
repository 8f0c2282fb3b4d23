"""Gradients of reductions (sum, mean, max, min over axes) and of softmax / log_softmax."""

from __future__ import annotations

from ..gradients import GradContext, Grads, count, emit, expand, gradient, is_float, unsqueeze
from ..graph import Op
from ..ops.common import norm_axes, norm_axis


def _setup(ctx: GradContext, op: Op, out_grads: Grads):
    fb = ctx.fb
    (x,), (g,) = op.operands, out_grads
    if g is None or not is_float(x) or not ctx.wanted(0):
        return None
    axes = norm_axes(op.kind, op.attrs["axes"], x.type.rank)
    keep = g if op.attrs["keepdims"] or not axes or g.type.rank == 0 else unsqueeze(fb, g, axes)
    return x, axes, keep


@gradient("sum")
def _sum(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """g broadcast back over the reduced axes."""
    fb = ctx.fb
    s = _setup(ctx, op, out_grads)
    if s is None:
        return (None,)
    x, axes, gk = s
    return (expand(fb, gk, x),)


@gradient("mean")
def _mean(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """g / n broadcast back; n is counted at run time when a reduced dim is dynamic."""
    fb = ctx.fb
    s = _setup(ctx, op, out_grads)
    if s is None:
        return (None,)
    x, axes, gk = s
    if not axes:
        return (gk,)
    return (expand(fb, emit(fb, "div", gk, count(fb, x, axes, x.type.dtype)), x),)


@gradient("max", "min")
def _extremum(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """As torch's amax/amin: g split evenly over the elements equal to the extremum."""
    fb = ctx.fb
    s = _setup(ctx, op, out_grads)
    if s is None:
        return (None,)
    x, axes, gk = s
    y = op.results[0]
    yk = y if op.attrs["keepdims"] or not axes else unsqueeze(fb, y, axes)
    mask = emit(fb, "cast", emit(fb, "equal", x, yk), dtype=x.type.dtype)
    ties = emit(fb, "sum", mask, axes=axes, keepdims=True)
    return (emit(fb, "mul", mask, emit(fb, "div", gk, ties)),)


@gradient("softmax")
def _softmax(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """y * (g - sum(g * y))."""
    fb = ctx.fb
    (x,), (y,), (g,) = op.operands, op.results, out_grads
    if g is None or not ctx.wanted(0):
        return (None,)
    axis = norm_axis("softmax", op.attrs["axis"], x.type.rank)
    dot = emit(fb, "sum", emit(fb, "mul", g, y), axes=(axis,), keepdims=True)
    return (emit(fb, "mul", y, emit(fb, "sub", g, dot)),)


@gradient("log_softmax")
def _log_softmax(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """g - exp(y) * sum(g)."""
    fb = ctx.fb
    (x,), (y,), (g,) = op.operands, op.results, out_grads
    if g is None or not ctx.wanted(0):
        return (None,)
    axis = norm_axis("log_softmax", op.attrs["axis"], x.type.rank)
    total = emit(fb, "sum", g, axes=(axis,), keepdims=True)
    return (emit(fb, "sub", g, emit(fb, "mul", emit(fb, "exp", y), total)),)
