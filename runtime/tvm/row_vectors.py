"""TIR expressions over a row in vectors, for the hand-written kernels (`pool_rows.py`, `softmax_rows.py`).

A row no vector divides is computed in whole vectors with its last one overlapping the one before it, so no lane is
ever guarded; one lane is a scalar, so a row narrower than two elements needs no special case.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import tirx


def row_vector(extent: int, lanes: int) -> int:
    """Lanes of the vectors a row of `extent` elements is computed in: the widest power of two up to `lanes` that
    is no wider than the row (its last vector overlaps the one before it)."""
    width = 1
    while width * 2 <= min(extent, lanes):
        width *= 2
    return width


def at(start: tirx.PrimExpr | int, lanes: int) -> tirx.PrimExpr:
    """The index of `lanes` consecutive elements from `start` (one element: the scalar index)."""
    return start if lanes == 1 else tirx.Ramp(start, 1, lanes)


def splat(value: tirx.PrimExpr | float | int, lanes: int, dtype: str = "float32") -> tirx.PrimExpr:
    """`value` in every lane (a Python number as a `dtype` constant)."""
    value = tirx.const(value, dtype) if isinstance(value, (int, float)) else value
    return value if lanes == 1 else tirx.Broadcast(value, lanes)


def across(vector: tirx.PrimExpr, lanes: int, combine: Callable[[tirx.PrimExpr, tirx.PrimExpr], tirx.PrimExpr]
           ) -> tirx.PrimExpr:
    """`vector`'s lanes combined into a scalar by halves (log2 `lanes` steps of a shuffle and `combine`)."""
    while lanes > 1:
        half = lanes // 2
        vector = combine(*(tirx.Shuffle([vector], [tirx.const(i, "int32") for i in range(start, start + half)])
                           for start in (0, half)))
        lanes = half
    return vector
