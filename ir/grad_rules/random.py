"""Gradients of stochastic ops. dropout's mask depends only on the op's seed, the run seed and the shape, so a
dropout of the gradient with the same seed, p and training flag draws the same mask: d x = g * keep / (1 - p)."""

from __future__ import annotations

from ..gradients import GradContext, emit, gradient, is_float
from ..graph import Op, Value


@gradient("dropout")
def _dropout(ctx: GradContext, op: Op, out_grads: tuple[Value | None, ...]) -> tuple[Value | None, ...]:
    (x, training), (g,) = op.operands, out_grads
    if g is None or not is_float(x) or not ctx.wanted(0):
        return (None, None)
    return (emit(ctx, "dropout", g, training, p=op.attrs["p"], seed=op.attrs["seed"]), None)
