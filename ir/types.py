"""Tensor types: a shape of static (int) or dynamic (None, printed `?`) dims and a DType."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .dtypes import DType
from .errors import ShapeError

Dim = int | None


@dataclass(frozen=True, slots=True)
class TensorType:
    """The type of an SSA value, parameter or flag."""

    shape: tuple[Dim, ...]
    dtype: DType

    def __post_init__(self) -> None:
        for d in self.shape:
            if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 0):
                raise ShapeError(f"invalid dimension {d!r} in shape {self.shape}")

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return None not in self.shape

    def numel(self) -> int:
        """Element count of a static type."""
        if not self.is_static:
            raise ShapeError(f"{self} has dynamic dims and no element count")
        n = 1
        for d in self.shape:
            n *= d  # type: ignore[operator]
        return n

    def with_shape(self, shape: Iterable[Dim]) -> TensorType:
        return TensorType(tuple(shape), self.dtype)

    def with_dtype(self, dtype: DType) -> TensorType:
        return TensorType(self.shape, dtype)

    def matches(self, shape: Sequence[int]) -> bool:
        """Whether a concrete shape is an instance of this (possibly dynamic) type."""
        return len(shape) == len(self.shape) and all(d is None or d == s for d, s in zip(self.shape, shape))

    def __str__(self) -> str:
        dims = "".join(("?" if d is None else str(d)) + "x" for d in self.shape)
        return f"tensor<{dims}{self.dtype.value}>"


def broadcast_shapes(*shapes: tuple[Dim, ...], what: str = "operands") -> tuple[Dim, ...]:
    """Numpy broadcasting over static and dynamic dims; a `?` against n>1 is taken to be n."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for i in range(rank):
        dims = [s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0]
        known = {d for d in dims if d is not None and d != 1}
        if len(known) > 1:
            raise ShapeError(f"{what}: shapes {' and '.join(_fmt(s) for s in shapes)} do not broadcast")
        if known:
            out.append(known.pop())
        elif None in dims:
            out.append(None)
        else:
            out.append(1)
    return tuple(out)


def _fmt(shape: tuple[Dim, ...]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
