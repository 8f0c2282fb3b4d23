"""TIR expressions over a row in vectors, for the hand-written kernels (`pool_rows.py`, `softmax_rows.py`,
`norm_rows.py`).

A row no vector divides is computed in whole vectors with its last one overlapping the one before it, so no lane is
ever guarded; one lane is a scalar, so a row narrower than two elements needs no special case.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tvm import tirx
from tvm.script.ir_builder import tirx as ib


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


def zero_sums(sums: tirx.Buffer, vectors: int, lanes: int) -> None:
    """Emit the stores zeroing a register tile's `vectors` f32 sums of `lanes` lanes (unrolled), in the kernel being
    parsed."""
    for i in range(vectors):
        ib.buffer_store(sums, splat(0.0, lanes), [at(i * lanes, lanes)])


def across(vector: tirx.PrimExpr, lanes: int, combine: Callable[[tirx.PrimExpr, tirx.PrimExpr], tirx.PrimExpr]
           ) -> tirx.PrimExpr:
    """`vector`'s lanes combined into a scalar by halves (log2 `lanes` steps of a shuffle and `combine`)."""
    while lanes > 1:
        half = lanes // 2
        vector = combine(*(tirx.Shuffle([vector], [tirx.const(i, "int32") for i in range(start, start + half)])
                           for start in (0, half)))
        lanes = half
    return vector


@dataclass(frozen=True)
class RowSplit:
    """A row of `width` elements in vectors of `step` lanes (`row_vector`): `whole` vectors from element 0, then the
    last from `tail`, overlapping the one before it where `step` does not divide the width."""

    width: int
    step: int

    @classmethod
    def of(cls, width: int, lanes: int) -> RowSplit:
        return cls(width, row_vector(width, lanes))

    @property
    def whole(self) -> int:
        return (self.width - 1) // self.step

    @property
    def tail(self) -> int:
        return self.width - self.step

    @property
    def starts(self) -> list[int]:
        """Where each vector starts: the whole ones, then the last (at most `step` past the one before it)."""
        return [*range(0, self.whole * self.step, self.step), self.tail]

    def fresh(self, value: tirx.PrimExpr) -> tirx.PrimExpr:
        """The last vector's float32 `value` with the lanes the vector before it covered as 0, for a sum: a select
        whose condition is constant per lane (none where the vectors tile the row)."""
        if self.tail == self.whole * self.step:
            return value
        ahead = at(self.tail, self.step) >= splat(self.whole * self.step, self.step, "int32")
        return tirx.Select(ahead, value, splat(0.0, self.step))
