"""Gradients of pad and resize.

- pad: the constant mode's gradient is the pad with every pad negated (its pads crop g, its crops put zeros
  back); reflect and edge first fold each axis's padded borders of g back onto the elements they copied
  (flipped slices for reflect, sums for edge), then undo the crops the same way;
- resize: each axis is a constant [in, out] matrix (`resize_matrix`), so g goes back through its transpose.
"""

from __future__ import annotations

from ..errors import PassError
from ..gradients import GradContext, Grads, accumulate, emit, flip, gradient, matmul_along, slice_axis
from ..graph import Op, Value
from ..ops.spatial import resize_matrix


def _zeros_around(ctx: GradContext, v: Value, axis: int, before: int, after: int) -> Value:
    rank = v.type.rank
    return emit(ctx, "pad", v, before=tuple(before if a == axis else 0 for a in range(rank)),
                after=tuple(after if a == axis else 0 for a in range(rank)))


def _fold(ctx: GradContext, g: Value, axis: int, before: int, after: int, mode: str) -> Value:
    """The gradient of one axis's positive reflect/edge pads: g's centre plus its borders on what they copied."""
    if g.type.shape[axis] is None:
        raise PassError(f"pad: the gradient of {mode} padding needs a static length along axis {axis}, got {g.type}")
    n = g.type.shape[axis] - before - after
    dx = slice_axis(ctx, g, axis, before, before + n)
    if before:
        head = slice_axis(ctx, g, axis, 0, before)
        if mode == "reflect":  # output k < before copied x[before - k]
            part = _zeros_around(ctx, flip(ctx, head, (axis,)), axis, 1, n - 1 - before)
        else:
            part = _zeros_around(ctx, emit(ctx, "sum", head, axes=(axis,), keepdims=True), axis, 0, n - 1)
        dx = accumulate(ctx, dx, part)
    if after:
        tail = slice_axis(ctx, g, axis, before + n, before + n + after)
        if mode == "reflect":  # output before + n + k copied x[n - 2 - k]
            part = _zeros_around(ctx, flip(ctx, tail, (axis,)), axis, n - 1 - after, 1)
        else:
            part = _zeros_around(ctx, emit(ctx, "sum", tail, axes=(axis,), keepdims=True), axis, n - 1, 0)
        dx = accumulate(ctx, dx, part)
    return dx  # type: ignore[return-value]


@gradient("pad")
def _pad(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    (g,) = out_grads
    if g is None or not ctx.wanted_float(op, 0):
        return (None,)
    a = op.attrs
    before, after = a["before"], a["after"]
    if a["mode"] != "constant":
        for axis, (b, e) in enumerate(zip(before, after)):
            if b > 0 or e > 0:
                g = _fold(ctx, g, axis, max(b, 0), max(e, 0), a["mode"])
        before, after = tuple(min(b, 0) for b in before), tuple(min(e, 0) for e in after)
    return (emit(ctx, "pad", g, before=tuple(-b for b in before), after=tuple(-e for e in after)),)


@gradient("resize")
def _resize(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    (g,) = out_grads
    if g is None or not ctx.wanted_float(op, 0):
        return (None,)
    x, a = op.operands[0], op.attrs
    for axis in range(2, x.type.rank):
        g = matmul_along(ctx, g, axis, resize_matrix(a, axis - 2, x.type.shape[axis]).T)
    return (g,)
