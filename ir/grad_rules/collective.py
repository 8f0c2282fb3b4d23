"""Gradients of collectives. all_reduce's result is the same combination of every rank's operand on every rank, so
the gradient reaching rank r's operand combines every rank's result gradient the same way: d x = all_reduce(g).
broadcast has none: it is what a step's update ends with, never what a loss is computed through."""

from __future__ import annotations

from ..errors import PassError
from ..gradients import GradContext, gradient
from ..graph import Op, Value


@gradient("all_reduce")
def _all_reduce(ctx: GradContext, op: Op, out_grads: tuple[Value | None, ...]) -> tuple[Value | None, ...]:
    wanted = [i for i, g in enumerate(out_grads) if g is not None and ctx.wanted(i)]
    if not wanted:
        return (None,) * len(op.operands)
    reduced = ctx.emit("all_reduce", *(out_grads[i] for i in wanted), op=op.attrs["op"], group=op.attrs["group"])
    grads: list[Value | None] = [None] * len(op.operands)
    for i, g in zip(wanted, reduced if isinstance(reduced, tuple) else (reduced,)):
        grads[i] = g
    return tuple(grads)


@gradient("broadcast")
def _broadcast(ctx: GradContext, op: Op, out_grads: tuple[Value | None, ...]) -> tuple[Value | None, ...]:
    """Only rank src's operands reach the results, and which rank this is the graph does not know."""
    raise PassError(f"broadcast: no gradient (it would be a reduction to rank {op.attrs['src']} alone); "
                    "broadcast the results of a step's update, not values a loss depends on")


@gradient("all_reduce_start")
@gradient("all_reduce_wait")
def _split(ctx: GradContext, op: Op, out_grads: tuple[Value | None, ...]) -> tuple[Value | None, ...]:
    """The halves exist only after autodiff (data-parallel{overlap} splits the gradients' all_reduces)."""
    raise PassError(f"{op.kind}: no gradient (data-parallel places it after autodiff); differentiate all_reduce")
