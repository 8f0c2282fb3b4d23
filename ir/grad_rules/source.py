"""Ops without operands (constant, zeros, ones, full): nothing to differentiate."""

from __future__ import annotations

from ..gradients import GradContext, gradient
from ..graph import Op, Value


@gradient("constant", "zeros", "ones", "full")
def _source(ctx: GradContext, op: Op, out_grads: tuple[Value | None, ...]) -> tuple[Value | None, ...]:
    return ()
