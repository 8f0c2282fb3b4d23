"""Gradients of reductions (sum, mean, max, min, prod over axes), softmax / log_softmax, and the ops along one axis
(cumsum, topk; argmax and argmin have integer results and no gradient)."""

from __future__ import annotations

from ..gradients import (
    GradContext,
    Grads,
    count,
    emit,
    expand,
    gradient,
    is_float,
    product_of_others,
    split_zeros,
    unsqueeze,
)
from ..graph import Op, Value
from ..ops.common import norm_axes, norm_axis
from .shape import scatter_along


def _setup(ctx: GradContext, op: Op, out_grads: Grads):
    (x,), (g,) = op.operands, out_grads
    if g is None or not is_float(x) or not ctx.wanted(0):
        return None
    axes = norm_axes(op.kind, op.attrs["axes"], x.type.rank)
    keep = g if op.attrs["keepdims"] or not axes or g.type.rank == 0 else unsqueeze(ctx, g, axes)
    return x, axes, keep


def _kept_result(ctx: GradContext, op: Op, axes: tuple[int, ...]) -> Value:
    """The op's result with its reduced axes kept (size 1), to broadcast against x."""
    y = op.results[0]
    return y if op.attrs["keepdims"] or not axes else unsqueeze(ctx, y, axes)


@gradient("sum")
def _sum(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """g broadcast back over the reduced axes."""
    s = _setup(ctx, op, out_grads)
    if s is None:
        return (None,)
    x, axes, gk = s
    return (expand(ctx, gk, x),)


@gradient("mean")
def _mean(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """g / n broadcast back; n is counted at run time when a reduced dim is dynamic."""
    s = _setup(ctx, op, out_grads)
    if s is None:
        return (None,)
    x, axes, gk = s
    if not axes:
        return (gk,)
    return (expand(ctx, emit(ctx, "div", gk, count(ctx, x, axes, x.type.dtype)), x),)


@gradient("max", "min")
def _extremum(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """As torch's amax/amin: g split evenly over the elements equal to the extremum."""
    s = _setup(ctx, op, out_grads)
    if s is None:
        return (None,)
    x, axes, gk = s
    yk = _kept_result(ctx, op, axes)
    mask = emit(ctx, "cast", emit(ctx, "equal", x, yk), dtype=x.type.dtype)
    ties = emit(ctx, "sum", mask, axes=axes, keepdims=True)
    return (emit(ctx, "mul", mask, emit(ctx, "div", gk, ties)),)


@gradient("softmax")
def _softmax(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """y * (g - sum(g * y))."""
    (x,), (y,), (g,) = op.operands, op.results, out_grads
    if g is None or not ctx.wanted(0):
        return (None,)
    axis = norm_axis("softmax", op.attrs["axis"], x.type.rank)
    dot = emit(ctx, "sum", emit(ctx, "mul", g, y), axes=(axis,), keepdims=True)
    return (emit(ctx, "mul", y, emit(ctx, "sub", g, dot)),)


@gradient("log_softmax")
def _log_softmax(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """g - exp(y) * sum(g)."""
    (x,), (y,), (g,) = op.operands, op.results, out_grads
    if g is None or not ctx.wanted(0):
        return (None,)
    axis = norm_axis("log_softmax", op.attrs["axis"], x.type.rank)
    total = emit(ctx, "sum", g, axes=(axis,), keepdims=True)
    return (emit(ctx, "sub", g, emit(ctx, "mul", emit(ctx, "exp", y), total)),)


@gradient("prod")
def _prod(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """g times the product of the other elements of its slice (`product_of_others`: at a zero, the product of the
    nonzero elements if it is the slice's only zero, else 0, as torch's prod_backward gives)."""
    s = _setup(ctx, op, out_grads)
    if s is None:
        return (None,)
    x, axes, gk = s
    zeros, nonzero = split_zeros(ctx, x)
    group_product = emit(ctx, "prod", nonzero, axes=axes, keepdims=True)
    group_zeros = emit(ctx, "sum", zeros, axes=axes, keepdims=True)
    return (emit(ctx, "mul", expand(ctx, gk, x), product_of_others(ctx, zeros, nonzero, group_product, group_zeros)),)


@gradient("argmax", "argmin")
def _arg(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """An i64 index: no gradient."""
    return (None,)


@gradient("cumsum")
def _cumsum(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """The same scan of g in the other direction (x_i reaches every y_j with j at or after i, or after i when
    exclusive)."""
    (x,), (g,) = op.operands, out_grads
    if g is None or not is_float(x) or not ctx.wanted(0):
        return (None,)
    return (emit(ctx, "cumsum", g, axis=op.attrs["axis"], exclusive=op.attrs["exclusive"],
                 reverse=not op.attrs["reverse"]),)


@gradient("topk")
def _topk(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """The values' gradient summed into the positions their indices name; the indices have none."""
    (x,), (_, idx), (g, _) = op.operands, op.results, out_grads
    if g is None or not is_float(x) or not ctx.wanted(0):
        return (None,)
    return (scatter_along(ctx, "topk", x, idx, g, norm_axis("topk", op.attrs["axis"], x.type.rank)),)
