"""Liveness of a scheduled function: which op results are alive at each op, and the peak of their bytes.

The schedule is the op order. A result is alive from the op that defines it to its last use (to the end when the
function returns it); at each op, its operands and its results are alive together. Arguments, parameters and
flags are not counted: the peak measures activations, what checkpointing trades against recomputation.
"""

from __future__ import annotations

from .errors import ShapeError
from .graph import Function, Value
from .types import TensorType


def value_bytes(t: TensorType, batch: int | None = None) -> int:
    """Bytes of a value of type t, its dynamic dims taken to be `batch`."""
    if not t.is_static and batch is None:
        raise ShapeError(f"{t} has dynamic dims: give a batch size to measure it")
    n = 1
    for d in t.shape:
        n *= batch if d is None else d  # type: ignore[operator]
    return n * t.dtype.numpy.itemsize


def last_uses(fn: Function) -> dict[int, int]:
    """id(value) -> index of the last op using it (len(fn.ops) for a returned value)."""
    last: dict[int, int] = {}
    for i, op in enumerate(fn.ops):
        for o in op.operands:
            if isinstance(o, Value):
                last[id(o)] = i
    for r in fn.results:
        if isinstance(r, Value):
            last[id(r)] = len(fn.ops)
    return last


def live_bytes(fn: Function, batch: int | None = None) -> list[int]:
    """Bytes of op results alive while each op runs (its operands and its results included)."""
    last = last_uses(fn)
    frees: dict[int, int] = {}
    for op in fn.ops:
        for r in op.results:
            if id(r) in last:  # an unused result is freed by the op that makes it
                frees[last[id(r)]] = frees.get(last[id(r)], 0) + value_bytes(r.type, batch)
    alive, out = 0, []
    for i, op in enumerate(fn.ops):
        made = sum(value_bytes(r.type, batch) for r in op.results)
        unused = sum(value_bytes(r.type, batch) for r in op.results if id(r) not in last)
        out.append(alive + made)
        alive += made - unused - frees.get(i, 0)
    return out


def peak_live_bytes(fn: Function, batch: int | None = None) -> int:
    """The most bytes of op results alive at once over the op order."""
    return max(live_bytes(fn, batch), default=0)
