"""`Loop` with a trip count and conditions known at import, unrolled: the body is converted once per iteration
with the iteration number, condition and loop-carried values bound, and each scan output's per-iteration values
are stacked along a new leading axis. A loop whose carried values change shape, whose condition is computed at
run time, or whose trip count is unknown is refused, naming the node."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .call import NodeCall, Output
from .registry import Unsupported, converts
from .symbolic import ShapeVector

MAX_UNROLL = 4096
"""The most iterations kiln unrolls: a longer loop would make a graph of that many copies of its body."""


def _shape(out: Output) -> tuple | None:
    """The shape of a carried value where it is known at import."""
    if isinstance(out, np.ndarray):
        return out.shape
    if isinstance(out, ShapeVector):
        return None
    return tuple(out.type.shape)  # a value or a parameter's symbol


def _flag(out: Output, what: str) -> bool:
    if not isinstance(out, np.ndarray):
        raise Unsupported(f"{what} is computed at run time; kiln unrolls loops whose conditions it knows at import")
    return bool(np.reshape(out, -1)[0])


@converts("Loop", since=1)
def _loop(call: NodeCall) -> Sequence[Output]:
    if call.inline is None:
        raise Unsupported("Loop inside a folded sub-graph")
    trips = call.value(0, "the trip count")
    if trips is None:
        raise Unsupported("a Loop without a trip count (M): kiln unrolls loops of a trip count known at import")
    trips = int(np.reshape(trips, -1)[0])
    if trips > MAX_UNROLL:
        raise Unsupported(f"trip count {trips} is more than the {MAX_UNROLL} iterations kiln unrolls")
    going = call.value(1, "the loop condition")
    going = True if going is None else bool(np.reshape(going, -1)[0])
    body = call.required("body")
    # as kiln values: a parameter stays one (a constant is still known to the body's nodes, which fold on it)
    carried: list[Output] = [call.input(i) for i in range(2, len(call.node.input))]
    scans: list[list[Output]] = [[] for _ in range(len(body.output) - 1 - len(carried))]
    for i in range(trips):
        if not going:
            break
        outs = call.inline(body, [np.array(i, np.int64), np.array(going), *carried])
        going = _flag(outs[0], f"the body's condition at iteration {i}")
        for k, (old, new) in enumerate(zip(carried, outs[1:1 + len(carried)])):
            if isinstance(new, ShapeVector) or _shape(old) != _shape(new):
                raise Unsupported(f"loop-carried value {k} changes from {_shape(old)} to {_shape(new)} at "
                                  f"iteration {i}")
        carried = list(outs[1:1 + len(carried)])
        for scan, value in zip(scans, outs[1 + len(carried):]):
            scan.append(value)
    if scans and not scans[0]:
        raise Unsupported("a Loop of no iterations with scan outputs (their shape is unknown at import)")
    return (*carried, *(_stack(call, scan) for scan in scans))


def _stack(call: NodeCall, values: list[Output]) -> Output:
    """One scan output: the iterations' values along a new leading axis."""
    if all(isinstance(v, np.ndarray) for v in values):
        return np.stack(values)  # type: ignore[arg-type]
    parts = [call.constant(v) if isinstance(v, np.ndarray) else v for v in values]
    if any(isinstance(p, ShapeVector) for p in parts):
        raise Unsupported("a scan output that is a shape computed at run time")
    rows = [call.emit("reshape", p, shape=(1, *(-1 if d is None else d for d in p.type.shape))) for p in parts]
    return rows[0] if len(rows) == 1 else call.emit("concat", *rows, axis=0)
