"""Shape vectors known element by element: what ONNX's `Shape` of a tensor with `?` dims gives at import.

torch.onnx.export writes a dynamic batch's reshape as `Shape -> Gather -> Unsqueeze -> Concat -> Reshape`. Each
element of such a vector is a known int, "dim `axis` of kiln value `value`", or a run-time product of such
(`Computed`), so the vector survives those nodes (and arithmetic on them) and reaches the `Reshape` (or
`Expand`) that consumes it: a reshape copies run-time dims from their value, an expand turns them into -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.ir import Value


@dataclass(frozen=True, eq=False)
class DimOf:
    """Dim `axis` of `value`, whose size is known only at run time."""

    value: Value
    axis: int

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DimOf) and other.value is self.value and other.axis == self.axis

    def __hash__(self) -> int:
        return hash((id(self.value), self.axis))


class Computed:
    """A run-time element computed from dims by arithmetic (`batch * seq`): known to exist, not by value."""


Item = int | DimOf | Computed


@dataclass(frozen=True)
class ShapeVector:
    """An int64 tensor of rank 1 (or 0 when `scalar`) whose elements are ints or run-time dims."""

    items: tuple[Item, ...]
    scalar: bool = False

    @staticmethod
    def of(value: Value) -> ShapeVector:
        """The shape of `value`: its static dims as ints, its `?` dims as `DimOf`."""
        return ShapeVector(tuple(DimOf(value, a) if d is None else d for a, d in enumerate(value.type.shape)))

    @staticmethod
    def known(array: np.ndarray) -> ShapeVector | None:
        """The vector of an integer array of rank 0 or 1, else None."""
        if array.dtype.kind not in "iu" or array.ndim > 1:
            return None
        return ShapeVector(tuple(int(x) for x in array.reshape(-1)), array.ndim == 0)

    def static(self) -> np.ndarray | None:
        """The vector as an int64 array when every element is an int."""
        if any(not isinstance(x, int) for x in self.items):
            return None
        array = np.asarray(self.items, np.int64)
        return array.reshape(()) if self.scalar else array


def _pair(a: ShapeVector, b: ShapeVector) -> list[tuple[Item, Item]] | None:
    """The elements of two vectors side by side, a one-element vector repeated; None when they do not pair up."""
    n = max(len(a.items), len(b.items))
    if {len(a.items), len(b.items)} - {1, n}:
        return None
    return list(zip(a.items * (n // len(a.items)), b.items * (n // len(b.items))))


def vector_equal(a: ShapeVector, b: ShapeVector) -> np.ndarray | None:
    """ONNX Equal of two shape vectors where every element is decided at import: ints compare, and a run-time size
    (never negative) differs from a negative int, the `-1` torch's `expand(-1)` tests for; else None."""
    pairs = _pair(a, b)
    out = []
    for x, y in pairs or ():
        if isinstance(x, int) and isinstance(y, int):
            out.append(x == y)
        elif (isinstance(x, int) and x < 0) or (isinstance(y, int) and y < 0):
            out.append(False)
        else:
            return None
    return np.asarray(out, bool).reshape(() if a.scalar and b.scalar else -1) if pairs is not None else None


def vector_where(cond: np.ndarray, a: ShapeVector, b: ShapeVector) -> ShapeVector | None:
    """ONNX Where on a known condition between shape vectors, element by element; None when they do not pair up."""
    picked = _pair(a, b)
    flags = np.reshape(cond, -1).tolist()
    if picked is None or cond.ndim > 1 or len(flags) not in (1, len(picked)):
        return None
    flags = flags * (len(picked) // len(flags))
    return ShapeVector(tuple(x if f else y for f, (x, y) in zip(flags, picked)), a.scalar and b.scalar)
