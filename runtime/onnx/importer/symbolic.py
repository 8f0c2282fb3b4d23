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
